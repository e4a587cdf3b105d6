"""Tensor-parallel serving of T5 (`--tensor-parallel 2`, executor.py, encoder_decoder/parallelize.py):
two gloo workers, each running the encoder and the decoder over its shard of the heads, the MLP, the
relative-bias tables and the vocabulary, and caching its heads' self- and cross-attention keys and
values, give over HTTP the greedy tokens of one process and of transformers' `generate` (T5 and
v1.1) with concurrent requests and preemption; SIGTERM leaves no worker behind."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from inference_helpers import make_engine, run_all, token_ids, wait_for_health
from live_server import LiveServer
from test_t5_serving import VOCAB, exports, t5_greedy  # noqa: F401 - `exports` is the module's fixture
from test_tensor_parallel_serving import _alive, _descendants

from tessera.common.tokenizer import load_tokenizer
from tessera.inference.core.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# 12 blocks of 8 slots for 12 sequences of up to 13 + 1 + 8 slots: some are preempted and recomputed
# (their encoder included); a 32-token step budget mixes encoder prefills with decodes.
CACHE = {"block_size": 8, "num_kv_blocks": 12, "max_model_len": 48, "max_num_batched_tokens": 32, "max_num_seqs": 12}


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (4 + i,), generator=gen).tolist() for i in range(12)]


def _complete_all(url: str, prompts: list[list[int]]) -> list[str]:
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(httpx.post, f"{url}/v1/completions", json={**body, "prompt": p}, timeout=120)
                for p in prompts]
        replies = [f.result() for f in futs]
    for reply in replies:
        assert reply.status_code == 200, reply.text
    return [r.json()["choices"][0]["text"] for r in replies]


def test_tp2_t5_greedy_completions_over_http_equal_one_process_and_transformers_under_preemption(exports):
    """The tied, d_model**-0.5-scaled head of T5: each rank's logits are its vocabulary slice."""
    hf, export = exports("t5")
    prompts = _prompts(2)
    expected = t5_greedy(hf, prompts, 8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    one = make_engine(export, enable_prefix_caching=False, **CACHE)
    outs = run_all(one, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert [token_ids(outs[str(i)]) for i in range(len(prompts))] == expected  # one process
    tokenizer = load_tokenizer(export)
    s = LiveServer(export, tensor_parallel=2, enable_prefix_caching=False, **CACHE)
    try:
        texts = _complete_all(s.url, prompts)
        assert s.engine.scheduler.num_preemptions > 0
        assert s.wait_idle()  # every block came back
    finally:
        s.stop()
        s.engine.close()
    assert texts == [tokenizer.decode(w) for w in expected]


def test_tessera_serve_tp2_serves_t5_v1_1_like_transformers_and_sigterm_leaves_no_orphan_workers(exports):
    """`tessera-serve --tensor-parallel 2` on a v1.1 directory (gated-GELU MLP split, its own head
    column-parallel): concurrent requests with preemption equal `generate`; SIGTERM stops the
    engine process and both workers."""
    hf, export = exports("v1_1")
    prompts = _prompts(3)
    expected = t5_greedy(hf, prompts, 8)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in CACHE.items()]
    proc = subprocess.Popen([sys.executable, "-c", "from tessera.inference.entrypoints.serve_cli import entry; entry()",
                             "--checkpoint", str(export), "--port", str(port), "--quiet", "--tensor-parallel", "2",
                             "--torch-threads", "1", "--no-prefix-caching", *flags],
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, 180)
        texts = _complete_all(url, prompts)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        preempted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                        if "num_preemptions" in line and not line.startswith("#"))
        below = _descendants(proc.pid)
        assert len(below) >= 3  # the engine process and two workers (and maybe a resource tracker)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.time() + 30
        while any(_alive(p) for p in below) and time.time() < deadline:
            time.sleep(0.2)
        assert not [p for p in below if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tokenizer = load_tokenizer(export)
    assert texts == [tokenizer.decode(w) for w in expected]
    assert preempted > 0
