"""Greedy output of the engine equals transformers' greedy generate, token for token, for single
requests and for concurrent mixed batches that exercise chunked prefill, prefix-cache hits and
recompute preemption; the pool is empty again afterwards."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import hf_greedy, hf_llama_from, make_engine, run_all, token_ids

from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint
from tessera.inference.core.sampling_params import SamplingParams

NEW = 16


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    ckpt = resolve_checkpoint(tiny_ckpt)
    from tessera.common.checkpoint import read_sidecar

    return hf_llama_from(read_sidecar(ckpt).model, load_model_tensors(ckpt))


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 512, (33,), generator=g).tolist()
    out = {f"r{i}": torch.randint(3, 512, (n,), generator=g).tolist() for i, n in enumerate((1, 5, 17, 40, 29))}
    # Same 33-token prefix, different tails: full blocks of the prefix are shared.
    out["s0"] = shared + [7, 8, 9]
    out["s1"] = shared + [10, 11]
    out["s2"] = list(shared)
    return out


@pytest.fixture(scope="module")
def expected(hf_model) -> dict[str, list[int]]:
    return {rid: hf_greedy(hf_model, ids, NEW) for rid, ids in prompts().items()}


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_single_requests_match_transformers(tiny_ckpt, expected):
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64, enable_prefix_caching=False)
    for rid, ids in prompts().items():
        outs = run_all(engine, {rid: (ids, greedy())})
        assert token_ids(outs[rid]) == expected[rid], rid
        assert outs[rid][-1].finish_reason == "length"
        assert engine.blocks.num_used == 0


def test_concurrent_chunked_prefill_and_prefix_cache_match(tiny_ckpt, expected):
    # A 16-token step budget forces every long prompt through several prefill chunks, mixed
    # with other sequences' decodes; the shared-prefix prompts hit the prefix cache.
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=128, max_num_batched_tokens=16, max_num_seqs=8)
    ps = prompts()
    first = run_all(engine, {"s0": (ps["s0"], greedy())})  # warms the prefix cache
    assert token_ids(first["s0"]) == expected["s0"]
    outs = run_all(engine, {rid: (ids, greedy()) for rid, ids in ps.items()})
    for rid in ps:
        assert token_ids(outs[rid]) == expected[rid], rid
    stats = engine.stats()
    assert stats.prefix_hits >= 3 * 32  # s0, s1, s2 each reuse 4 full blocks of the prefix
    assert outs["s1"][-1].num_cached_tokens == 32
    assert stats.kv_blocks_used == 0


def test_preemption_by_recompute_matches(tiny_ckpt, expected):
    # 10 blocks x 8 tokens cannot hold these sequences at once: the newest are preempted and
    # recomputed later, and their output must not change.
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=10, max_model_len=80, max_num_batched_tokens=32,
                         max_num_seqs=8, enable_prefix_caching=False)
    ps = prompts()
    outs = run_all(engine, {rid: (ids, greedy()) for rid, ids in ps.items()})
    for rid in ps:
        assert token_ids(outs[rid]) == expected[rid], rid
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_preemption_with_prefix_cache_matches(tiny_ckpt, expected):
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=12, max_model_len=80, max_num_batched_tokens=24,
                         max_num_seqs=8)
    ps = prompts()
    outs = run_all(engine, {rid: (ids, greedy()) for rid, ids in ps.items()})
    for rid in ps:
        assert token_ids(outs[rid]) == expected[rid], rid
    assert engine.stats().num_preemptions > 0
    assert engine.blocks.num_used == 0


def test_abort_mid_generation_frees_blocks(tiny_ckpt):
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64)
    ps = prompts()
    for rid, ids in ps.items():
        engine.add_request(rid, ids, greedy(40))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_used > 0
    for rid in list(ps)[::2]:
        assert engine.abort(rid)
    engine.run_to_completion()
    assert engine.blocks.num_used == 0
    # cancelled while still waiting
    engine2 = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=8)
    engine2.add_request("a", ps["r3"], greedy(5))
    engine2.add_request("b", ps["r4"], greedy(5))
    engine2.step()
    assert engine2.abort("b") and engine2.abort("a")
    assert not engine2.has_unfinished() and engine2.blocks.num_used == 0
