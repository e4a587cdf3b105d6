"""Megatron-LM's PUT /api (text_generation_server semantics)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import RequestOutput, RequestRejected
from tessera.inference.entrypoints.protocol import MegatronRequest
from tessera.inference.entrypoints.server.base import ServerBase
from tessera.inference.entrypoints.server.errors import ApiError, _check_text, _validation_message


async def megatron(srv: ServerBase, request: Request):
    """Megatron-LM text_generation_server semantics: the returned text and segments include
    the prompt; logprobs cover every token after the first (prompt and generated)."""
    try:
        data = await request.json()
    except Exception:
        return JSONResponse("request body is not valid JSON", status_code=400)
    if not isinstance(data, dict) or "prompts" not in data:
        return JSONResponse("prompts argument required", status_code=400)
    try:
        body = MegatronRequest.model_validate(data)
    except ValidationError as exc:
        return JSONResponse(_validation_message(exc)[0], status_code=400)
    problem = srv._generation_problem() or _megatron_problem(srv, body)
    if problem:
        return JSONResponse(problem, status_code=400)
    greedy = body.temperature == 0.0 or body.top_k == 1
    stop = ["\n\n"] if body.stop_on_double_eol else ["\n"] if body.stop_on_eol else []
    try:
        encoded = await srv._off_loop(_encode_megatron, srv, body)
    except ApiError as exc:
        return JSONResponse(exc.message, status_code=400)
    jobs = []
    for i, ids in enumerate(encoded):
        try:
            params = SamplingParams(
                max_tokens=body.tokens_to_generate, temperature=0.0 if greedy else body.temperature,
                top_k=0 if greedy else body.top_k, top_p=body.top_p if body.top_p > 0 else 1.0,
                seed=body.random_seed + i if body.random_seed >= 0 else None, stop=stop,
                logprobs=0 if body.logprobs else None, prompt_logprobs=body.logprobs,
            )
        except ValidationError as exc:
            return JSONResponse(_validation_message(exc)[0], status_code=400)
        jobs.append((ids, params))
    try:
        submitted = srv._submit_all("api", jobs)
    except RequestRejected as exc:
        return JSONResponse(str(exc), status_code=400)
    outputs: list[list[RequestOutput]] = [[] for _ in jobs]
    async for i, out in srv._merged(submitted, request):
        outputs[i].append(out)
    if any(not o or not o[-1].finished for o in outputs):
        return Response(status_code=499)
    texts, segments, logprobs = [], [], []
    eos = srv.engine.eos_ids
    for (ids, _), outs in zip(jobs, outputs):
        gen = [t for o in outs for t in o.new_token_ids]
        gen_lps = [lp for o in outs for lp in o.new_logprobs]
        if gen and gen[-1] in eos:  # Megatron leaves the end-of-document token out
            gen, gen_lps = gen[:-1], gen_lps[:-1]
        texts.append(srv.tokenizer.decode(ids) + "".join(o.new_text for o in outs))
        segments.append([srv._token_text(t) for t in ids + gen])
        if body.logprobs:
            prompt_lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), [])
            logprobs.append([lp.logprob for lp in prompt_lps if lp is not None] + [lp.logprob for lp in gen_lps])
    return {"text": texts, "segments": segments, "logprobs": logprobs if body.logprobs else None}

def _encode_megatron(srv: ServerBase, body: MegatronRequest) -> list[list[int]]:
    out = []
    for i, prompt in enumerate(body.prompts):
        srv._check_chars(prompt, f"prompt {i}")
        _check_text(prompt, f"prompt {i}")
        ids = srv._encode(prompt, add_special_tokens=False)
        if body.add_BOS and srv.tokenizer.bos_id is not None:
            ids = [srv.tokenizer.bos_id, *ids]
        if not ids:
            raise ApiError(400, f"prompt {i} is empty")
        if len(ids) > srv.limits.max_prompt_tokens:
            raise ApiError(400, f"prompt {i} has {len(ids)} tokens; the limit is {srv.limits.max_prompt_tokens}")
        out.append(ids)
    return out

def _megatron_problem(srv: ServerBase, body: MegatronRequest) -> str | None:
    if not body.prompts:
        return "prompts is empty"
    if len(body.prompts) > srv.limits.max_prompts:
        return f"Maximum number of prompts is {srv.limits.max_prompts}"
    if body.tokens_to_generate < 0:
        return "tokens_to_generate must be an integer greater than or equal to 0"
    if body.tokens_to_generate > srv.limits.max_tokens:
        return f"tokens_to_generate must be at most {srv.limits.max_tokens}"
    if body.tokens_to_generate == 0 and not body.logprobs:
        return "tokens_to_generate=0 implies logprobs should be True"
    if not 0.0 <= body.temperature <= 100.0:
        return "temperature must be a positive number less than or equal to 100.0"
    if not 0 <= body.top_k <= 1000:
        return "top_k must be an integer between 0 and 1000"
    if not 0.0 <= body.top_p <= 1.0:
        return "top_p must be a number between 0 and 1"
    if body.top_k > 0 and body.top_p > 0.0:
        return "cannot set both top-k and top-p samplings."
    if body.random_seed < -1:
        return "random_seed must be a non-negative integer (or -1 for none)"
    return None
