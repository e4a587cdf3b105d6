"""TensorRT-LLM export: names, per-rank shapes and splits checked against a table written from
TensorRT-LLM's converters (models/llama/convert.py, models/gpt/convert.py), plus exact values."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_helpers import make_checkpoint, tiny_gpt2, tiny_llama
from safetensors.torch import load_file

from tessera.ckpt_convert.cli import run
from tessera.ckpt_convert.source import CheckpointSource

# Llama, d=64, 4 query heads (hd=16), 1 KV head, ffn 96, vocab 321, 4 layers; tp=2, pp=2.
# rank = pp_rank * tp + tp_rank. The single KV head is duplicated so each tp rank holds one.
LLAMA_TABLE = {
    "transformer.vocab_embedding.weight": ((321, 64), {0, 1}),
    "transformer.layers.0.input_layernorm.weight": ((64,), {0, 1, 2, 3}),
    "transformer.layers.0.attention.qkv.weight": ((32 + 16 + 16, 64), {0, 1, 2, 3}),
    "transformer.layers.0.attention.dense.weight": ((64, 32), {0, 1, 2, 3}),
    "transformer.layers.0.post_layernorm.weight": ((64,), {0, 1, 2, 3}),
    "transformer.layers.0.mlp.fc.weight": ((48, 64), {0, 1, 2, 3}),
    "transformer.layers.0.mlp.gate.weight": ((48, 64), {0, 1, 2, 3}),
    "transformer.layers.0.mlp.proj.weight": ((64, 48), {0, 1, 2, 3}),
    "transformer.layers.1.mlp.proj.weight": ((64, 48), {0, 1, 2, 3}),
    "transformer.ln_f.weight": ((64,), {2, 3}),
    "lm_head.weight": ((161, 64), {2, 3}),  # 321 padded to 322, split in 2
}


def test_llama_tp2_pp2_table_and_values(tmp_path, tokenizer_dir):
    cfg = tiny_llama(vocab_size=321, num_kv_heads=1, rope_scaling=dict(factor=8.0, low_freq_factor=1.0,
                     high_freq_factor=4.0, original_max_position_embeddings=32))
    make_checkpoint(tmp_path / "ck", cfg, tokenizer_dir)
    out = tmp_path / "trt"
    assert run(["export", "--format", "trtllm", "--checkpoint", str(tmp_path / "ck"), "--output", str(out),
                "--tensor-parallel", "2", "--pipeline-parallel", "2", "--dtype", "fp32", "--quiet"]) == 0
    ranks = [load_file(out / f"rank{r}.safetensors") for r in range(4)]
    for name, (shape, where) in LLAMA_TABLE.items():
        for r in range(4):
            assert (name in ranks[r]) == (r in where), (name, r)
            if r in where:
                assert tuple(ranks[r][name].shape) == shape, (name, r)
    # Layers are renumbered per pipeline rank: 2 layers each, named 0 and 1.
    assert not any(k.startswith("transformer.layers.2.") for rank in ranks for k in rank)

    w = CheckpointSource(tmp_path / "ck").load_model(
        ["layers.2.attn.q_proj.weight", "layers.2.attn.k_proj.weight", "layers.2.attn.v_proj.weight",
         "layers.2.mlp.gate_proj.weight", "layers.2.mlp.up_proj.weight", "layers.2.mlp.down_proj.weight",
         "layers.2.attn.o_proj.weight", "lm_head.weight"])
    # Global layer 2 = pipeline rank 1, local layer 0, on ranks 2 (tp 0) and 3 (tp 1).
    for tp in range(2):
        r = ranks[2 + tp]
        q_rows = w["layers.2.attn.q_proj.weight"][tp * 32:(tp + 1) * 32]
        expect_qkv = torch.cat([q_rows, w["layers.2.attn.k_proj.weight"], w["layers.2.attn.v_proj.weight"]])
        assert torch.equal(r["transformer.layers.0.attention.qkv.weight"], expect_qkv)
        # fc holds gate_proj (the SiLU input), gate holds up_proj: TensorRT-LLM's GatedMLP naming.
        assert torch.equal(r["transformer.layers.0.mlp.fc.weight"], w["layers.2.mlp.gate_proj.weight"][tp * 48:(tp + 1) * 48])
        assert torch.equal(r["transformer.layers.0.mlp.gate.weight"], w["layers.2.mlp.up_proj.weight"][tp * 48:(tp + 1) * 48])
        assert torch.equal(r["transformer.layers.0.mlp.proj.weight"], w["layers.2.mlp.down_proj.weight"][:, tp * 48:(tp + 1) * 48])
        assert torch.equal(r["transformer.layers.0.attention.dense.weight"], w["layers.2.attn.o_proj.weight"][:, tp * 32:(tp + 1) * 32])
    head = torch.cat([ranks[2]["lm_head.weight"], ranks[3]["lm_head.weight"]])
    assert torch.equal(head[:321], w["lm_head.weight"]) and torch.all(head[321:] == 0)

    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM"
    assert config["mapping"] == {"world_size": 4, "tp_size": 2, "pp_size": 2}
    assert config["position_embedding_type"] == "rope_gpt_neox" and config["rotary_base"] == 500000.0
    assert config["rotary_scaling"]["type"] == "llama3" and config["rotary_scaling"]["factor"] == 8.0
    assert config["num_key_value_heads"] == 1 and config["quantization"]["quant_algo"] is None
    assert config["dtype"] == "float32" and config["vocab_size"] == 321 and config["head_size"] == 16


def test_gpt2_tp2_qkv_per_rank_and_tied_head(tmp_path, tokenizer_dir):
    cfg = tiny_gpt2()  # d=64, 4 heads, tied
    make_checkpoint(tmp_path / "ck", cfg, tokenizer_dir)
    out = tmp_path / "trt"
    run(["export", "--format", "trtllm", "--checkpoint", str(tmp_path / "ck"), "--output", str(out),
         "--tensor-parallel", "2", "--pipeline-parallel", "1", "--quiet"])
    ranks = [load_file(out / f"rank{r}.safetensors") for r in range(2)]
    src = CheckpointSource(tmp_path / "ck")
    w = src.load_model([f"layers.1.attn.{p}_proj.{s}" for p in "qkv" for s in ("weight", "bias")]
                       + ["embed_tokens.weight", "pos_embed.weight", "layers.1.mlp.up_proj.weight",
                          "layers.1.attn.o_proj.bias"])
    for tp, r in enumerate(ranks):
        sl = slice(tp * 32, (tp + 1) * 32)
        expect = torch.cat([w[f"layers.1.attn.{p}_proj.weight"][sl] for p in "qkv"])
        assert torch.equal(r["transformer.layers.1.attention.qkv.weight"], expect)
        assert torch.equal(r["transformer.layers.1.attention.qkv.bias"],
                           torch.cat([w[f"layers.1.attn.{p}_proj.bias"][sl] for p in "qkv"]))
        assert torch.equal(r["transformer.layers.1.mlp.fc.weight"], w["layers.1.mlp.up_proj.weight"][tp * 128:(tp + 1) * 128])
        assert torch.equal(r["transformer.layers.1.attention.dense.bias"], w["layers.1.attn.o_proj.bias"])
        assert torch.equal(r["transformer.position_embedding.weight"], w["pos_embed.weight"])
        assert torch.equal(r["lm_head.weight"], w["embed_tokens.weight"][tp * 160:(tp + 1) * 160])
        assert "transformer.layers.1.mlp.gate.weight" not in r
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "GPTForCausalLM" and config["position_embedding_type"] == "learned_absolute"
    assert config["hidden_act"] == "gelu_new" and config["bias"] is True


@pytest.mark.parametrize("tp, pp, message", [(3, 1, "does not divide num_heads"), (1, 3, "does not divide num_layers")])
def test_trtllm_bad_layout_exit_2(tmp_path, tokenizer_dir, capsys, tp, pp, message):
    from tessera.ckpt_convert.cli import main

    make_checkpoint(tmp_path / "ck", tiny_llama(), tokenizer_dir)
    with pytest.raises(SystemExit) as exc:
        main(["export", "--format", "trtllm", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "o"),
              "--tensor-parallel", str(tp), "--pipeline-parallel", str(pp)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_linear_rope_scaling_is_written_as_tensorrt_llms_linear_rotary_scaling():
    """Linear position interpolation has TensorRT-LLM's own `{"type": "linear", "factor"}` form."""
    from tessera.ckpt_convert.exporters.trtllm import trtllm_config, validate

    cfg = tiny_llama(rope_scaling=dict(rope_type="linear", factor=2.0))
    validate(cfg, 1, 1)
    config = trtllm_config(cfg, torch.float32, 1, 1)
    assert config["rotary_scaling"] == {"type": "linear", "factor": 2.0}
    assert config["architecture"] == "LlamaForCausalLM"
