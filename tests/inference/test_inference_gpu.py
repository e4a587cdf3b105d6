"""On CUDA: the engine (Triton paged attention, one launch for mixed prefill/decode batches)
matches transformers' greedy generate in fp32, and runs in bf16. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import hf_greedy, hf_llama_from, run_all, token_ids

from tessera.common.checkpoint import load_model_tensors, read_sidecar, resolve_checkpoint
from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine
from tessera.inference.worker.loader import load_for_serving

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(ckpt, dtype):
    dev = torch.device("cuda")
    loaded = load_for_serving(ckpt, dev, dtype)
    return LLMEngine(loaded, EngineConfig(block_size=16, num_kv_blocks=128, max_num_batched_tokens=32,
                                          max_num_seqs=8), dev, dtype)


def test_cuda_fp32_greedy_matches_transformers(tiny_ckpt):
    ckpt = resolve_checkpoint(tiny_ckpt)
    hf = hf_llama_from(read_sidecar(ckpt).model, load_model_tensors(ckpt))
    g = torch.Generator().manual_seed(3)
    prompts = {f"p{i}": torch.randint(3, 512, (n,), generator=g).tolist() for i, n in enumerate((3, 20, 45, 9))}
    expected = {k: hf_greedy(hf, v, 12) for k, v in prompts.items()}
    engine = _engine(tiny_ckpt, torch.float32)
    outs = run_all(engine, {k: (v, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
                            for k, v in prompts.items()})
    for k in prompts:
        assert token_ids(outs[k]) == expected[k], k
    assert engine.blocks.num_used == 0


def test_cuda_bf16_runs(tiny_ckpt):
    engine = _engine(tiny_ckpt, torch.bfloat16)
    outs = run_all(engine, {"a": ([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True))})
    assert len(token_ids(outs["a"])) == 8 and engine.blocks.num_used == 0
