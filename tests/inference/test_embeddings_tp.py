"""POST /v1/embeddings on a causal-LM embedding model (Qwen3-Embedding-shaped: last-token pooling)
served with --tensor-parallel 2: the workers pool the final-normed hidden states of the embed
requests' rows and send back one row each; the vectors equal sentence-transformers' `encode`, and
chat beside them is unchanged."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from embeddings_helpers import cosines, make_qwen3_dir, pooled_variant, sentences, st_encode
from inference_helpers import assert_alive_and_drained
from live_server import LiveServer

from tessera.inference.entrypoints.server import ServerLimits

LIMITS = ServerLimits(max_prompt_tokens=200, max_tokens=100, max_prompts=4, max_body_bytes=200_000,
                      max_embedding_inputs=64)
CHAT = [{"role": "user", "content": "def f(x): return x"}]


def test_tp2_last_token_embeddings_equal_sentence_transformers_single_list_and_concurrent_beside_unchanged_chat(
        tmp_path):
    from openai import OpenAI

    directory = pooled_variant(make_qwen3_dir(tmp_path / "base"), tmp_path / "qwen3-embed", "lasttoken")
    texts = sentences(16)
    want = st_encode(directory, texts)
    srv = LiveServer(directory, limits=LIMITS, tensor_parallel=2)
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)

        def embed(batch):
            got = client.embeddings.create(model="tiny", input=batch)
            return [d.embedding for d in got.data]

        def chat():
            return client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                                  temperature=0).choices[0].message.content

        assert cosines(embed(texts[0]), want[:1])[0] > 0.99999
        assert min(cosines(embed(texts), want)) > 0.99999
        alone = chat()
        # Embed requests and a chat share steps: the mixed batch pools the one and samples the other.
        with ThreadPoolExecutor(6) as pool:
            chats = [pool.submit(chat), pool.submit(chat)]
            got = [v for vs in pool.map(embed, [texts[4 * i:4 * i + 4] for i in range(4)]) for v in vs]
            assert [c.result() for c in chats] == [alone, alone]
        assert min(cosines(got, want)) > 0.99999
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            assert_alive_and_drained(http, srv.async_engine, srv.engine)
    finally:
        srv.stop()
        srv.engine.close()  # the workers
