"""DeepSeek-V3-class models and Megatron-Core: a GPTModel `torch_dist` checkpoint with multi-latent
attention, a dense first layer and MoE layers, written by megatron-core's own code on CPU
(megatron_mla_save.py: its MLASelfAttention, MoE layer, router and experts; TE layers stood in for),
imports through `tessera-ckpt import --format megatron`, exports to Hugging Face with Megatron's
tensors in transformers' layout (which transformers' DeepseekV3ForCausalLM loads), and exports back
to a torch_dist checkpoint that megatron-core's dist_checkpointing.load reads into the same model,
at tensor parallel 1 (every tensor equal) and 2 (the same logits), and imports back byte-identical.
Megatron's own forward gives the imported model's logits (its local core attention cannot run MLA,
so that one softmax is stood in for by SDPA; everything with weights is Megatron's). Each model has
multi-token-prediction layers (Megatron's MultiTokenPredictionBlock, `mtp_num_layers` 1 or 2): each
depth's logits are Megatron's, and so is each depth's loss where the vocabulary has no padding rows
(Megatron's loss reads its padding rows' logits; Tessera's never does)."""

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
from tessera.common.checkpoint import load_model_tensors, read_sidecar, resolve_checkpoint
from tessera.common.models.causal_lm.model import build_model

HERE = Path(__file__).parent
VOCAB, ROWS = 200, 256  # Megatron pads the vocabulary to a multiple of 128
SPEC = {"num_layers": 3, "first_k_dense": 1, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 48,
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "num_experts": 4, "moe_ffn_hidden_size": 16, "shared_ffn_hidden_size": 16, "top_k": 2, "num_groups": 2,
        "topk_groups": 1, "routed_scaling_factor": 2.5, "rows": ROWS, "vocab_size": VOCAB, "mtp": 1}
MODEL = {"arch": "deepseek_v3", "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 3, "num_heads": 4,
         "ffn_hidden_size": 48, "tie_embeddings": False, "norm_eps": 1e-6,
         "mla": {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
         "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16, "score": "sigmoid", "num_shared_experts": 1,
                 "num_groups": 2, "topk_groups": 1, "bias_balancing": True, "routed_scaling_factor": 2.5,
                 "first_k_dense": 1},
         "mtp": {"depth": 1}}


# Layouts: a dense first layer (Megatron saves each layer apart) with q-lora, one MTP depth; MoE in
# every layer (saved stacked along a leading layer axis) with one q_proj, two MTP depths and no
# vocabulary padding (so Megatron's MTP loss is comparable); the first under Megatron's local spec.
LAYOUTS = {"dense-first": ({}, {}),
           "all-moe-stacked": ({"num_layers": 2, "first_k_dense": 0, "q_lora_rank": None, "mtp": 2,
                                "vocab_size": ROWS},
                               {"num_layers": 2, "vocab_size": ROWS, "mla": {**MODEL["mla"], "q_lora_rank": None},
                                "moe": {**MODEL["moe"], "first_k_dense": 0}, "mtp": {"depth": 2}}),
           # megatron-core's local layer spec: its own norm names (import only: export writes TE's).
           "local-spec": ({"local": True}, {})}


def megatron(mode: str, cases: list[tuple[dict, Path]], tensor_parallel: int = 1) -> list[dict[str, torch.Tensor]]:
    """megatron_mla_save.py on each (spec, directory), in one process (`tensor_parallel` > 1: one
    torchrun launch of that many, which load and write only logits)."""
    argv = []
    for spec, directory in cases:
        directory.mkdir(parents=True, exist_ok=True)
        (directory.parent / "spec.json").write_text(json.dumps(spec))
        argv += [str(directory.parent / "spec.json"), str(directory)]
    launch = [sys.executable] if tensor_parallel == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tensor_parallel)]
    proc = subprocess.run([*launch, str(HERE / "megatron_mla_save.py"), mode, *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if tensor_parallel > 1:
        return [torch.load(directory.parent / f"logits_tp{tensor_parallel}.pt") for _, directory in cases]
    name = "megatron_params.pt" if mode == "save" else "loaded_params.pt"
    return [torch.load(directory.parent / name) for _, directory in cases]


def megatron_as_transformers(mg: dict[str, torch.Tensor], spec: dict) -> dict[str, torch.Tensor]:
    """Megatron's in-memory tensors under transformers' DeepSeek-V3 names. Both keep the RoPE rows
    interleaved (Megatron's MLA de-interleaves at run time), so no row moves; fused [gate; up]
    halves split. MTP depth k is DeepSeek's layer num_layers + k, with copies of the embedding and
    head Megatron's MTP layers share."""
    vocab = spec["vocab_size"]
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": mg["decoder.final_layernorm.weight"],
           "lm_head.weight": mg["output_layer.weight"][:vocab]}
    names = {"input_layernorm.weight": "input_layernorm.weight",
             "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
             "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
             "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
             "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
             "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
             "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
             "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
             "self_attention.linear_proj.weight": "self_attn.o_proj.weight"}

    def swiglu(fc1: torch.Tensor, fc2: torch.Tensor, prefix: str) -> None:
        out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = fc1.chunk(2)
        out[prefix + "down_proj.weight"] = fc2

    layers = [(f"decoder.layers.{i}.", f"model.layers.{i}.", i) for i in range(spec["num_layers"])]
    for k in range(spec["mtp"]):
        m, h = f"mtp.layers.{k}.", f"model.layers.{spec['num_layers'] + k}."
        out.update({h + "embed_tokens.weight": out["model.embed_tokens.weight"], h + "enorm.weight": mg[m + "enorm.weight"],
                    h + "hnorm.weight": mg[m + "hnorm.weight"], h + "eh_proj.weight": mg[m + "eh_proj.weight"],
                    h + "shared_head.norm.weight": mg[m + "final_layernorm.weight"],
                    h + "shared_head.head.weight": out["lm_head.weight"]})
        layers.append((m + "transformer_layer.", h, spec["num_layers"] + k))
    for m, h, i in layers:
        out.update({h + theirs: mg[m + ours] for ours, theirs in names.items() if m + ours in mg})
        if i < spec["first_k_dense"]:
            out[h + "post_attention_layernorm.weight"] = mg[m + "mlp.linear_fc1.layer_norm_weight"]
            swiglu(mg[m + "mlp.linear_fc1.weight"], mg[m + "mlp.linear_fc2.weight"], h + "mlp.")
            continue
        out[h + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
        out[h + "mlp.gate.weight"] = mg[m + "mlp.router.weight"]
        out[h + "mlp.gate.e_score_correction_bias"] = mg[m + "mlp.router.expert_bias"]
        for e in range(spec["num_experts"]):
            x = m + f"mlp.experts.local_experts.{e}."
            swiglu(mg[x + "linear_fc1.weight"], mg[x + "linear_fc2.weight"], h + f"mlp.experts.{e}.")
        swiglu(mg[m + "mlp.shared_experts.linear_fc1.weight"], mg[m + "mlp.shared_experts.linear_fc2.weight"],
               h + "mlp.shared_experts.")
    return out


def test_megatron_deepseek_mla_moe_checkpoints_import_with_megatrons_logits_export_to_transformers_and_back(
        tmp_path):
    pytest.importorskip("megatron.core")
    import transformers
    from safetensors.torch import load_file

    cases = {name: ({**SPEC, **spec}, {**MODEL, **model}, tmp_path / name) for name, (spec, model) in LAYOUTS.items()}
    saved = megatron("save", [(spec, root / "mcore" / "iter_0000001") for spec, _, root in cases.values()])
    backs = []
    for (name, (spec, model_cfg, root)), mg in zip(cases.items(), saved):
        (root / "model.yaml").write_text(yaml.safe_dump(model_cfg))
        assert run(["import", "--format", "megatron", "--input", str(root / "mcore" / "iter_0000001"), "--output",
                    str(root / "ours"), "--model-config", str(root / "model.yaml"), "--quiet"]) == 0
        # Megatron's own forward (its MLA projections, RoPE on interleaved pairs, group-limited sigmoid
        # routing, experts; only the softmax attention stood in for) gives our logits.
        directory = resolve_checkpoint(root / "ours")
        model = build_model(read_sidecar(directory).model, seed=None)
        model.load_state_dict(load_model_tensors(directory))
        ref, vocab = torch.load(root / "mcore" / "reference.pt"), spec["vocab_size"]
        with torch.no_grad():
            ours = model.eval()(ref["tokens"])
        want = ref["logits"][..., :vocab]
        assert (ours - want).abs().max().item() < 1e-4 * want.abs().max().item(), name
        # Each MTP depth's logits (Megatron's MultiTokenPredictionLayer: token ids rolled left once
        # more per depth, zero-filled) and, without vocabulary padding, its loss.
        with torch.no_grad():
            hidden, ids = model(ref["tokens"], return_hidden=True), ref["tokens"]
            for k in range(spec["mtp"]):
                ids = ids.roll(-1, dims=1)
                ids[:, -1] = 0
                hidden = model.mtp_hidden(k, hidden, ids)
                want = ref["mtp_logits"][k][..., :vocab]
                assert (model.logits(hidden) - want).abs().max().item() < 1e-4 * want.abs().max().item(), (name, k)
            model(ref["tokens"], mtp_labels=ref["labels"])
        losses = model.mtp.metrics()
        losses = [losses[f"mtp_loss_{k}"] for k in range(1, spec["mtp"] + 1)] if spec["mtp"] > 1 else [losses["mtp_loss"]]
        if vocab == spec["rows"]:
            assert torch.allclose(torch.tensor(losses), ref["mtp_losses"], rtol=1e-5), (name, losses, ref["mtp_losses"])
        if spec.get("local"):
            continue
        # To transformers: every tensor is Megatron's, in transformers' layout, and transformers loads it.
        assert run(["export", "--format", "hf", "--checkpoint", str(root / "ours"), "--output", str(root / "hf"),
                    "--quiet"]) == 0
        theirs, hf_want = load_file(root / "hf" / "model.safetensors"), megatron_as_transformers(mg, spec)
        assert theirs.keys() == hf_want.keys(), name
        for key, tensor in hf_want.items():
            assert torch.equal(theirs[key], tensor), (name, key)
        assert type(transformers.AutoModelForCausalLM.from_pretrained(root / "hf")).__name__ == "DeepseekV3ForCausalLM"
        back = root / "back" / "iter_0000002"
        assert run(["export", "--format", "megatron", "--checkpoint", str(root / "ours"), "--output", str(back),
                    "--quiet"]) == 0
        backs.append((spec, back))
        # Ours -> Megatron -> ours: every tensor byte-identical.
        assert run(["import", "--format", "megatron", "--input", str(back), "--output", str(root / "again"),
                    "--model-config", str(root / "model.yaml"), "--quiet"]) == 0
        first, again = load_model_tensors(directory), load_model_tensors(resolve_checkpoint(root / "again"))
        assert first.keys() == again.keys() and any(k.startswith("mtp.layers.") for k in first), name
        for key, tensor in first.items():
            assert tensor.dtype == again[key].dtype and torch.equal(tensor, again[key]), (name, key)
    # And back: megatron-core reads our exports into its model, every tensor as it saved it (the
    # vocabulary's padding rows are zero: Megatron never uses them).
    te = [(name, mg) for (name, case), mg in zip(cases.items(), saved) if not case[0].get("local")]
    for (name, mg), loaded in zip(te, megatron("load", backs)):
        assert loaded.keys() == mg.keys(), name
        vocab = cases[name][0]["vocab_size"]
        for key, tensor in mg.items():
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                assert torch.equal(loaded[key][:vocab], tensor[:vocab]) and not loaded[key][vocab:].any(), key
            else:
                assert torch.equal(loaded[key], tensor), (name, key)
    # Megatron at tensor parallel 2 (attention heads, MLP and expert widths, the MTP layers' eh_proj
    # rows split) reads its shards of our global tensors and gives its unsplit logits, MTP's too.
    for _, back in backs:
        ref = torch.load(back.parent.parent / "mcore" / "reference.pt")
        torch.save({"tokens": ref["tokens"], "labels": ref.get("labels")}, back.parent / "tokens.pt")
    for (name, _), got in zip(te, megatron("load", backs, tensor_parallel=2)):
        ref, vocab = torch.load(cases[name][2] / "mcore" / "reference.pt"), cases[name][0]["vocab_size"]
        for key in ("logits", "mtp_logits"):
            want = ref[key][..., :vocab]
            assert (got[key][..., :vocab] - want).abs().max().item() < 1e-5 * want.abs().max().item(), (name, key)


def test_megatron_layouts_it_cannot_hold_and_checkpoints_of_another_kind_are_one_line_with_nothing_written(
        tmp_path, capsys):
    """A tensor-parallel size that does not divide the heads, an MTP depth whose block is MoE where
    Megatron would build it dense (its MTP layers copy the last decoder layer) and a GPT checkpoint
    read as an MLA model are refused in one line, exit 2 (BERT's refusals: test_megatron_bert.py)."""
    import torch.distributed.checkpoint as dcp
    from ckpt_helpers import make_checkpoint

    from tessera.common.models.causal_lm.config import ModelConfig

    make_checkpoint(tmp_path / "ds", ModelConfig(**MODEL), None)
    out = tmp_path / "out"
    err = refused(capsys, ["export", "--format", "megatron", "--checkpoint", str(tmp_path / "ds"), "--output",
                            str(out), "--tensor-parallel", "3"])
    assert "--tensor-parallel 3" in err and "num_heads (4)" in err
    # layers 0 MoE, 1 dense (layer_freq 2), the MTP depth's block (layer 2) MoE: Megatron's would be dense
    freq = {**MODEL, "num_layers": 2, "moe": {**MODEL["moe"], "first_k_dense": 0, "layer_freq": 2}}
    make_checkpoint(tmp_path / "freq", ModelConfig(**freq), None)
    err = refused(capsys, ["export", "--format", "megatron", "--checkpoint", str(tmp_path / "freq"), "--output",
                            str(out)])
    assert "model.mtp depth 1" in err and "last decoder layer (dense)" in err
    gpt = tmp_path / "gpt" / "iter_0000001"  # a GPTModel checkpoint's names, stacked layers
    dcp.save({"embedding.word_embeddings.weight": torch.zeros(ROWS, 32),
              "decoder.layers.self_attention.linear_qkv.weight": torch.zeros(3, 96, 32)},
             checkpoint_id=str(gpt), no_dist=True)
    (gpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(MODEL))
    err = refused(capsys, ["import", "--format", "megatron", "--input", str(gpt), "--output", str(out),
                            "--model-config", str(tmp_path / "model.yaml")])
    assert "no Megatron tensor decoder.layers.0.input_layernorm.weight" in err
    (tmp_path / "freq.yaml").write_text(yaml.safe_dump(freq))
    err = refused(capsys, ["import", "--format", "megatron", "--input", str(gpt), "--output", str(out),
                            "--model-config", str(tmp_path / "freq.yaml")])
    assert "--model-config: model.mtp depth 1" in err
    assert not out.exists()
