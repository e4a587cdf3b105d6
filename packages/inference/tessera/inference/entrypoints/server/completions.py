"""POST /v1/completions (OpenAI, with vLLM's sampling extensions)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tessera.inference.core.detokenizer import decode_with_offsets
from tessera.inference.core.sequence import TokenLogprob
from tessera.inference.entrypoints.protocol import CompletionRequest
from tessera.inference.entrypoints.server.base import ServerBase, SseResponse, StreamChunks
from tessera.inference.entrypoints.server.errors import ApiError, _now, _usage


def _completion_logprobs(srv: ServerBase, entries: list[tuple[int, TokenLogprob | None]],
                         offsets: list[int]) -> dict[str, Any]:
    """OpenAI's completion logprobs over (token id, its logprob) pairs, vLLM's way: the first
    prompt token has a null logprob and null top_logprobs; top_logprobs also hold the chosen
    token (so up to n + 1 entries); text_offset[i] is where token i starts in the choice's text."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
    for token, lp in entries:
        out["tokens"].append(srv._token_text(token))
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(lp.logprob)
        top = {srv._token_text(t): v for t, v in lp.top}
        top.setdefault(srv._token_text(token), lp.logprob)
        out["top_logprobs"].append(top)
    return out


def _generated_offsets(srv: ServerBase, ids: list[int], text: str, start: int, skip_special: bool) -> list[int]:
    """text_offset of generated tokens whose text (stop strings cut, EOS dropped) is `text`,
    placed at `start` in the choice's text."""
    _, offsets = decode_with_offsets(srv.tokenizer, ids, skip_special)
    return [start + min(o, len(text)) for o in offsets]


async def completions(srv: ServerBase, body: CompletionRequest, request: Request):
    srv._check_model(body.model)
    srv._check_generates()
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
    skip_special = body.skip_special_tokens

    def encode() -> tuple[list[list[int]], list[tuple[str, list[int]]]]:
        ids_list = [srv._encode_prompt(p, body.add_special_tokens) for p in prompts]
        # The echoed prompt: its text and where each of its tokens starts in it.
        return ids_list, [decode_with_offsets(srv.tokenizer, ids, skip_special) if body.echo else ("", [])
                          for ids in ids_list]

    # Token-id prompts without echo need no tokenizer: checked here, not worth a tokenizer thread's hop.
    text = body.echo or any(isinstance(p, str) for p in prompts)
    ids_list, echoed = await srv._off_loop(encode) if text else encode()
    structured = await srv._structured_spec(body)
    jobs = []
    for ids in ids_list:
        # max_tokens 0 with echo scores the prompt only (vLLM accepts it; evaluation harnesses use it).
        max_tokens = srv._resolve_max_tokens(body.max_tokens, len(ids), allow_zero=body.echo)
        for j in range(body.n):
            params = body.sampling_params(max_tokens, body.logprobs, index=j,
                                          prompt_logprobs=body.echo and (body.logprobs is not None or max_tokens == 0),
                                          structured=structured, defaults=srv.generation_defaults)
            jobs.append((ids, params))
    submitted = srv._submit_all("cmpl", jobs, body.n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = _now()
    n = body.n
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def prompt_entries(i: int, prompt_lps: list[TokenLogprob | None] | None) -> tuple[list, list[int]]:
        """The prompt's (token, logprob) pairs and offsets, when echoed with logprobs."""
        if not body.echo or prompt_lps is None:
            return [], []
        ids = ids_list[i // n]
        return [(ids[0], None), *((lp.token_id, lp) for lp in prompt_lps if lp is not None)], echoed[i // n][1]

    if body.stream:
        async def events() -> AsyncIterator[str]:
            offsets = [len(echoed[i // n][0]) for i in range(len(jobs))]  # where the next piece starts
            started = [False] * len(jobs)
            prompt_tokens = completion_tokens = 0
            chunks = StreamChunks(rid, "text_completion", created, srv.model_name, include_usage)
            async for i, out in srv._merged(submitted, request, watch=False):
                if out.finished:
                    prompt_tokens += out.num_prompt_tokens
                    completion_tokens += out.num_output_tokens
                if started[i] and body.logprobs is None:  # the commonest chunk: new text only
                    if out.new_text or out.finished:
                        yield chunks.text(i, out.new_text, out.finish_reason if out.finished else None)
                    continue
                text = out.new_text
                entries: list[tuple[int, TokenLogprob | None]] = []
                offs: list[int] = []
                if not started[i]:
                    started[i] = True
                    text = echoed[i // n][0] + text
                    entries, offs = prompt_entries(i, out.prompt_logprobs)
                choice: dict[str, Any] = {"index": i, "text": text, "logprobs": None,
                                          "finish_reason": out.finish_reason if out.finished else None}
                if body.logprobs is not None:  # offsets decode the new ids again: only when asked
                    new = [(lp.token_id, lp) for lp in out.new_logprobs]
                    offs = [*offs, *_generated_offsets(srv, [t for t, _ in new], out.new_text, offsets[i],
                                                       skip_special)]
                    entries.extend(new)
                    choice["logprobs"] = _completion_logprobs(srv, entries, offs)
                offsets[i] += len(out.new_text)
                if text or out.finished or entries:
                    yield chunks.text(i, text, choice["finish_reason"]) if choice["logprobs"] is None \
                        else chunks.event(choice)
            usage = srv._sse({"id": rid, "object": "text_completion", "created": created, "model": srv.model_name,
                              "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}) if include_usage else ""
            yield usage + "data: [DONE]\n\n"  # one write for both

        return SseResponse(events())

    collected = await srv._collect(submitted, request, len(jobs))
    if collected is None:
        return Response(status_code=499)  # client went away; nobody reads this
    texts, lps, final = collected
    choices = []
    for i, out in enumerate(final):
        prompt_text = echoed[i // n][0]
        logprobs = None
        if body.logprobs is not None:
            entries, offs = prompt_entries(i, out.prompt_logprobs)
            gen = [(lp.token_id, lp) for lp in lps[i]]
            offs = [*offs, *_generated_offsets(srv, [t for t, _ in gen], texts[i], len(prompt_text), skip_special)]
            logprobs = _completion_logprobs(srv, [*entries, *gen], offs)
        choices.append({"index": i, "text": prompt_text + texts[i], "finish_reason": out.finish_reason,
                        "logprobs": logprobs})
    prompt_tokens = sum(f.num_prompt_tokens for f in final)
    completion_tokens = sum(f.num_output_tokens for f in final)
    return {"id": rid, "object": "text_completion", "created": created, "model": srv.model_name,
            "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}
