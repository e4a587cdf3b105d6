"""Tensor-parallel serving of a DeepSeek-V3 model (`--tensor-parallel 2`): two gloo workers, each
holding half the heads of q_b_proj / kv_b_proj / o_proj (the causal LM's plan, split_mla) and the
whole latent KV cache, give transformers' greedy tokens under chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from deepseek_hf import build_hf
from inference_helpers import hf_greedy, run_all, token_ids
from test_deepseek_serving import MODELS, _prompts
from test_hf_serving import _save

from tessera.common.errors import UserError
from tessera.inference.config import EngineConfig, SpeculativeConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine
from tessera.inference.worker.loader import load_for_serving

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CPU = torch.device("cpu")


def test_tp2_serves_a_deepseek_v3_directory_like_transformers_and_refuses_mtp_drafts_in_one_line(tiny_ckpt, tmp_path):
    hf = build_hf(**MODELS["q-lora"])
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
    export = _save(hf, tiny_ckpt, tmp_path / "hf")
    prompts = _prompts(6, 20)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    loaded = load_for_serving(export, CPU, torch.float32, tensor_parallel=2)
    engine = LLMEngine(loaded, EngineConfig(tensor_parallel=2, block_size=8, num_kv_blocks=12, max_model_len=48,
                                            max_num_batched_tokens=16, max_num_seqs=8), CPU, torch.float32)
    try:
        assert engine.runner.state_summary().endswith("(3.0x) on each of 2 ranks")  # half the heads' full K/V
        outs = run_all(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
        preempted = engine.scheduler.num_preemptions
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        assert token_ids(outs[str(i)]) == hf_greedy(hf, prompt, 5), i
    assert preempted > 0
    with pytest.raises(UserError, match=r"method mtp: not built with --tensor-parallel > 1"):
        LLMEngine(loaded, EngineConfig(tensor_parallel=2, block_size=8, num_kv_blocks=12, max_model_len=48,
                                       speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=1)),
                  CPU, torch.float32)
