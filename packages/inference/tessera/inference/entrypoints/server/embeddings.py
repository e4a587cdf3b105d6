"""POST /v1/embeddings (OpenAI's shape, vLLM's pooling behaviour).

Each input becomes one embed request of the engine (prefill only, scheduled whole, pooled: see
worker/pooling/runner.py), so many inputs and many requests share steps, beside generation on a causal
LM. The engine returns the raw pooled vector; here it is cut to `dimensions` (Matryoshka models)
and then normalized when the model's modules end in Normalize (vLLM's order), and sent as floats
or as base64 of little-endian float32 (what OpenAI's client decodes).
"""

from __future__ import annotations

import base64
import struct
import uuid

import torch
from fastapi import Request
from fastapi.responses import Response

from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.entrypoints.protocol import EmbeddingRequest
from tessera.inference.entrypoints.server.base import ServerBase
from tessera.inference.entrypoints.server.errors import ApiError, _check_text
from tessera.inference.worker.pooling.spec import PoolingSpec

EMBED = SamplingParams(max_tokens=0, embed=True)


def _check_dimensions(srv: ServerBase, spec: PoolingSpec, dims: int | None) -> None:
    if dims is None:
        return
    if not spec.matryoshka:
        raise ApiError(400, f"dimensions: model {srv.model_name!r} is not a Matryoshka model (its config.json "
                       "declares neither is_matryoshka nor matryoshka_dimensions); leave dimensions out",
                       param="dimensions")
    allowed = spec.matryoshka if isinstance(spec.matryoshka, tuple) else None
    if not 1 <= dims <= spec.dim or (allowed is not None and dims not in allowed):
        which = ", ".join(map(str, allowed)) if allowed else f"1 to {spec.dim}"
        raise ApiError(400, f"dimensions {dims}: model {srv.model_name!r} gives embeddings of {which} dimensions",
                       param="dimensions")


def truncation(spec: PoolingSpec, asked: int | None) -> int | None:
    """The token count to keep of each input (truncate_prompt_tokens), or None: a longer input is a 400."""
    if asked is None:
        return None
    limit = spec.max_input_tokens
    if asked == 0 or asked > limit:
        raise ApiError(400, f"truncate_prompt_tokens {asked}: must be -1 (the limit) or 1 to {limit}, the longest "
                       "input this server embeds", param="truncate_prompt_tokens")
    return limit if asked == -1 else asked


def pooling_spec(srv: ServerBase) -> PoolingSpec:
    """The model's pooling; a model that declares none serves no embeddings (nor scores built on them)."""
    spec = srv.engine.pooling
    if spec is None:
        raise ApiError(400, f"model {srv.model_name!r} declares no pooling (no sentence-transformers modules.json "
                       "with a Pooling module), so it serves no embeddings", param="model",
                       code="embeddings_unsupported")
    return spec


def check_count(srv: ServerBase, n: int, param: str, what: str | None = None) -> None:
    """Every text of a request is one engine request: at most --max-embedding-inputs of them."""
    if n > srv.limits.max_embedding_inputs:
        raise ApiError(400, f"{what or param} has {n} items; this server embeds at most "
                       f"{srv.limits.max_embedding_inputs} per request", param=param, code="too_many_inputs")


def tokenize_inputs(srv: ServerBase, spec: PoolingSpec, items: list[tuple[str, str | list[int]]], keep: int | None,
                    add_special_tokens: bool) -> list[list[int]]:
    """Token ids of every (where, text or ids) item, checked; on a tokenizer thread. `where` names the
    item in errors (`input[3]`); its name before any `[` is the error's param."""
    limit = spec.max_input_tokens
    backend = srv.tokenizer.backend
    out = []
    for where, x in items:
        param = where.split("[")[0]
        if isinstance(x, str):
            _check_text(x, where)
            text = x.lower() if spec.do_lower_case else x  # as sentence-transformers' Transformer module
            if keep is not None:  # cut the text's tokens, keeping the special ones (as HF tokenizers truncate)
                enc = backend.encode_batch([text], add_special_tokens=False)[0]
                specials = backend.num_special_tokens_to_add(False) if add_special_tokens else 0
                enc.truncate(max(keep - specials, 0))
                ids = backend.post_process(enc, None, add_special_tokens).ids[:keep]
            else:
                try:
                    ids = srv._encode(text, add_special_tokens)
                except ApiError as exc:
                    if exc.code != "prompt_too_long":
                        raise
                    raise ApiError(400, f"{where} is longer than the {limit} tokens this model embeds; shorten it or "
                                   "set truncate_prompt_tokens", param=param, code="input_too_long") from None
        else:
            ids = list(x)[:keep] if keep is not None else list(x)
        if not ids:
            raise ApiError(400, f"{where} is empty; send at least one token", param=param)
        if min(ids) < 0 or max(ids) >= srv.engine.vocab_size:
            raise ApiError(400, f"{where}: token ids must be in [0, {srv.engine.vocab_size})", param=param)
        if len(ids) > limit:
            raise ApiError(400, f"{where} has {len(ids)} tokens, more than the {limit} this model embeds; shorten it "
                           "or set truncate_prompt_tokens", param=param, code="input_too_long")
        out.append(ids)
    return out


async def embed_all(srv: ServerBase, ids_list: list[list[int]], request: Request) -> list[list[float]] | None:
    """The raw pooled vector of each token-id list (one engine request each, all sharing steps), or
    None when the client went away first."""
    submitted = srv._submit_all("embd", [(ids, EMBED) for ids in ids_list])
    collected = await srv._collect(submitted, request, len(ids_list))
    if collected is None:
        return None
    vectors = []
    for out in collected[2]:
        if out.embedding is None:
            raise ApiError(500, "the engine returned no embedding", type_="server_error")
        vectors.append(out.embedding)
    return vectors


def _encode_vector(values: list[float], dims: int | None, normalize: bool, fmt: str) -> list[float] | str:
    vec = torch.tensor(values, dtype=torch.float32)
    if dims is not None:
        vec = vec[:dims]
    if normalize:  # sentence-transformers' Normalize: F.normalize(p=2), eps 1e-12
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
    floats = vec.tolist()
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(floats)}f", *floats)).decode("ascii")
    return floats


async def embeddings(srv: ServerBase, body: EmbeddingRequest, request: Request):
    srv._check_model(body.model)
    srv._check_supported(body)
    spec = pooling_spec(srv)
    inputs = body.inputs()
    if not inputs:
        raise ApiError(400, "input must not be empty", param="input")
    check_count(srv, len(inputs), "input")
    _check_dimensions(srv, spec, body.dimensions)
    keep = truncation(spec, body.truncate_prompt_tokens)
    single = isinstance(body.input, str) or (bool(body.input) and isinstance(body.input[0], int))
    items = [("input" if single else f"input[{i}]", x) for i, x in enumerate(inputs)]
    ids_list = await srv._off_loop(tokenize_inputs, srv, spec, items, keep, body.add_special_tokens)
    vectors = await embed_all(srv, ids_list, request)
    if vectors is None:
        return Response(status_code=499)  # client went away; nobody reads this
    data = [{"object": "embedding", "index": i,
             "embedding": _encode_vector(v, body.dimensions, spec.normalize, body.encoding_format)}
            for i, v in enumerate(vectors)]
    tokens = sum(len(ids) for ids in ids_list)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "data": data, "model": srv.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
