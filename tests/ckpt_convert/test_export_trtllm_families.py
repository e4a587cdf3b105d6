"""TensorRT-LLM export of the families: names, per-rank shapes, values and config.json as
TensorRT-LLM's own converters write them (models/llama/convert.py for Mistral/Mixtral,
models/qwen/convert.py for Qwen2/Qwen3/Qwen3-MoE; see export_trtllm's docstring), and the
compositions it cannot hold refused with one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_helpers import make_checkpoint, tiny_llama
from safetensors.torch import load_file

from tessera.ckpt_convert.cli import main, run
from tessera.ckpt_convert.source import CheckpointSource

# d=64, 4 query heads, 2 KV heads, 4 layers; experts: 4 of width 32.
MOE = dict(num_experts=4, top_k=2, ffn_hidden_size=32)


def _export(tmp_path, cfg, tokenizer_dir, tp: int, pp: int, *extra: str):
    make_checkpoint(tmp_path / "ck", cfg, tokenizer_dir)
    out = tmp_path / "trt"
    assert run(["export", "--format", "trtllm", "--checkpoint", str(tmp_path / "ck"), "--output", str(out),
                "--tensor-parallel", str(tp), "--pipeline-parallel", str(pp), "--quiet", *extra]) == 0
    ranks = [load_file(out / f"rank{r}.safetensors") for r in range(tp * pp)]
    return ranks, json.loads((out / "config.json").read_text()), CheckpointSource(tmp_path / "ck")


def test_mixtral_tp2_pp2_experts_router_and_window_as_the_llama_converter_writes_them(tmp_path, tokenizer_dir):
    cfg = tiny_llama(arch="mixtral", ffn_hidden_size=32, sliding_window=7, moe=MOE)
    ranks, config, src = _export(tmp_path, cfg, tokenizer_dir, 2, 2, "--dtype", "bf16")
    # Global layer 3 = pipeline rank 1, local layer 1, on ranks 2 (tp 0) and 3 (tp 1).
    x = "layers.3.mlp."
    w = src.load_model([x + "router.weight", x + "experts.gate_proj", x + "experts.up_proj", x + "experts.down_proj"])
    for tp in range(2):
        r, n = ranks[2 + tp], "transformer.layers.1.mlp."
        assert {k for k in r if k.startswith(n)} == {n + "router.weight", n + "fc.weight", n + "proj.weight"}
        rows = slice(tp * 16, (tp + 1) * 16)
        # The router stays float32 (TensorRT-LLM never casts or quantises it); experts in --dtype.
        assert r[n + "router.weight"].dtype == torch.float32 and torch.equal(r[n + "router.weight"], w[x + "router.weight"])
        fc = torch.cat([w[x + "experts.up_proj"][:, rows], w[x + "experts.gate_proj"][:, rows]], dim=1)  # [w3; w1]
        assert r[n + "fc.weight"].shape == (4, 32, 64) and torch.equal(r[n + "fc.weight"], fc.to(torch.bfloat16))
        proj = w[x + "experts.down_proj"][:, :, rows]
        assert r[n + "proj.weight"].shape == (4, 64, 16) and torch.equal(r[n + "proj.weight"], proj.to(torch.bfloat16))
        assert "transformer.layers.1.mlp.gate.weight" not in r and "transformer.layers.2.input_layernorm.weight" not in r
    assert config["architecture"] == "MixtralForCausalLM" and config["hidden_act"] == "swiglu"
    assert config["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": 1, "sparse_mixer_epsilon": 0.01,
                             "tp_mode": 0}
    assert config["mapping"] == {"world_size": 4, "tp_size": 2, "pp_size": 2, "moe_tp_size": 2, "moe_ep_size": 1}
    assert config["intermediate_size"] == 32 and config["attn_bias"] is False and config["dtype"] == "bfloat16"
    assert config["runtime_defaults"] == {"max_attention_window": [7], "sink_token_length": None}


def test_mistral_is_llama_named_with_its_window(tmp_path, tokenizer_dir):
    cfg = tiny_llama(arch="mistral", sliding_window=16, head_dim=32)
    ranks, config, src = _export(tmp_path, cfg, tokenizer_dir, 1, 1)
    w = src.load_model(["layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"])
    assert torch.equal(ranks[0]["transformer.layers.0.mlp.fc.weight"], w["layers.0.mlp.gate_proj.weight"])
    assert torch.equal(ranks[0]["transformer.layers.0.mlp.gate.weight"], w["layers.0.mlp.up_proj.weight"])
    assert ranks[0]["transformer.layers.0.attention.qkv.weight"].shape == ((4 + 2 + 2) * 32, 64)
    assert config["architecture"] == "MistralForCausalLM" and config["head_size"] == 32 and "moe" not in config
    assert config["runtime_defaults"]["max_attention_window"] == [16]


def test_qwen2_qkv_bias_per_rank_and_per_layer_windows(tmp_path, tokenizer_dir):
    cfg = tiny_llama(arch="qwen2", attention_bias=["q", "k", "v"], sliding_window=5, sliding_window_layers=[1, 2, 3])
    ranks, config, src = _export(tmp_path, cfg, tokenizer_dir, 2, 1)
    w = src.load_model([f"layers.2.attn.{p}_proj.bias" for p in "qkv"])
    for tp, r in enumerate(ranks):
        # 4 query heads of 16 over 2 ranks, 2 KV heads: one each.
        expect = torch.cat([w["layers.2.attn.q_proj.bias"][tp * 32:(tp + 1) * 32],
                            w["layers.2.attn.k_proj.bias"][tp * 16:(tp + 1) * 16],
                            w["layers.2.attn.v_proj.bias"][tp * 16:(tp + 1) * 16]])
        assert torch.equal(r["transformer.layers.2.attention.qkv.bias"], expect)
        assert "transformer.layers.2.attention.dense.bias" not in r and "transformer.layers.2.mlp.fc.bias" not in r
    assert config["architecture"] == "Qwen2ForCausalLM" and config["qwen_type"] == "qwen2"
    assert config["attn_bias"] is True and config["mlp_bias"] is False and config["moe"]["num_experts"] == 0
    assert config["runtime_defaults"]["max_attention_window"] == [128, 5, 5, 5]  # layer 0 sees max_seq_len


def test_qwen3_moe_qk_layernorm_and_experts_as_the_qwen_converter_writes_them(tmp_path, tokenizer_dir):
    cfg = tiny_llama(arch="qwen3_moe", qk_norm=True, head_dim=24, moe={**MOE, "norm_topk_prob": False})
    ranks, config, src = _export(tmp_path, cfg, tokenizer_dir, 2, 1)
    w = src.load_model(["layers.1.attn.q_norm.weight", "layers.1.attn.k_norm.weight"])
    for r in ranks:
        assert torch.equal(r["transformer.layers.1.attention.q_layernorm.weight"], w["layers.1.attn.q_norm.weight"])
        assert torch.equal(r["transformer.layers.1.attention.k_layernorm.weight"], w["layers.1.attn.k_norm.weight"])
        assert r["transformer.layers.1.attention.qkv.weight"].shape == ((2 + 1 + 1) * 24, 64)
        assert r["transformer.layers.0.mlp.fc.weight"].shape == (4, 32, 64)
    assert config["architecture"] == "Qwen3MoeForCausalLM" and config["qwen_type"] == "qwen3_moe"
    assert config["qk_layernorm"] is True and config["head_size"] == 24 and config["attn_bias"] is False
    assert config["moe_intermediate_size"] == 32 and config["intermediate_size"] == 96
    assert config["moe"]["normalization_mode"] == 0  # norm_topk_prob off: the softmax weights as they are


@pytest.mark.parametrize("overrides, message", [
    (dict(arch="qwen3_moe", qk_norm=True, moe={**MOE, "first_k_dense": 1}), "moe.first_k_dense / moe.layer_freq"),
    (dict(arch="qwen3", qk_norm=True, attention_bias=["q", "k", "v", "o"]), "arch=qwen3 with attention_bias"),
    (dict(arch="qwen3", qk_norm=True, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32}), "rope_scaling yarn"),
])
def test_what_tensorrt_llm_cannot_hold_is_refused_with_one_line(tmp_path, tokenizer_dir, capsys, overrides, message):
    make_checkpoint(tmp_path / "ck", tiny_llama(**overrides), tokenizer_dir)
    with pytest.raises(SystemExit) as exc:
        main(["export", "--format", "trtllm", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
