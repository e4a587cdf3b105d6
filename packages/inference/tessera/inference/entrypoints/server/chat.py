"""POST /v1/chat/completions (OpenAI), rendered with the tokenizer's chat template."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tessera.inference.core.json_depth import JsonTooDeep, loads
from tessera.inference.core.sequence import TokenLogprob
from tessera.inference.entrypoints.protocol import ChatCompletionRequest, ChatMessage, FieldError
from tessera.inference.entrypoints.server.base import ServerBase, SseResponse, StreamChunks
from tessera.inference.entrypoints.server.errors import ApiError, _check_text, _now, _usage
from tessera.inference.entrypoints.server.images import expand, load_images, template_parts
from tessera.inference.entrypoints.tools import ToolCallStream, parser_for_template, tool_grammar


def _chat_logprobs(srv: ServerBase, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = srv._token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}

def chat_messages(messages: list[ChatMessage], model: str = "", vision: bool = False,
                  urls: list[str] | None = None) -> list[dict[str, Any]]:
    """The request's messages as the chat template sees them: an assistant's `tool_calls` (their
    JSON `arguments` as objects, as vLLM hands them to templates) and a tool message's
    `tool_call_id` included. For a vision-language model (`vision`) each content is a list of
    parts and the image URLs are appended to `urls` in order (server/images.py)."""
    out = []
    for i, m in enumerate(messages):
        if (m.model_extra or {}).get("function_call"):
            raise ApiError(400, f"messages[{i}].function_call: the deprecated function_call is not supported; "
                           "use tool_calls", param=f"messages.{i}.function_call")
        if vision and not (m.content is None and m.tool_calls):
            parts, found = template_parts(m.content, f"messages[{i}]")
            msg: dict[str, Any] = {"role": m.role, "content": parts}
            if urls is not None:
                urls.extend(found)
        elif isinstance(m.content, list) and any(p.get("type") == "image_url" for p in m.content):
            raise ApiError(400, f"messages[{i}]: an image_url part needs a vision-language model; model {model!r} "
                           "reads text only", param="messages", code="images_unsupported")
        else:
            try:
                msg = {"role": m.role, "content": None if m.content is None and m.tool_calls else m.text()}
            except ValueError as exc:
                raise ApiError(400, str(exc), param="messages") from None
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [_history_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def _history_call(i: int, j: int, call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"messages[{i}].tool_calls: each call needs function.name", param=f"messages.{i}.tool_calls")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = loads(args)
        except JsonTooDeep as exc:
            raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments {exc}",
                           param=f"messages.{i}.tool_calls.{j}.function.arguments") from None
        except json.JSONDecodeError:
            pass  # not JSON: the template gets the string
    return {**call, "function": {**fn, "arguments": args}}


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content or ""


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = kwargs or {}
    reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt"})
    if reserved:
        raise ApiError(400, f"chat_template_kwargs must not set {', '.join(reserved)} (give it as a request field)",
                       param="chat_template_kwargs")
    return kwargs


async def _encode_chat(srv: ServerBase, messages: list[dict[str, Any]], add_generation_prompt: bool,
                       kwargs: dict[str, Any], add_special_tokens: bool = False) -> list[int]:
    """Render the chat template (in a template process) and tokenize the text (on a tokenizer thread)."""
    text = await srv._render_chat(messages, add_generation_prompt, kwargs)
    return await srv._off_loop(_encode_rendered, srv, text, add_special_tokens)


def _encode_rendered(srv: ServerBase, text: str, add_special_tokens: bool) -> list[int]:
    srv._check_chars(text, "messages")
    _check_text(text, "messages")
    ids = srv._encode(text, add_special_tokens)  # the template already placed any special tokens
    srv._check_prompt(ids)
    return ids

async def chat(srv: ServerBase, body: ChatCompletionRequest, request: Request):
    srv._check_model(body.model)
    srv._check_generates()
    srv._check_supported(body)
    try:
        mode, function = body.tool_mode()
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    urls: list[str] = []
    messages = chat_messages(body.messages, srv.model_name, srv.vision is not None, urls)
    kwargs = template_kwargs(body.chat_template_kwargs)
    if body.tools:
        kwargs = {**kwargs, "tools": body.tools}
    srv._check_chars("".join(_text_of(m["content"]) for m in messages), "messages")
    # Images are read and decoded first, on a tokenizer thread: a bad one is a 400 before any render.
    pixels = await srv._off_loop(load_images, urls, srv.vision, srv.limits.images) if urls else []
    ids = await _encode_chat(srv, messages, body.add_generation_prompt, kwargs, body.add_special_tokens)
    images = []
    if srv.vision is not None:
        ids, images = await srv._off_loop(expand, ids, pixels, srv.vision)
        srv._check_prompt(ids)
    max_tokens = srv._resolve_max_tokens(
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens, len(ids))
    top = body.top_logprobs or 0 if body.logprobs else None
    structured = await srv._structured_spec(body)
    tool_spec = tool_grammar(mode, body.tools or [], function, body.parallel_tool_calls)  # type: ignore[arg-type]
    if tool_spec is not None:
        if structured is not None:
            raise ApiError(400, f"tool_choice {mode!r} is enforced with a grammar and cannot be combined with "
                           "response_format or guided_* fields", param="tool_choice")
        await srv._check_grammar(tool_spec, "tools", f"tools: the grammar of tool_choice {mode!r} over the "
                                 "functions' parameters schemas: ")
        structured = tool_spec
    parser = srv.tool_call_parser
    if parser == "auto":
        parser = parser_for_template(str(srv.tokenizer.chat_template or ""))

    def tool_stream() -> ToolCallStream:
        return ToolCallStream(mode, parser, function)  # type: ignore[arg-type]
    jobs = [(ids, body.sampling_params(max_tokens, top, index=j, structured=structured,
                                       defaults=srv.generation_defaults).model_copy(update={"images": images}))
            for j in range(body.n)]
    submitted = srv._submit_all("chat", jobs, body.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = _now()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    if body.stream:
        async def events() -> AsyncIterator[str]:
            completion_tokens = 0
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name}
            chunks = StreamChunks(rid, "chat.completion.chunk", created, srv.model_name, include_usage)
            for i in range(len(jobs)):
                yield chunks.event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None})
            streams = [tool_stream() for _ in jobs]
            async for i, out in srv._merged(submitted, request, watch=False):
                if out.finished:
                    completion_tokens += out.num_output_tokens
                deltas = streams[i].feed(out.new_text)
                if out.finished:
                    deltas += streams[i].finish()
                if not (deltas or out.finished or out.new_logprobs):
                    continue
                deltas = deltas or [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    reason = streams[i].finish_reason(out.finish_reason) if out.finished and last else None
                    if not (body.logprobs and k == 0) and len(delta) == 1 and isinstance(delta.get("content"), str):
                        yield chunks.content(i, delta["content"], reason)  # the commonest chunk, written directly
                        continue
                    yield chunks.event({"index": i, "delta": delta, "logprobs": _chat_logprobs(srv, out.new_logprobs)
                                        if body.logprobs and k == 0 else None, "finish_reason": reason})
            usage = srv._sse({**base, "choices": [], "usage": _usage(len(ids) * len(jobs), completion_tokens)}) \
                if include_usage else ""
            yield usage + "data: [DONE]\n\n"  # one write for both

        return SseResponse(events())

    collected = await srv._collect(submitted, request, len(jobs))
    if collected is None:
        return Response(status_code=499)
    texts, lps, final = collected
    choices = []
    for i, f in enumerate(final):
        stream = tool_stream()
        stream.feed(texts[i])
        stream.finish()
        message: dict[str, Any] = {"role": "assistant", "content": texts[i] if mode == "none" else stream.content}
        if stream.tool_calls:
            message["tool_calls"] = stream.tool_calls
        choices.append({"index": i, "message": message,
                        "logprobs": _chat_logprobs(srv, lps[i]) if body.logprobs else None,
                        "finish_reason": stream.finish_reason(f.finish_reason)})
    completion_tokens = sum(f.num_output_tokens for f in final)
    return {"id": rid, "object": "chat.completion", "created": created, "model": srv.model_name,
            "choices": choices, "usage": _usage(len(ids) * len(jobs), completion_tokens)}
