"""Hybrid models and Megatron-Core: a MambaModel `torch_dist` checkpoint written by megatron-core's own
code on CPU (megatron_mamba_save.py: its MambaStack, MambaMixer, attention, MLP and MoE layers, with
the CUDA-only kernels and Transformer Engine layers stood in for) imports through `tessera-ckpt
import --format megatron`, exports to Hugging Face with Megatron's tensors in transformers' layout,
and exports back to a torch_dist checkpoint that megatron-core's dist_checkpointing.load reads into
the same model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from ckpt_helpers import refused

from tessera.ckpt_convert.cli import run

HERE = Path(__file__).parent
VOCAB, ROWS = 320, 384  # Megatron pads the vocabulary to a multiple of 128
SPEC = {"pattern": "M-*EM", "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
        "ffn_hidden_size": 48, "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_state_dim": 8,
        "mamba_num_groups": 2, "num_experts": 4, "moe_ffn_hidden_size": 16, "top_k": 2,
        "shared_ffn_hidden_size": 24, "rows": ROWS}
MODEL = {"kind": "hybrid", "arch": "nemotron_h", "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 5,
         "pattern": "M-*EM", "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "ffn_hidden_size": 48,
         "mamba": {"num_heads": 4, "head_dim": 16, "state_size": 8, "num_groups": 2, "chunk_size": 8,
                   "dt_limit_min": 0.001},
         "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16, "score": "sigmoid", "bias_balancing": True,
                 "num_shared_experts": 1, "shared_ffn_hidden_size": 24}}


def megatron(tmp_path: Path, directory: Path, mode: str) -> dict[str, torch.Tensor]:
    (tmp_path / "spec.json").write_text(json.dumps(SPEC))
    proc = subprocess.run([sys.executable, str(HERE / "megatron_mamba_save.py"), str(tmp_path / "spec.json"),
                           str(directory), mode], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(directory.parent / ("megatron_params.pt" if mode == "save" else "loaded_params.pt"))


def megatron_as_transformers(mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron's in-memory tensors under transformers' Nemotron-H names: its fused in_proj and
    conv1d are transformers' ([z|x|B|C|dt], [x|B|C]); its linear_qkv groups rows per query group."""
    out = {"backbone.embeddings.weight": mg["embedding.word_embeddings.weight"][:VOCAB],
           "backbone.norm_f.weight": mg["decoder.final_norm.weight"],
           "lm_head.weight": mg["output_layer.weight"][:VOCAB]}
    for i, symbol in enumerate(SPEC["pattern"]):
        m, h = f"decoder.layers.{i}.", f"backbone.layers.{i}."
        if symbol == "M":
            out[h + "norm.weight"] = mg[m + "mixer.in_proj.layer_norm_weight"]
            for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight",
                         "out_proj.weight"):
                out[h + "mixer." + name] = mg[m + "mixer." + name]
        elif symbol == "*":
            out[h + "norm.weight"] = mg[m + "self_attention.linear_qkv.layer_norm_weight"]
            groups = mg[m + "self_attention.linear_qkv.weight"].reshape(2, 4 * 8, 32)  # 2 groups: q q k v
            out[h + "mixer.q_proj.weight"] = groups[:, :16].reshape(32, 32)
            out[h + "mixer.k_proj.weight"] = groups[:, 16:24].reshape(16, 32)
            out[h + "mixer.v_proj.weight"] = groups[:, 24:].reshape(16, 32)
            out[h + "mixer.o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        elif symbol == "-":
            out[h + "norm.weight"] = mg[m + "mlp.linear_fc1.layer_norm_weight"]
            out[h + "mixer.up_proj.weight"] = mg[m + "mlp.linear_fc1.weight"]
            out[h + "mixer.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
        else:
            out[h + "norm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
            out[h + "mixer.gate.weight"] = mg[m + "mlp.router.weight"]
            out[h + "mixer.gate.e_score_correction_bias"] = mg[m + "mlp.router.expert_bias"]
            for e in range(SPEC["num_experts"]):
                for fc, proj in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
                    out[h + f"mixer.experts.{e}.{proj}.weight"] = mg[m + f"mlp.experts.local_experts.{e}.{fc}.weight"]
            out[h + "mixer.shared_experts.up_proj.weight"] = mg[m + "mlp.shared_experts.linear_fc1.weight"]
            out[h + "mixer.shared_experts.down_proj.weight"] = mg[m + "mlp.shared_experts.linear_fc2.weight"]
    return out


def test_megatron_mamba_model_checkpoint_imports_exports_to_transformers_and_back_to_megatron(tmp_path):
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    ckpt = tmp_path / "mcore" / "iter_0000001"
    ckpt.mkdir(parents=True)
    mg = megatron(tmp_path, ckpt, "save")
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(MODEL))
    assert run(["import", "--format", "megatron", "--input", str(ckpt), "--output", str(tmp_path / "ours"),
                "--model-config", str(tmp_path / "model.yaml"), "--quiet"]) == 0
    # To transformers: every tensor is Megatron's, in transformers' layout, and transformers loads it.
    assert run(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ours"), "--output", str(tmp_path / "hf"),
                "--quiet"]) == 0
    theirs, want = load_file(tmp_path / "hf" / "model.safetensors"), megatron_as_transformers(mg)
    assert theirs.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(theirs[name], tensor), name
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "NemotronHForCausalLM"
    # And back: megatron-core reads our torch_dist export into its model, every tensor as it saved it
    # (the vocabulary's padding rows are zero: Megatron never uses them).
    back = tmp_path / "back" / "iter_0000002"
    assert run(["export", "--format", "megatron", "--checkpoint", str(tmp_path / "ours"), "--output", str(back),
                "--quiet"]) == 0
    loaded = megatron(tmp_path, back, "load")
    assert loaded.keys() == mg.keys()
    for name, tensor in mg.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(loaded[name][:VOCAB], tensor[:VOCAB]) and not loaded[name][VOCAB:].any(), name
        else:
            assert torch.equal(loaded[name], tensor), name


def test_megatron_hybrid_configs_it_cannot_hold_and_mismatched_patterns_are_one_line(tmp_path, capsys):
    """Megatron's mixer has no projection biases; a --model-config whose pattern is not the
    checkpoint's names the first tensor that does not fit; nothing is written."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "iter_0000001"
    tensors = {"embedding.word_embeddings.weight": torch.zeros(ROWS, 32),
               "decoder.layers.0.mixer.in_proj.layer_norm_weight": torch.zeros(32)}
    dcp.save(tensors, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    biased = {**MODEL, "mamba": {**MODEL["mamba"], "bias": True}}
    (tmp_path / "biased.yaml").write_text(yaml.safe_dump(biased))
    err = refused(capsys, ["import", "--format", "megatron", "--input", str(ckpt), "--output", str(tmp_path / "o"),
                            "--model-config", str(tmp_path / "biased.yaml")])
    assert "mamba.bias=true" in err and "Megatron" in err
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(MODEL))
    err = refused(capsys, ["import", "--format", "megatron", "--input", str(ckpt), "--output", str(tmp_path / "o"),
                            "--model-config", str(tmp_path / "model.yaml")])
    assert "decoder.layers.0.mixer.in_proj.weight.z" in err and "'M-*EM'" in err
    assert not (tmp_path / "o").exists()
