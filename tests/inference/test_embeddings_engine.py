"""Embed requests inside the engine and across its process: prefill-only sequences that share a
step with generation and hold no KV block after it; the same vectors through the engine process;
the pooling files a directory declares, read safely and refused in one line when the server
cannot reproduce them; Matryoshka `dimensions`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from embeddings_helpers import cosines, make_qwen3_dir, pooled_variant, sentences, st_encode
from inference_helpers import make_engine

from tessera.common.errors import ArtifactError
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.worker.loader import load_for_serving

EMBED = SamplingParams(max_tokens=0, embed=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_qwen3_dir(tmp_path_factory.mktemp("qwen3e") / "base")


@pytest.fixture(scope="module")
def embed_dir(qwen3, tmp_path_factory):
    return pooled_variant(qwen3, tmp_path_factory.mktemp("qwen3e-last") / "embed", "lasttoken")


def test_embed_requests_share_a_step_with_generation_and_hold_no_kv_blocks_after_it(embed_dir):
    engine = make_engine(embed_dir, block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    tok = engine.tokenizer
    gen = tok.encode("def f(x):")
    engine.add_request("gen", gen, SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # the generation request is now decoding
    texts = sentences(5)
    for i, text in enumerate(texts):
        engine.add_request(f"e{i}", tok.backend.encode(text).ids, EMBED)  # with the appended <|endoftext|>
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"gen", *(f"e{i}" for i in range(5))}  # one step: a decode and five embeds
    assert all(outs[f"e{i}"].finished and outs[f"e{i}"].embedding is not None for i in range(5))
    assert engine.blocks.num_used == len(engine.blocks.table(engine.requests["gen"]))  # only the decode's
    want = torch.nn.functional.normalize(torch.tensor([outs[f"e{i}"].embedding for i in range(5)]), dim=-1)
    assert min(cosines(want, st_encode(embed_dir, texts))) > 0.99999
    engine.run_to_completion()
    assert engine.blocks.num_used == 0


def test_embeddings_cross_the_engine_process(embed_dir):
    from test_engine_process import ProcessServer

    srv = ProcessServer(embed_dir)
    try:
        assert srv.engine.pooling is not None and srv.engine.pooling.mode == "last"
        texts = sentences(6)
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": texts, "encoding_format": "float"}, timeout=60)
        assert r.status_code == 200, r.text
        assert min(cosines([d["embedding"] for d in r.json()["data"]], st_encode(embed_dir, texts))) > 0.99999
        gen = httpx.post(srv.url + "/v1/completions", json={"prompt": "def", "max_tokens": 3, "ignore_eos": True},
                         timeout=60)
        assert gen.status_code == 200 and gen.json()["usage"]["completion_tokens"] == 3
    finally:
        srv.stop()


def test_matryoshka_dimensions_cut_the_vector_and_keep_its_direction(qwen3, tmp_path):
    from live_server import LiveServer

    directory = pooled_variant(qwen3, tmp_path / "matryoshka", "mean")
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    srv = LiveServer(directory)
    try:
        texts = sentences(3)
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": texts, "dimensions": 16, "encoding_format": "float"},
                       timeout=60)
        assert r.status_code == 200, r.text
        got = [d["embedding"] for d in r.json()["data"]]
        assert all(len(v) == 16 and abs(sum(x * x for x in v) - 1) < 1e-5 for v in got)  # cut, then normalized
        want = st_encode(directory, texts)[:, :16]  # sentence-transformers' truncate_dim: the same direction
        assert min(cosines(got, want)) > 0.99999
        bad = httpx.post(srv.url + "/v1/embeddings", json={"input": "a", "dimensions": 20}, timeout=60)
        assert bad.status_code == 400 and "16, 32, 64" in bad.json()["error"]["message"]
    finally:
        srv.stop()


def _modules(directory, names):
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    (directory / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": paths[n], "type": f"sentence_transformers.models.{n}"}
        for i, n in enumerate(names)]))


def test_pooling_files_the_server_cannot_reproduce_are_refused_in_one_line_naming_the_file(embed_dir, tmp_path):
    cases = []
    dense = pooled_variant(embed_dir, tmp_path / "dense", "lasttoken")
    _modules(dense, ["Transformer", "Pooling", "Dense", "Normalize"])
    cases.append((dense, "modules.json", "Dense"))
    max_pool = pooled_variant(embed_dir, tmp_path / "max", "mean")
    pool_cfg = max_pool / "1_Pooling" / "config.json"
    pool_cfg.write_text(json.dumps({**json.loads(pool_cfg.read_text()), "pooling_mode_max_tokens": True}))
    cases.append((max_pool, "1_Pooling/config.json", "pooling_mode_max_tokens"))
    linked = pooled_variant(embed_dir, tmp_path / "linked", "mean")
    outside = tmp_path / "outside.json"
    outside.write_text(pool_cfg.read_text())
    os.remove(linked / "1_Pooling" / "config.json")
    os.symlink(outside, linked / "1_Pooling" / "config.json")
    cases.append((linked, "1_Pooling/config.json", "leads outside"))
    broken = pooled_variant(embed_dir, tmp_path / "broken", "mean")
    (broken / "sentence_bert_config.json").write_text('{"max_seq_length": -4}')
    cases.append((broken, "sentence_bert_config.json", "max_seq_length"))
    for directory, file, words in cases:
        with pytest.raises(ArtifactError) as exc:
            load_for_serving(directory, torch.device("cpu"), torch.float32)
        msg = str(exc.value)
        assert file in msg and words in msg and "\n" not in msg, msg
    # Through the CLI: exit 2, one line, before the server starts.
    code = "from tessera.inference.entrypoints.serve_cli import entry; entry()"
    r = subprocess.run([sys.executable, "-c", code, "--checkpoint", str(dense), "--port", "1", "--no-engine-process"],
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "modules.json" in lines[0], r.stderr
