"""POST /v1/completions (OpenAI, with vLLM's sampling extensions)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tessera.inference.protocol import CompletionRequest
from tessera.inference.sequence import TokenLogprob
from tessera.inference.server.base import ServerBase
from tessera.inference.server.errors import ApiError, _now, _usage


def _completion_logprobs(srv: ServerBase, lps: list[TokenLogprob | None], offset: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        if lp is None:  # the first prompt token has no logprob
            continue
        text = srv._token_text(lp.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({srv._token_text(t): v for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset

async def completions(srv: ServerBase, body: CompletionRequest, request: Request):
    srv._check_model(body.model)
    srv._check_supported(body)
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of is supported only equal to n (this server does not rank candidates)",
                       param="best_of")
    raw = body.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        prompts = [raw]
    else:
        prompts = list(raw)
    if not prompts:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if len(prompts) * body.n > srv.limits.max_prompts:
        raise ApiError(400, f"{len(prompts)} prompts x n={body.n} exceeds this server's limit of "
                       f"{srv.limits.max_prompts} per request", param="prompt")
    ids_list = await srv._off_loop(lambda: [srv._encode_prompt(p) for p in prompts])
    jobs = []
    for ids in ids_list:
        max_tokens = srv._resolve_max_tokens(body.max_tokens, len(ids))
        for j in range(body.n):
            params = body.sampling_params(max_tokens, body.logprobs, index=j)
            if body.echo and body.logprobs is not None:
                params = params.model_copy(update={"prompt_logprobs": True})
            jobs.append((ids, params))
    submitted = srv._submit_all("cmpl", jobs)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = _now()
    n = body.n
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def echo_text(i: int) -> str:
        return srv.tokenizer.decode(ids_list[i // n], skip_special_tokens=True) if body.echo else ""

    if body.stream:
        async def events() -> AsyncIterator[str]:
            offsets = [0] * len(jobs)
            started = [False] * len(jobs)
            prompt_tokens = completion_tokens = 0
            async for i, out in srv._merged(submitted, request):
                text = out.new_text
                lp_lists: list[TokenLogprob | None] = list(out.new_logprobs)
                if not started[i]:
                    started[i] = True
                    text = echo_text(i) + text
                if out.finished and out.prompt_logprobs is not None and body.echo:
                    lp_lists = [None, *out.prompt_logprobs, *lp_lists]
                choice: dict[str, Any] = {"index": i, "text": text, "logprobs": None,
                                          "finish_reason": out.finish_reason if out.finished else None}
                if body.logprobs is not None:
                    choice["logprobs"], offsets[i] = _completion_logprobs(srv, lp_lists, offsets[i])
                if out.finished:
                    prompt_tokens += out.num_prompt_tokens
                    completion_tokens += out.num_output_tokens
                if text or out.finished or out.new_logprobs:
                    chunk = {"id": rid, "object": "text_completion", "created": created,
                             "model": srv.model_name, "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = None
                    yield srv._sse(chunk)
            if include_usage:
                yield srv._sse({"id": rid, "object": "text_completion", "created": created,
                                 "model": srv.model_name, "choices": [],
                                 "usage": _usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(srv._sse_guard(events()), media_type="text/event-stream")

    collected = await srv._collect(submitted, request, len(jobs))
    if collected is None:
        return Response(status_code=499)  # client went away; nobody reads this
    texts, lps, final = collected
    choices = []
    for i, out in enumerate(final):
        if body.echo and out.prompt_logprobs is not None:
            lps[i] = [None, *out.prompt_logprobs, *lps[i]]
        choices.append({
            "index": i, "text": echo_text(i) + texts[i], "finish_reason": out.finish_reason,
            "logprobs": _completion_logprobs(srv, lps[i], 0)[0] if body.logprobs is not None else None,
        })
    prompt_tokens = sum(f.num_prompt_tokens for f in final)
    completion_tokens = sum(f.num_output_tokens for f in final)
    return {"id": rid, "object": "text_completion", "created": created, "model": srv.model_name,
            "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}
