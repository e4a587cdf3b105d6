"""Tensor parallel above the key/value heads (executor.py): a Llama with 2 key/value heads served
with --tensor-parallel 4 replicates each head on 2 ranks (Megatron's and vLLM's rule), each rank
holding one head of weights and of KV cache. Greedy output equals one process and transformers,
from a DCP checkpoint and from an HF directory; sizes that fit neither rule are refused before
any weight is read."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import hf_greedy, hf_llama_from, make_checkpoint, run_all, tiny_config, token_ids
from test_hf_serving import _llama, _save

from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint
from tessera.common.errors import UserError
from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine
from tessera.inference.worker.kv_cache import kv_block_bytes
from tessera.inference.worker.loader import check_tensor_parallel, load_for_serving
from tessera.inference.worker.tensor_parallel.worker import replicated_kv_config

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CPU = torch.device("cpu")
PROMPTS = {"a": [4, 9, 200, 31, 77, 5, 6, 7, 8, 120, 3], "b": [17, 300, 2, 2, 45, 1, 99], "c": [5] * 21}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _serve(path, tp: int, **cfg) -> tuple[dict[str, list[int]], list[int], list[int]]:
    """Greedy tokens per prompt; the parameter elements and KV-pool bytes of each worker (tp > 1)."""
    loaded = load_for_serving(path, CPU, torch.float32, tensor_parallel=tp)
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, block_size=4, tensor_parallel=tp, **cfg), CPU,
                       torch.float32)
    try:
        outs = run_all(engine, {rid: (p, GREEDY) for rid, p in PROMPTS.items()})
        ex = engine.runner.executor if tp > 1 else None
        return {rid: token_ids(o) for rid, o in outs.items()}, ex.shard_numel if ex else [], ex.kv_bytes if ex else []
    finally:
        engine.close()


def test_tp4_over_two_kv_heads_checkpoint_greedy_equals_tp1_and_transformers_with_one_head_per_rank(tiny_ckpt):
    cfg = tiny_config()  # 4 query heads over 2 key/value heads
    assert cfg.kv_heads == 2
    tensors = load_model_tensors(resolve_checkpoint(tiny_ckpt))
    one, _, _ = _serve(tiny_ckpt, 1)
    hf = hf_llama_from(cfg, tensors)
    for rid, prompt in PROMPTS.items():
        assert one[rid] == hf_greedy(hf, prompt, 10), rid
    four, numel, kv_bytes = _serve(tiny_ckpt, 4)
    assert four == one
    assert kv_bytes == [64 * kv_block_bytes(cfg, 4, torch.float32, 4)] * 4  # one head's K and V per rank
    # Each rank: a quarter of every split tensor, but k/v projections of one whole head (1/2 of
    # them, not 1/4: that head is replicated), and the norms whole.
    kv = sum(t.numel() for n, t in tensors.items() if ".k_proj." in n or ".v_proj." in n)
    norms = cfg.hidden_size * (2 * cfg.num_layers + 1)
    total = sum(t.numel() for t in tensors.values())
    assert numel == [(total - kv - norms) // 4 + kv // 2 + norms] * 4


def test_tp4_over_two_kv_heads_serves_an_hf_directory_like_transformers(tiny_ckpt, tmp_path):
    """Each worker keeps, of the memory-mapped k/v projections, the rows of its one head."""
    hf = _llama(num_key_value_heads=2)
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    got, _, _ = _serve(export, 4)
    for rid, prompt in PROMPTS.items():
        assert got[rid] == hf_greedy(hf, prompt, 10), rid


def test_tp2_workers_store_their_kv_heads_in_fp8_and_follow_the_one_process_fp8_engine(tiny_ckpt):
    """--kv-cache-dtype reaches the workers: each pool is a quarter of fp32's bytes, and greedy
    tokens follow the one-process fp8 engine (tensor parallel changes only summation order, which
    can move an fp8 rounding: the first 8 tokens are compared, as against the fp32 cache)."""
    one, _, _ = _serve(tiny_ckpt, 1, kv_cache_dtype="fp8")
    two, _, kv_bytes = _serve(tiny_ckpt, 2, kv_cache_dtype="fp8")
    assert kv_bytes == [64 * kv_block_bytes(tiny_config(), 4, torch.float32, 2) // 4] * 2
    for rid in PROMPTS:
        assert two[rid][:8] == one[rid][:8], rid


def test_the_replicated_model_has_one_key_value_head_per_rank_and_the_same_query_heads():
    """At tp 4 over 2 key/value heads the workers' model has 4 (replica j a copy of original head
    j // 2; the tp4 greedy tests above show each query head reads its own); at tp 2 it is unchanged."""
    cfg = tiny_config()
    wide = replicated_kv_config(cfg, 4)
    assert wide.kv_heads == 4 and wide.num_heads == cfg.num_heads and wide.head_dim == cfg.head_dim
    assert replicated_kv_config(cfg, 2) is cfg


def test_tensor_parallel_on_cuda_is_checked_against_the_devices_before_any_worker_starts():
    cfg = tiny_config()
    with pytest.raises(UserError, match=r"--device cuda:1 with --tensor-parallel 2: the workers take cuda:0\.\.cuda:1"):
        check_tensor_parallel(2, cfg, "ckpt", device=torch.device("cuda", 1))
    if torch.cuda.device_count() < 2:
        with pytest.raises(UserError, match=r"--tensor-parallel 2: this machine has \d CUDA devices"):
            check_tensor_parallel(2, cfg, "ckpt", device=torch.device("cuda"))


@pytest.mark.parametrize(("tp", "over", "message"), [
    (3, {}, "--tensor-parallel 3: .* has 2 key/value heads; a tensor-parallel size above them must be a multiple"),
    (8, {}, "--tensor-parallel 8: must divide the 4 attention heads"),
    (4, {"num_heads": 12, "num_kv_heads": 6, "hidden_size": 96},
     "--tensor-parallel 4: must divide the 6 key/value heads"),
    (4, {"num_heads": 8, "num_kv_heads": 1}, None),  # MQA: the one head on every rank
])
def test_tensor_parallel_sizes_are_checked_against_the_replication_rule(tp, over, message):
    cfg = tiny_config(**over)
    if message is None:
        check_tensor_parallel(tp, cfg, "ckpt")
    else:
        with pytest.raises(UserError, match=message):
            check_tensor_parallel(tp, cfg, "ckpt")


def test_a_size_that_fits_no_rule_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "run", tiny_config(num_heads=6, num_kv_heads=2, hidden_size=96))
    monkeypatch.setattr("tessera.inference.worker.loader.load_model_tensors", lambda *a, **k: pytest.fail("weights read"))
    with pytest.raises(UserError, match="--tensor-parallel 4: must divide the 6 attention heads"):
        load_for_serving(ckpt, CPU, torch.float32, tensor_parallel=4)
