"""POST /v1/score and /rerank (/v1, /v2) on an embedding model: each score equal to
sentence-transformers' `similarity` (cosine) of its own `encode` on the same directory, the ranking
and top_n cut as it ranks, Cohere's v2 client against /v2/rerank; bad requests refused in one line
each while the server keeps serving.

The model pools by mean with no Normalize module, so its raw vectors are not unit length and a
score that skipped the normalizing (a dot product) would differ. Measured on this model (fp32, CPU):
|score - sentence-transformers| at most 1.6e-7; the tolerance is 1e-5 (float32
sentence-transformers against our float64 dot of float32 vectors)."""

from __future__ import annotations

import httpx
import pytest
from embeddings_helpers import make_bert_dir, make_qwen3_dir, pooled_variant, sentences
from inference_helpers import assert_alive_and_drained
from live_server import LiveServer

from tessera.inference.entrypoints.server import ServerLimits

LIMITS = ServerLimits(max_prompt_tokens=200, max_tokens=100, max_prompts=4, max_body_bytes=200_000,
                      max_embedding_inputs=16)
TOL = 1e-5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = make_qwen3_dir(tmp_path_factory.mktemp("qwen3") / "base", seed=1)
    directory = pooled_variant(base, tmp_path_factory.mktemp("mean") / "qwen3-mean", "mean", normalize=False)
    srv = LiveServer(directory, limits=LIMITS)
    yield srv, directory
    srv.stop()


@pytest.fixture(scope="module")
def st_model(served):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(served[1]), device="cpu")


def _st_scores(model, a: list[str], b: list[str], pairwise: bool) -> list[float]:
    ea, eb = model.encode(a, convert_to_tensor=True), model.encode(b, convert_to_tensor=True)
    if pairwise:
        return model.similarity_pairwise(ea, eb).tolist()
    return model.similarity(ea, eb).flatten().tolist()


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and max(abs(g - w) for g, w in zip(got, want)) < TOL, (got, want)


def _tokens(http, texts) -> int:
    return sum(len(http.post("/tokenize", json={"prompt": t}).json()["tokens"]) for t in set(texts))


def test_score_one_to_one_one_to_n_and_n_to_n_equal_sentence_transformers_cosine(served, st_model):
    srv, _ = served
    texts = sentences(9)
    query, docs = texts[0], texts[1:6]
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        one = http.post("/v1/score", json={"model": "tiny", "text_1": query, "text_2": docs[0]}).json()
        assert one["object"] == "list" and one["model"] == "tiny" and one["id"].startswith("score-")
        assert [d["object"] for d in one["data"]] == ["score"] and isinstance(one["created"], int)
        _close([d["score"] for d in one["data"]], _st_scores(st_model, [query], [docs[0]], pairwise=False))
        # 1-to-N: the query embedded once; the bare /score path answers the same.
        many = http.post("/score", json={"text_1": [query], "text_2": docs}).json()
        assert [d["index"] for d in many["data"]] == list(range(5))
        _close([d["score"] for d in many["data"]], _st_scores(st_model, [query], docs, pairwise=False))
        assert many["usage"]["prompt_tokens"] == many["usage"]["total_tokens"] == _tokens(http, [query, *docs])
        # N-to-N pairwise, with a text repeated on both sides (embedded once: usage counts it once).
        left, right = [texts[6], texts[7], texts[8], texts[6]], [texts[7], texts[6], texts[6], texts[8]]
        pairs = http.post("/v1/score", json={"text_1": left, "text_2": right}).json()
        _close([d["score"] for d in pairs["data"]], _st_scores(st_model, left, right, pairwise=True))
        assert pairs["usage"]["prompt_tokens"] == _tokens(http, texts[6:9])
        assert_alive_and_drained(http, srv.async_engine, srv.engine)


def test_rerank_orders_cuts_and_echoes_as_sentence_transformers_ranks(served, st_model):
    srv, _ = served
    texts = sentences(12)
    query, docs = texts[0], texts[1:12]
    want = _st_scores(st_model, [query], docs, pairwise=False)
    ranked = sorted(range(len(docs)), key=lambda i: -want[i])
    assert min(abs(want[a] - want[b]) for a, b in zip(ranked, ranked[1:])) > 10 * TOL  # an order to check
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            got = http.post(path, json={"model": "tiny", "query": query, "documents": docs}).json()
            assert [r["index"] for r in got["results"]] == ranked and got["model"] == "tiny"
            _close([r["relevance_score"] for r in got["results"]], [want[i] for i in ranked])
            assert [r["document"]["text"] for r in got["results"]] == [docs[i] for i in ranked]
            assert got["usage"]["total_tokens"] == _tokens(http, [query, *docs])
        # top_n cuts the best n; 0 means all; {"text": ...} documents as vLLM takes them; no echo when asked.
        top = http.post("/v1/rerank", json={"query": query, "documents": [{"text": d} for d in docs], "top_n": 3,
                                            "return_documents": False}).json()
        assert [r["index"] for r in top["results"]] == ranked[:3] and all("document" not in r for r in top["results"])
        every = http.post("/v1/rerank", json={"query": query, "documents": docs, "top_n": 0}).json()
        assert [r["index"] for r in every["results"]] == ranked
        assert_alive_and_drained(http, srv.async_engine, srv.engine)


def test_cohere_v2_client_reranks_against_v2_rerank(served, st_model):
    import cohere

    srv, _ = served
    texts = sentences(7)
    query, docs = texts[0], texts[1:7]
    want = _st_scores(st_model, [query], docs, pairwise=False)
    ranked = sorted(range(len(docs)), key=lambda i: -want[i])
    client = cohere.ClientV2(base_url=srv.url, api_key="x", timeout=120)
    got = client.rerank(model="tiny", query=query, documents=docs, top_n=4)
    assert [r.index for r in got.results] == ranked[:4]
    _close([r.relevance_score for r in got.results], [want[i] for i in ranked[:4]])
    with pytest.raises(cohere.BadRequestError) as exc:  # a Cohere field this server does not honour
        client.rerank(model="tiny", query=query, documents=docs, max_tokens_per_doc=16)
    assert exc.value.body["error"]["param"] == "max_tokens_per_doc"


def _refused(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, (path, body, r.text)
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"] and err["type"] == "invalid_request_error", err
    return err["message"]


def test_bad_score_and_rerank_requests_get_one_line_400s_and_the_server_keeps_serving(served):
    srv, _ = served
    long_text = " ".join(sentences(40))
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        assert "empty" in _refused(http, "/v1/score", {"text_1": [], "text_2": "a"}, "text_1")
        assert "empty" in _refused(http, "/v1/score", {"text_1": "a", "text_2": []}, "text_2")
        assert "equal length" in _refused(http, "/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]},
                                          "text_2")
        assert "equal length" in _refused(http, "/score", {"text_1": ["a", "b"], "text_2": "a"}, "text_2")
        assert "at most 16" in _refused(http, "/v1/score", {"text_1": "q", "text_2": ["d"] * 16}, "text_2")
        assert "at most 16" in _refused(http, "/v1/rerank", {"query": "q", "documents": ["d"] * 16}, "documents")
        msg = _refused(http, "/v1/score", {"text_1": "q", "text_2": ["short", long_text]}, "text_2")
        assert "text_2[1]" in msg and "truncate_prompt_tokens" in msg
        assert "documents[2]" in _refused(http, "/v1/rerank", {"query": "q", "documents": ["a", "b", long_text]},
                                          "documents")
        for path, body, param in (
                ("/v1/score", {"text_1": "a", "text_2": "b", "use_activation": True}, "use_activation"),
                ("/v1/score", {"text_1": "a", "text_2": "b", "data_1": ["x"]}, "data_1"),
                ("/v1/score", {"text_1": [1, 2], "text_2": "b"}, "text_1"),
                ("/v1/score", {"text_2": "b"}, "text_1"),
                ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 500}, "truncate_prompt_tokens"),
                ("/v2/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": 8}, "max_tokens_per_doc"),
                ("/v2/rerank", {"query": "a", "documents": ["b"], "priority": 1}, "priority"),
                ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
                ("/v1/rerank", {"query": "a", "documents": [{"text": "b", "multi_modal": []}]}, "documents"),
                ("/v1/rerank", {"query": "a", "documents": "b"}, "documents"),
                ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
                ("/v1/rerank", {"query": ["a"], "documents": ["b"]}, "query")):
            _refused(http, path, body, param)
        # Off values of vLLM's and Cohere's fields are accepted; truncation as on /v1/embeddings.
        ok = http.post("/v2/rerank", json={"query": "a", "documents": [long_text], "priority": 0,
                                           "truncate_prompt_tokens": -1})
        assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == _tokens(http, ["a"]) + 128, ok.text
        r = http.post("/v1/score", json={"text_1": "a", "text_2": "b", "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert_alive_and_drained(http, srv.async_engine, srv.engine)


def test_score_and_rerank_on_a_model_without_pooling_are_refused_in_one_line_and_need_the_api_key(tiny_ckpt):
    srv = LiveServer(tiny_ckpt, api_key="k")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            for path in ("/score", "/rerank", "/v2/rerank"):
                assert http.post(path, json={"text_1": "a", "text_2": "b"}).status_code == 401
            http.headers["Authorization"] = "Bearer k"
            assert "declares no pooling" in _refused(http, "/v1/score", {"text_1": "a", "text_2": "b"}, "model")
            assert "declares no pooling" in _refused(http, "/v2/rerank", {"query": "a", "documents": ["b"]}, "model")
            assert_alive_and_drained(http, srv.async_engine, srv.engine)
    finally:
        srv.stop()



def test_an_encoder_scores_and_reranks_as_sentence_transformers_and_names_them_when_refusing_completions(tmp_path):
    from sentence_transformers import SentenceTransformer

    directory = pooled_variant(make_bert_dir(tmp_path / "bert"), tmp_path / "bert-cls", "cls")
    model = SentenceTransformer(str(directory), device="cpu")
    texts = sentences(6)
    srv = LiveServer(directory, limits=LIMITS)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            got = http.post("/v1/score", json={"text_1": texts[0], "text_2": texts[1:]}).json()
            _close([d["score"] for d in got["data"]], _st_scores(model, texts[:1], texts[1:], pairwise=False))
            ranked = http.post("/rerank", json={"query": texts[0], "documents": texts[1:], "top_n": 2}).json()
            want = _st_scores(model, texts[:1], texts[1:], pairwise=False)
            assert [r["index"] for r in ranked["results"]] == sorted(range(5), key=lambda i: -want[i])[:2]
            msg = _refused(http, "/v1/completions", {"prompt": "a"}, "model")
            assert "/v1/score" in msg and "/v1/rerank" in msg
    finally:
        srv.stop()
