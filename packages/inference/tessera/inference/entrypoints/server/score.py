"""POST /score, /v1/score (vLLM's Score API) and /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's
shape, vLLM's Re-rank API) for embedding models, as vLLM serves a bi-encoder: embed both sides,
score each pair by the cosine of the two vectors (sentence-transformers' `similarity`).

It is the embeddings path (embeddings.py: pooling check, input limit, truncation, tokenizing,
engine requests) with a different answer. Each distinct text of a request is embedded once, so
1-to-N embeds the query once. Cross-encoders (a sequence-classification head reading both texts
together) are not served: a model here scores only through its pooled embeddings.
"""

from __future__ import annotations

import uuid

import torch
from fastapi import Request
from fastapi.responses import Response

from tessera.inference.entrypoints.protocol import FieldError, RerankRequest, ScoreRequest
from tessera.inference.entrypoints.server.base import ServerBase
from tessera.inference.entrypoints.server.embeddings import (
    check_count,
    embed_all,
    pooling_spec,
    tokenize_inputs,
    truncation,
)
from tessera.inference.entrypoints.server.errors import ApiError, _now


def _names(field: str, texts: str | list[str]) -> list[tuple[str, str]]:
    """(where, text) of each text of a field: `text_1` for a string, `text_1[3]` in a list."""
    if isinstance(texts, str):
        return [(field, texts)]
    return [(f"{field}[{i}]", t) for i, t in enumerate(texts)]


async def _embed_distinct(srv: ServerBase, named: list[tuple[str, str]], truncate: int | None,
                          request: Request) -> tuple[dict[str, torch.Tensor], int] | None:
    """Unit vector of each distinct text (float64) and the tokens embedded, or None when the client
    went away. A text sent twice is tokenized and embedded once (named by its first place)."""
    spec = pooling_spec(srv)
    keep = truncation(spec, truncate)
    first: dict[str, str] = {}
    for where, text in named:
        first.setdefault(text, where)
    items = [(where, text) for text, where in first.items()]
    ids_list = await srv._off_loop(tokenize_inputs, srv, spec, items, keep, True)
    vectors = await embed_all(srv, ids_list, request)
    if vectors is None:
        return None
    # sentence-transformers' cos_sim: each side normalized (p=2, eps 1e-12), then the dot product.
    unit = torch.nn.functional.normalize(torch.tensor(vectors, dtype=torch.float64), p=2.0, dim=1)
    return dict(zip(first, unit)), sum(len(ids) for ids in ids_list)


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


async def score(srv: ServerBase, body: ScoreRequest, request: Request):
    srv._check_model(body.model)
    srv._check_supported(body)
    pooling_spec(srv)  # a model without pooling: the embeddings' 400, before the texts are looked at
    try:
        pairs = body.pairs()
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    named = _names("text_1", body.text_1) + _names("text_2", body.text_2)
    check_count(srv, len(named), "text_2", what="text_1 and text_2 together")
    embedded = await _embed_distinct(srv, named, body.truncate_prompt_tokens, request)
    if embedded is None:
        return Response(status_code=499)  # client went away; nobody reads this
    unit, tokens = embedded
    data = [{"index": i, "object": "score", "score": float(unit[a] @ unit[b])} for i, (a, b) in enumerate(pairs)]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": _now(), "model": srv.model_name,
            "data": data, "usage": _usage(tokens)}


async def rerank(srv: ServerBase, body: RerankRequest, request: Request):
    srv._check_model(body.model)
    srv._check_supported(body)
    pooling_spec(srv)
    if not body.documents:
        raise ApiError(400, "documents must not be empty", param="documents")
    check_count(srv, 1 + len(body.documents), "documents", what="query and documents together")
    named = [("query", body.query), *_names("documents", body.documents)]
    embedded = await _embed_distinct(srv, named, body.truncate_prompt_tokens, request)
    if embedded is None:
        return Response(status_code=499)
    unit, tokens = embedded
    scores = [float(unit[body.query] @ unit[doc]) for doc in body.documents]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: equal scores keep document order
    if body.top_n:
        order = order[:body.top_n]
    results = []
    for i in order:
        result: dict = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": srv.model_name, "usage": _usage(tokens), "results": results}
