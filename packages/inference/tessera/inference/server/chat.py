"""POST /v1/chat/completions (OpenAI), rendered with the tokenizer's chat template."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tessera.inference.chat_template import ChatTemplateError, render_chat
from tessera.inference.protocol import ChatCompletionRequest, ChatMessage
from tessera.inference.sequence import TokenLogprob
from tessera.inference.server.base import ServerBase
from tessera.inference.server.errors import ApiError, _check_text, _now, _usage


def _chat_logprobs(srv: ServerBase, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = srv._token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}

def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the chat template sees them."""
    try:
        out = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    for i, m in enumerate(messages):
        for field in ("tool_calls", "function_call"):
            if (m.model_extra or {}).get(field):
                raise ApiError(400, f"messages[{i}].{field}: tool calls are not supported by this server",
                               param=f"messages.{i}.{field}")
    return out


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = kwargs or {}
    reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt"})
    if reserved:
        raise ApiError(400, f"chat_template_kwargs must not set {', '.join(reserved)} (give it as a request field)",
                       param="chat_template_kwargs")
    return kwargs


def _encode_chat(srv: ServerBase, messages: list[dict[str, Any]], add_generation_prompt: bool,
                 kwargs: dict[str, Any], add_special_tokens: bool = False) -> list[int]:
    """Render the chat template and tokenize it; on a tokenizer thread (see _off_loop)."""
    try:
        text = render_chat(srv.tokenizer, messages, add_generation_prompt, **kwargs)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    srv._check_chars(text, "messages")
    _check_text(text, "messages")
    ids = srv._encode(text, add_special_tokens)  # the template already placed any special tokens
    srv._check_prompt(ids)
    return ids

async def chat(srv: ServerBase, body: ChatCompletionRequest, request: Request):
    srv._check_model(body.model)
    srv._check_supported(body)
    messages = chat_messages(body.messages)
    kwargs = template_kwargs(body.chat_template_kwargs)
    srv._check_chars("".join(m["content"] for m in messages), "messages")
    ids = await srv._off_loop(_encode_chat, srv, messages, body.add_generation_prompt, kwargs)
    max_tokens = srv._resolve_max_tokens(
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens, len(ids))
    top = body.top_logprobs or 0 if body.logprobs else None
    structured = await srv._structured_spec(body)
    jobs = [(ids, body.sampling_params(max_tokens, top, index=j, structured=structured)) for j in range(body.n)]
    submitted = srv._submit_all("chat", jobs)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = _now()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    if body.stream:
        async def events() -> AsyncIterator[str]:
            completion_tokens = 0
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name}
            extra = {"usage": None} if include_usage else {}
            for i in range(len(jobs)):
                yield srv._sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}], **extra})
            async for i, out in srv._merged(submitted, request):
                if out.finished:
                    completion_tokens += out.num_output_tokens
                if not (out.new_text or out.finished or out.new_logprobs):
                    continue
                delta = {"content": out.new_text} if out.new_text else {}
                choice = {"index": i, "delta": delta,
                          "logprobs": _chat_logprobs(srv, out.new_logprobs) if body.logprobs else None,
                          "finish_reason": out.finish_reason if out.finished else None}
                yield srv._sse({**base, "choices": [choice], **extra})
            if include_usage:
                yield srv._sse({**base, "choices": [], "usage": _usage(len(ids) * len(jobs), completion_tokens)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(srv._sse_guard(events()), media_type="text/event-stream")

    collected = await srv._collect(submitted, request, len(jobs))
    if collected is None:
        return Response(status_code=499)
    texts, lps, final = collected
    choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                "logprobs": _chat_logprobs(srv, lps[i]) if body.logprobs else None,
                "finish_reason": f.finish_reason}
               for i, f in enumerate(final)]
    completion_tokens = sum(f.num_output_tokens for f in final)
    return {"id": rid, "object": "chat.completion", "created": created, "model": srv.model_name,
            "choices": choices, "usage": _usage(len(ids) * len(jobs), completion_tokens)}
