"""Tensor-parallel serving of a hybrid model (`--tensor-parallel 2`, executor.py, the kind's parallel
plan): two gloo workers, each holding its share of the Mamba heads and groups (and their states),
of the attention heads (and their K/V) and of the vocabulary, give transformers' greedy tokens
under chunked prefill and preemption; a size the model cannot be split by is refused in one line
before any worker starts."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import hf_greedy, run_all, token_ids
from test_hf_serving import _save
from test_hybrid_serving import VOCAB, hf_model

from tessera.common.checkpoint import (
    CheckpointSidecar,
    finalize_checkpoint,
    save_model_tensors,
    write_pointer,
)
from tessera.common.errors import UserError
from tessera.common.hf.directory import load_hf_weights, read_hf_config
from tessera.common.tokenizer import load_tokenizer
from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine
from tessera.inference.worker.loader import load_for_serving

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CPU = torch.device("cpu")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp2_serves_a_nemotron_h_directory_like_transformers_under_chunked_prefill_and_preemption(tiny_ckpt, tmp_path,
                                                                                                   expert_parallel):
    """With --enable-expert-parallel each rank holds 2 of the 4 (squared-ReLU, ungated) experts."""
    hf = hf_model("nemotron_h")  # M-*EM: Mamba heads 4 / groups 2, attention 4 / kv 2, MLP 48, 4 experts
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    gen = torch.Generator().manual_seed(3)
    # Longest first: the first step is a 32-token chunk of it alone, with no row to sample.
    prompts = {str(i): torch.randint(2, VOCAB, (55 - 7 * i,), generator=gen).tolist() for i in range(6)}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    loaded = load_for_serving(export, CPU, torch.float32, tensor_parallel=2)
    engine = LLMEngine(loaded, EngineConfig(tensor_parallel=2, block_size=8, num_kv_blocks=12, max_model_len=80,
                                            max_num_batched_tokens=32, max_num_seqs=8,
                                            enable_expert_parallel=expert_parallel), CPU, torch.float32)
    try:
        assert "on each of 2 ranks" in engine.runner.state_summary()
        outs = run_all(engine, {rid: (p, params) for rid, p in prompts.items()})
        preempted = engine.scheduler.num_preemptions
    finally:
        engine.close()
    for rid, prompt in prompts.items():
        assert token_ids(outs[rid]) == hf_greedy(hf, prompt, 6), rid
    assert preempted > 0


def test_tp2_serves_a_tessera_checkpoint_of_a_mamba2_model_like_transformers(tiny_ckpt, tmp_path):
    """Each worker reads its slices of the layout-free DCP checkpoint (the kind's tensor map)."""
    hf = hf_model("mamba2")
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    cfg, _ = read_hf_config(export)
    it = tmp_path / "run" / "checkpoints" / "iter_0000001"
    it.mkdir(parents=True)
    save_model_tensors(it, load_hf_weights(export, cfg))
    load_tokenizer(export).save(it / "tokenizer")
    finalize_checkpoint(it, CheckpointSidecar(model=cfg, step=1))
    write_pointer(it.parent, 1)
    prompts = {"a": list(range(40, 85)), "b": [9, 300, 2, 77, 5]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    loaded = load_for_serving(tmp_path / "run", CPU, torch.float32, tensor_parallel=2)
    engine = LLMEngine(loaded, EngineConfig(tensor_parallel=2, block_size=8, num_kv_blocks=64, max_model_len=128,
                                            max_num_batched_tokens=16, max_num_seqs=4), CPU, torch.float32)
    try:
        outs = run_all(engine, {rid: (p, params) for rid, p in prompts.items()})
    finally:
        engine.close()
    for rid, prompt in prompts.items():
        assert token_ids(outs[rid]) == hf_greedy(hf, prompt, 8), rid


def test_a_tensor_parallel_size_that_does_not_divide_the_mamba_groups_is_refused_before_any_worker(tiny_ckpt,
                                                                                                  tmp_path):
    export = _save(hf_model("mamba2"), tiny_ckpt, tmp_path / "hf")  # 4 Mamba heads, 2 groups
    with pytest.raises(UserError, match=r"--tensor-parallel 4: must divide the 2 Mamba groups \(mamba.num_groups\)"):
        load_for_serving(export, CPU, torch.float32, tensor_parallel=4)
