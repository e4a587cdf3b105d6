"""tessera-serve on an encoder (a random tiny BERT saved by transformers, with sentence-transformers
files): /v1/embeddings equal to sentence-transformers' encode for CLS and mean pooling, single, 64
inputs and 16 concurrent requests; no KV cache; completions, chat and PUT /api refused in one line;
bad inputs refused with the engine unharmed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from embeddings_helpers import cosines, make_bert_dir, pooled_variant, sentences, st_encode
from live_server import LiveServer

from tessera.inference.entrypoints.server import ServerLimits

LIMITS = ServerLimits(max_prompt_tokens=200, max_tokens=100, max_prompts=4, max_body_bytes=200_000,
                      max_embedding_inputs=64)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_bert_dir(tmp_path_factory.mktemp("bert") / "base")


@pytest.fixture(scope="module")
def mean_server(bert, tmp_path_factory):
    directory = pooled_variant(bert, tmp_path_factory.mktemp("bert-mean") / "bert-mean", "mean")
    srv = LiveServer(directory, limits=LIMITS)
    yield srv, directory
    srv.stop()


def _embed(srv, texts):
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    return [d.embedding for d in client.embeddings.create(model="tiny", input=texts).data]


def _assert_embeds_and_drained(http, srv) -> None:
    """The encoder's version of assert_alive_and_drained: healthy, answers an embedding, nothing left."""
    assert srv.async_engine.healthy and http.get("/health").status_code == 200
    ok = http.post("/v1/embeddings", json={"input": "still here"})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 0
    deadline = time.monotonic() + 30
    while (srv.async_engine.num_active() or srv.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.async_engine.num_active() == 0 and not srv.engine.has_unfinished()


def test_cls_pooled_bert_embeddings_equal_sentence_transformers_single_and_64_inputs(bert, tmp_path):
    directory = pooled_variant(bert, tmp_path / "bert-cls", "cls")
    srv = LiveServer(directory, limits=LIMITS)
    try:
        for texts in (sentences(1), sentences(64)):
            assert min(cosines(_embed(srv, texts), st_encode(directory, texts))) > 0.99999
    finally:
        srv.stop()


def test_mean_pooled_bert_embeddings_equal_sentence_transformers_single_64_inputs_and_16_concurrent(mean_server):
    srv, directory = mean_server
    texts = sentences(64)
    want = st_encode(directory, texts)
    assert cosines(_embed(srv, texts[:1]), want[:1])[0] > 0.99999
    assert min(cosines(_embed(srv, texts), want)) > 0.99999
    with ThreadPoolExecutor(16) as pool:
        got = [v for vs in pool.map(lambda i: _embed(srv, texts[4 * i:4 * i + 4]), range(16)) for v in vs]
    assert min(cosines(got, want)) > 0.99999


def test_an_encoder_has_no_kv_cache_and_refuses_completions_chat_and_megatron_api_in_one_line(mean_server):
    srv, _ = mean_server
    assert srv.engine.blocks.num_blocks == 0 and srv.engine.runner.kv.numel() == 0
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = http.post(path, json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and "encoder" in err["message"] and "\n" not in err["message"], r.text
        r = http.put("/api", json={"prompts": ["hello"], "tokens_to_generate": 4})
        assert r.status_code == 400 and "encoder" in r.json()
        _assert_embeds_and_drained(http, srv)


def test_bad_inputs_to_an_encoder_get_one_line_400s_and_leave_it_serving(mean_server):
    srv, directory = mean_server
    long_text = " ".join(sentences(60))
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for body, words in (({"input": ["a"] * 65}, "at most 64"), ({"input": ["a", long_text]}, "input[1]"),
                            ({"input": "a", "dimensions": 8}, "Matryoshka"), ({"input": [[1, 2], [True]]}, "token ids"),
                            ({"input": [[]]}, "empty")):
            r = http.post("/v1/embeddings", json=body)
            msg = r.json()["error"]["message"]
            assert r.status_code == 400 and words in msg and "\n" not in msg, (body, r.text)
        cut = http.post("/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": -1,
                                                "encoding_format": "float"}).json()
        assert cut["usage"]["prompt_tokens"] == 128  # sentence_bert_config.json's max_seq_length
        assert cosines([cut["data"][0]["embedding"]], st_encode(directory, [long_text]))[0] > 0.99999
        _assert_embeds_and_drained(http, srv)


def test_bert_embeddings_under_tensor_parallel_2_equal_one_process_and_sentence_transformers(mean_server):
    _, directory = mean_server
    texts = sentences(24)
    srv = LiveServer(directory, limits=LIMITS, tensor_parallel=2)
    try:
        assert min(cosines(_embed(srv, texts), _embed(mean_server[0], texts))) > 0.99999
        assert min(cosines(_embed(srv, texts), st_encode(directory, texts))) > 0.99999
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            _assert_embeds_and_drained(http, srv)
    finally:
        srv.stop()


def test_a_tensor_parallel_size_that_does_not_divide_the_encoders_heads_is_refused_in_one_line_before_loading(bert):
    import torch

    from tessera.common.errors import UserError
    from tessera.inference.worker.loader import load_for_serving

    with pytest.raises(UserError) as exc:
        load_for_serving(bert, torch.device("cpu"), torch.float32, tensor_parallel=3)
    assert "--tensor-parallel 3" in str(exc.value) and "attention heads" in str(exc.value), exc.value
    assert "\n" not in str(exc.value)


def test_an_hf_bert_whose_vocabulary_tensor_parallel_does_not_divide_is_padded_and_embeds_as_one_process(bert, tmp_path):
    import json
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    odd = tmp_path / "odd"
    shutil.copytree(bert, odd)
    cfg = json.loads((odd / "config.json").read_text())
    torch.manual_seed(3)
    BertModel(BertConfig(**{**cfg, "vocab_size": cfg["vocab_size"] + 1})).eval().save_pretrained(odd)
    directory = pooled_variant(odd, tmp_path / "odd-mean", "mean")
    texts = sentences(8)
    srv = LiveServer(directory, limits=LIMITS, tensor_parallel=2)
    try:
        assert min(cosines(_embed(srv, texts), st_encode(directory, texts))) > 0.99999
    finally:
        srv.stop()
