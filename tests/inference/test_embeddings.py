"""POST /v1/embeddings end to end: the official openai client against a real server, each vector
equal to sentence-transformers' `encode` on the same directory (cosine > 0.99999, fp32), for the
pooling each sentence-transformers directory declares; bad requests refused in one line each."""

from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from embeddings_helpers import cosines, make_qwen3_dir, pooled_variant, sentences, st_encode
from inference_helpers import assert_alive_and_drained
from live_server import LiveServer

from tessera.inference.entrypoints.server import ServerLimits

LIMITS = ServerLimits(max_prompt_tokens=200, max_tokens=100, max_prompts=4, max_body_bytes=200_000,
                      max_embedding_inputs=64)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_qwen3_dir(tmp_path_factory.mktemp("qwen3") / "base")


@pytest.fixture(scope="module")
def last_server(qwen3, tmp_path_factory):
    directory = pooled_variant(qwen3, tmp_path_factory.mktemp("last") / "qwen3-embed", "lasttoken")
    srv = LiveServer(directory, limits=LIMITS)
    yield srv, directory
    srv.stop()


def _client(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def _check_equal(client, directory, texts):
    got = client.embeddings.create(model="tiny", input=texts if len(texts) > 1 else texts[0])
    assert [d.index for d in got.data] == list(range(len(texts)))
    want = st_encode(directory, texts)
    cos = cosines([d.embedding for d in got.data], want)
    assert min(cos) > 0.99999, cos
    return got


@pytest.mark.parametrize("mode", ["cls", "mean"])
def test_cls_and_mean_pooled_embeddings_equal_sentence_transformers(qwen3, tmp_path, mode):
    directory = pooled_variant(qwen3, tmp_path / f"qwen3-{mode}", mode)
    srv = LiveServer(directory, limits=LIMITS)
    try:
        client = _client(srv)
        _check_equal(client, directory, sentences(1))
        _check_equal(client, directory, sentences(64))
        assert srv.wait_idle() and srv.engine.blocks.num_used == 0
    finally:
        srv.stop()


def test_last_token_embeddings_equal_sentence_transformers_single_and_64_inputs_float_and_base64(last_server):
    srv, directory = last_server
    client = _client(srv)
    one = _check_equal(client, directory, sentences(1))
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0 and one.model == "tiny"
    texts = sentences(64)
    _check_equal(client, directory, texts)
    # encoding_format float and base64 (little-endian float32, as the client decodes it) agree.
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        floats = http.post("/v1/embeddings", json={"input": texts[:3], "encoding_format": "float"}).json()
        b64 = http.post("/v1/embeddings", json={"input": texts[:3], "encoding_format": "base64"}).json()
        ids = http.post("/tokenize", json={"prompt": texts[0]}).json()["tokens"]
        by_ids = http.post("/v1/embeddings", json={"input": ids}).json()
        by_id_lists = http.post("/v1/embeddings", json={"input": [ids, ids[:3]]}).json()
    for f, b in zip(floats["data"], b64["data"]):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"]
    assert by_ids["data"][0]["embedding"] == floats["data"][0]["embedding"]
    assert by_id_lists["usage"]["prompt_tokens"] == len(ids) + 3 == by_ids["usage"]["prompt_tokens"] + 3
    assert srv.wait_idle()


def test_sixteen_concurrent_embedding_requests_beside_generation_equal_sentence_transformers(last_server):
    srv, directory = last_server
    client = _client(srv)
    texts = sentences(48)
    want = st_encode(directory, texts)

    def one(i):
        return client.embeddings.create(model="tiny", input=texts[3 * i:3 * i + 3])

    def generate():
        return client.completions.create(model="tiny", prompt="def f(x):", max_tokens=24, temperature=0)

    with ThreadPoolExecutor(18) as pool:
        gens = [pool.submit(generate) for _ in range(2)]
        results = list(pool.map(one, range(16)))
        assert all(len(g.result().choices[0].text) >= 0 and g.result().usage.completion_tokens > 0 for g in gens)
    got = [d.embedding for r in results for d in r.data]
    assert min(cosines(got, want)) > 0.99999
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        assert_alive_and_drained(http, srv.async_engine, srv.engine)


def _refused(http, body, param):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"] and err["type"] == "invalid_request_error", err
    return err["message"]


def test_bad_embedding_requests_get_one_line_400s_and_leave_the_engine_unharmed(last_server):
    srv, directory = last_server
    long_text = " ".join(sentences(40))
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        assert "at most 64" in _refused(http, {"input": ["a"] * 65}, "input")
        msg = _refused(http, {"input": ["short", long_text]}, "input")
        assert "input[1]" in msg and "128" in msg and "truncate_prompt_tokens" in msg
        assert "input[0]" in _refused(http, {"input": [list(range(129)), [1]]}, "input")
        assert "Matryoshka" in _refused(http, {"input": "a", "dimensions": 8}, "dimensions")
        assert "truncate_prompt_tokens" in _refused(http, {"input": "a", "truncate_prompt_tokens": 500},
                                                    "truncate_prompt_tokens")
        assert "empty" in _refused(http, {"input": []}, "input")
        assert "empty" in _refused(http, {"input": [[]]}, "input")
        for body, param in (({"input": 5}, "input"), ({"input": [True]}, "input"), ({"input": [[1, "a"]]}, "input"),
                            ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
                            ({"input": "a", "dimensions": "8"}, "dimensions"), ({}, "input"),
                            ({"input": [10**9]}, "input")):
            _refused(http, body, param)
        r = http.post("/v1/embeddings", json={"input": "a", "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        # Truncation only when asked: the first 128 tokens, as sentence-transformers cuts at max_seq_length.
        cut = http.post("/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": -1,
                                                "encoding_format": "float"})
        assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 128
        assert cosines([cut.json()["data"][0]["embedding"]], st_encode(directory, [long_text]))[0] > 0.99999
        assert_alive_and_drained(http, srv.async_engine, srv.engine)


def test_embeddings_on_a_generative_model_without_pooling_are_refused_in_one_line(tiny_ckpt):
    srv = LiveServer(tiny_ckpt)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            msg = _refused(http, {"input": "hello"}, "model")
            assert "declares no pooling" in msg
            assert_alive_and_drained(http, srv.async_engine, srv.engine)
    finally:
        srv.stop()
