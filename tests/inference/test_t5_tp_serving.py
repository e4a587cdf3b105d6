"""Tensor-parallel serving of T5 (`--tensor-parallel 2`, executor.py, encoder_decoder/parallelize.py):
two gloo workers, each running the encoder and the decoder over its shard of the heads, the MLP, the
relative-bias tables and the vocabulary, and caching its heads' self- and cross-attention keys and
values, give over HTTP the greedy tokens of one process and of transformers' `generate` (T5 and
v1.1) with concurrent requests and preemption; SIGTERM leaves no worker behind."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import httpx
import pytest
import torch
from inference_helpers import make_engine, run_all, token_ids, wait_for_health
from ports import SERVE, start_serve
from test_hf_serving import _save
from test_t5_serving import VOCAB, hf_t5, t5_greedy
from test_tensor_parallel_serving import _alive, _descendants

from tessera.common.tokenizer import load_tokenizer
from tessera.inference.core.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# 8 blocks of 8 slots for 10 sequences of 10 to 19 + 1 + 8 slots (3 or 4 blocks each): some are
# preempted and recomputed (their encoder included); a 32-token step budget mixes encoder prefills
# with decodes.
CACHE = {"block_size": 8, "num_kv_blocks": 8, "max_model_len": 40, "max_num_batched_tokens": 32, "max_num_seqs": 12}


@pytest.fixture(scope="module")
def v1_1(tiny_ckpt, tmp_path_factory):
    hf = hf_t5("v1_1")
    return hf, _save(hf, tiny_ckpt, tmp_path_factory.mktemp("t5") / "v1_1")


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (10 + i,), generator=gen).tolist() for i in range(10)]


def _complete_all(url: str, prompts: list[list[int]]) -> list[str]:
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(httpx.post, f"{url}/v1/completions", json={**body, "prompt": p}, timeout=120)
                for p in prompts]
        replies = [f.result() for f in futs]
    for reply in replies:
        assert reply.status_code == 200, reply.text
    return [r.json()["choices"][0]["text"] for r in replies]


def test_tessera_serve_tp2_gives_one_process_and_transformers_greedy_t5_tokens_and_sigterm_leaves_no_orphans(v1_1):
    """`tessera-serve --tensor-parallel 2` on a v1.1 directory, the variant that runs more of the
    plan's splits (gated-GELU gate/up/down, the vocab-parallel shared embedding and its own
    column-parallel head; T5's tied head is the embedding's rows, its ReLU MLP a subset): concurrent
    requests with preemption equal one process and `generate`; SIGTERM stops both
    workers. One server start keeps the test short; T5 itself runs the same runner."""
    hf, export = v1_1
    prompts = _prompts(3)
    expected = t5_greedy(hf, prompts, 8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = run_all(make_engine(export, enable_prefix_caching=False, **CACHE),
                   {str(i): (p, params) for i, p in enumerate(prompts)})
    assert [token_ids(outs[str(i)]) for i in range(len(prompts))] == expected  # one process
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in CACHE.items()]
    proc, url, _ = start_serve(SERVE, "--checkpoint", export, "--quiet", "--tensor-parallel", "2",
                               "--torch-threads", "1", "--no-prefix-caching", "--no-engine-process", *flags)
    try:
        wait_for_health(proc, url, 180)
        texts = _complete_all(url, prompts)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        preempted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                        if "num_preemptions" in line and not line.startswith("#"))
        below = _descendants(proc.pid)
        assert len(below) >= 2  # two workers (and maybe a resource tracker); the engine runs in the server's
        # process (--no-engine-process: one fewer start; test_tensor_parallel_serving covers the engine process)
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
    assert preempted > 0, [line for line in metrics.splitlines() if "preempt" in line]
