"""Serving's merged projections (tessera.inference.worker.merged_linear: q/k/v and gate/up stacked into one
GEMM each) compute what the checkpoint's split layers compute, alone, with oneDNN packing and
through the engine."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import make_checkpoint, run_all, tiny_config, token_ids
from torch import nn

import tessera.inference.worker.prepare as prepare_module
from tessera.common.models.causal_lm.model import build_model
from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine
from tessera.inference.worker.cpu_linear import onednn_available, pack_linears
from tessera.inference.worker.loader import load_for_serving
from tessera.inference.worker.merged_linear import MergedAttention, MergedMLP, merge_projections

CPU = torch.device("cpu")
FAMILIES = {
    "llama_gqa": {},
    "qwen2_bias": dict(arch="qwen2", attention_bias=["q", "k", "v"]),
    "qwen3_qk_norm": dict(arch="qwen3", qk_norm=True, head_dim=32),
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("family", [*FAMILIES, "gpt2", "mixtral"])
def test_a_merged_model_gives_the_split_models_logits(family):
    over = {"gpt2": dict(arch="gpt2", norm="layernorm", activation="gelu", position="learned", bias=True,
                         num_kv_heads=4),
            "mixtral": dict(arch="mixtral", moe=dict(num_experts=4, top_k=2, ffn_hidden_size=64))}.get(family, FAMILIES.get(family))
    cfg = tiny_config(**over)
    model = build_model(cfg, seed=0).eval()
    if family == "qwen2_bias":  # biases initialise to zero: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens)
        merged = merge_projections(model)
        got = model(tokens)
    # One stacked q/k/v per layer, and one gate/up per dense SwiGLU MLP (GPT-2's GELU MLP has no
    # gate; MoE experts stay as they are).
    gated = family not in ("gpt2", "mixtral")
    assert merged == cfg.num_layers * (2 if gated else 1)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    assert not names & {"q_proj", "k_proj", "v_proj"} and ("gate_up_proj" in names) == gated
    assert rel_err(got, want) < 1e-6
    if onednn_available():
        with torch.no_grad():
            packed = pack_linears(model)
            got = model(tokens)
        assert packed == sum(1 for m in model.modules() if type(m).__name__ == "PackedLinear") > 0
        assert rel_err(got, want) < 1e-5


def test_layers_whose_weights_cannot_stack_are_left_split():
    model = build_model(tiny_config(), seed=0)
    block = model.layers["0"]
    block.attn.k_proj = nn.Linear(64, 32).to(torch.float16)  # mixed dtypes
    block.mlp.up_proj.weight = nn.Parameter(block.mlp.up_proj.weight.to(torch.bfloat16))
    assert merge_projections(model) == 2  # layer 1 only
    assert type(block.attn) is not MergedAttention and type(block.mlp) is not MergedMLP


def test_int8_weights_stack_to_the_same_int8_rows_and_logits(tiny_ckpt):
    pytest.importorskip("torchao")
    from tessera.inference.worker.quantization import quantized_weight_dtypes

    model = load_for_serving(tiny_ckpt, CPU, torch.float32, "int8").model
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    q_rows = model.layers["0"].attn.q_proj.weight.qdata.clone()
    with torch.no_grad():
        want = model(tokens)
        assert merge_projections(model) == 4
        got = model(tokens)
    qkv = model.layers["0"].attn.qkv_proj.weight
    assert torch.equal(qkv.qdata[:q_rows.shape[0]], q_rows) and qkv.scale.shape == (64 + 2 * 32, 1)
    assert set(quantized_weight_dtypes(model).values()) == {torch.int8}
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_engine_greedy_outputs_are_identical_with_merged_projections(family, tmp_path, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "run", tiny_config(**FAMILIES[family]))
    g = torch.Generator().manual_seed(3)
    prompts = {f"p{i}": torch.randint(3, 512, (n,), generator=g).tolist() for i, n in enumerate((5, 17, 30, 9))}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for merged in (True, False):
        if not merged:
            monkeypatch.setattr(prepare_module, "merge_projections", lambda model: 0)
        loaded = load_for_serving(ckpt, CPU, torch.float32)
        engine = LLMEngine(loaded, EngineConfig(block_size=16, num_kv_blocks=32, max_num_batched_tokens=64,
                                                max_num_seqs=4), CPU, torch.float32)
        assert any(isinstance(m, MergedAttention) for m in loaded.model.modules()) == merged
        outs[merged] = {k: token_ids(v) for k, v in run_all(engine, {k: (p, params) for k, p in prompts.items()}).items()}
    assert outs[True] == outs[False]
