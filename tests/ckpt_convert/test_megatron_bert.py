"""BERT and Megatron-Core: a BertModel `torch_dist` checkpoint saved by megatron-core's own code on CPU
(megatron_bert_save.py: its local layer spec, gloo) imports through `tessera-ckpt import --format
megatron` as a pre-LayerNorm encoder with Megatron's logits and its pretraining loss (MLM +
sentence order); exporting it back writes Megatron's own tensors under Megatron's own keys; our
exports load through megatron-core's dist_checkpointing into its BertModel, every tensor where
Megatron keeps it, at tensor parallel 1 and 2 (same logits); ours -> Megatron -> ours is
byte-identical. Two models: BERT pretraining (tied output layer, token types, pooler and binary
head) and a masked-LM-only one (untied output layer, no token types, no pooler)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from ckpt_helpers import make_checkpoint, refused

from tessera.ckpt_convert.cli import run
from tessera.common.checkpoint import load_model_tensors, read_sidecar, resolve_checkpoint
from tessera.common.models.encoder.config import EncoderConfig
from tessera.common.models.encoder.model import build_model
from tessera.common.safe_dcp import dcp_load, read_dcp_metadata

HERE = Path(__file__).parent
VOCAB, ROWS_TP2 = 128, 256  # Megatron pads the vocabulary to a multiple of 128 x tensor parallel
MODEL = dict(kind="encoder", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
             max_seq_len=16, norm_placement="pre", norm_eps=1e-5, dropout=0.0, attention_dropout=0.0, init_std=0.2)
CASES = {"pretraining": {},
         "masked-lm-untied": {"tie_embeddings": False, "pooler": False, "binary_head": False, "num_token_types": 0}}


def inputs(cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    """Two rows of 12 tokens, the second with 3 padding tokens; 4 labelled (masked) positions per
    row (label -1 elsewhere, Megatron's convention); two segments; sentence-order targets."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    labels = torch.full((2, 12), -1)
    for row, where in enumerate(([1, 4, 6, 10], [2, 3, 5, 8])):
        labels[row, where] = torch.randint(0, VOCAB, (4,), generator=g)
    types = (torch.arange(12) >= 6).long().expand(2, 12).contiguous()
    return {"tokens": tokens, "attention_mask": mask, "token_types": types, "labels": labels,
            "binary_labels": torch.tensor([0, 1])}


def as_megatron(t: dict[str, torch.Tensor], cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    """Our tensors under the names BertModel's state_dict has (local spec), written out here from
    Megatron's facts: q/k/v fused head by head as [q_h; k_h; v_h]."""
    hd = cfg.head_dim
    out = {"embedding.word_embeddings.weight": t["embed_tokens.weight"],
           "embedding.position_embeddings.weight": t["pos_embed.weight"],
           "encoder.final_layernorm.weight": t["final_norm.weight"], "encoder.final_layernorm.bias": t["final_norm.bias"],
           "lm_head.dense.weight": t["mlm_head.dense.weight"], "lm_head.dense.bias": t["mlm_head.dense.bias"],
           "lm_head.layer_norm.weight": t["mlm_head.norm.weight"], "lm_head.layer_norm.bias": t["mlm_head.norm.bias"],
           "output_layer.bias": t["mlm_head.decoder.bias"]}
    if cfg.num_token_types:
        out["embedding.tokentype_embeddings.weight"] = t["token_type_embed.weight"]
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = t["mlm_head.decoder.weight"]
    if cfg.binary_head:
        out.update({f"{m}.{s}": t[f"{m}.{s}"] for m in ("pooler.dense", "binary_head") for s in ("weight", "bias")})
    names = {"input_layernorm": "attn_norm", "self_attention.linear_proj": "attn.o_proj",
             "pre_mlp_layernorm": "mlp_norm", "mlp.linear_fc1": "mlp.up_proj", "mlp.linear_fc2": "mlp.down_proj"}
    for i in range(cfg.num_layers):
        m, o = f"encoder.layers.{i}.", f"layers.{i}."
        for s in ("weight", "bias"):
            out.update({f"{m}{theirs}.{s}": t[f"{o}{ours}.{s}"] for theirs, ours in names.items()})
            q, k, v = (t[f"{o}attn.{p}_proj.{s}"] for p in "qkv")
            out[f"{m}self_attention.linear_qkv.{s}"] = torch.cat(
                [x[h * hd:(h + 1) * hd] for h in range(cfg.num_heads) for x in (q, k, v)])
    return out


def ours(directory: Path, batch: dict[str, torch.Tensor]):
    """A Tessera checkpoint's encoder outputs on `batch`, and its pretraining loss as the trainer computes it."""
    from tessera.trainer.objectives.documents import IGNORE_INDEX
    from tessera.trainer.objectives.mlm.loss import mlm_loss

    cfg = read_sidecar(directory).model
    model = build_model(cfg, seed=None)
    model.load_state_dict(load_model_tensors(directory))
    types = batch["token_types"] if cfg.num_token_types else None
    with torch.no_grad():
        out = model.eval()(batch["tokens"], token_types=types, attention_mask=batch["attention_mask"])
        labels = batch["labels"].masked_fill(batch["labels"] < 0, IGNORE_INDEX)
        return out, mlm_loss(out, labels, batch["binary_labels"])


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < tol, err
    return err


def test_megatron_bert_checkpoints_import_with_megatrons_logits_and_loss_and_our_exports_load_in_megatron_at_tp1_and_tp2(
        tmp_path):
    pytest.importorskip("megatron.core")
    work = []
    for name, over in CASES.items():
        root, cfg = tmp_path / name, EncoderConfig(**{**MODEL, **over})
        root.mkdir()
        (root / "model.yaml").write_text(yaml.safe_dump(cfg.model_dump()))
        make_checkpoint(root / "ours", cfg, None)
        for tp in (1, 2):
            assert run(["export", "--format", "megatron", "--checkpoint", str(root / "ours"), "--output",
                        str(root / f"tp{tp}" / "iter_0000001"), "--tensor-parallel", str(tp), "--quiet"]) == 0
        torch.save(inputs(cfg), root / "inputs.pt")
        (root / "mcore" / "iter_0000001").mkdir(parents=True)  # dist_checkpointing.save wants it there, empty
        spec = {"seed": len(work), "rows_tp2": ROWS_TP2, "tied": cfg.tie_embeddings, "binary_head": cfg.binary_head,
                **{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                                                "ffn_hidden_size", "max_seq_len", "num_token_types", "norm_eps")}}
        work.append({"spec": spec, "inputs": str(root / "inputs.pt"), "save": str(root / "mcore" / "iter_0000001"),
                     "load_tp1": str(root / "tp1" / "iter_0000001"), "load_tp2": str(root / "tp2" / "iter_0000001")})
    (tmp_path / "work.json").write_text(json.dumps({"cases": work}))
    # Every Megatron-side step, both models, tensor parallel 1 then 2: one launch.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(HERE / "megatron_bert_save.py"), str(tmp_path / "work.json")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, over in CASES.items():
        root, cfg = tmp_path / name, EncoderConfig(**{**MODEL, **over})
        batch, real = torch.load(root / "inputs.pt"), torch.load(root / "inputs.pt")["attention_mask"].bool()
        ref = torch.load(root / "mcore" / "reference.pt")
        # Megatron's checkpoint imports: its tensors where Megatron keeps them, its logits (at the real
        # tokens: Megatron's padded queries attend nowhere) and its loss.
        assert run(["import", "--format", "megatron", "--input", str(root / "mcore" / "iter_0000001"), "--output",
                    str(root / "imported"), "--model-config", str(root / "model.yaml"), "--quiet"]) == 0
        imported = resolve_checkpoint(root / "imported")
        mapped = as_megatron(load_model_tensors(imported), cfg)
        assert mapped.keys() == ref["params"].keys(), name
        for key, tensor in ref["params"].items():
            assert torch.equal(mapped[key], tensor), (name, key)
        out, loss = ours(imported, batch)
        close(out.mlm_logits[real], ref["logits"][real], 2e-6)
        if cfg.binary_head:
            close(out.binary_logits, ref["binary_logits"], 2e-6)
        assert torch.allclose(loss, ref["loss"], rtol=1e-6), (name, loss, ref["loss"])
        # Exported back, it is Megatron's own checkpoint: the same keys (extra state too), equal tensors.
        assert run(["export", "--format", "megatron", "--checkpoint", str(root / "imported"), "--output",
                    str(root / "back" / "iter_0000001"), "--quiet"]) == 0
        theirs, again = (read_dcp_metadata(root / d / "iter_0000001").state_dict_metadata for d in ("mcore", "back"))
        assert theirs.keys() == again.keys(), (name, set(theirs) ^ set(again))
        for key in [k for k, v in theirs.items() if hasattr(v, "size")]:
            a, b = (torch.empty(tuple(theirs[key].size)) for _ in range(2))
            dcp_load({key: a}, root / "mcore" / "iter_0000001", no_dist=True)
            dcp_load({key: b}, root / "back" / "iter_0000001", no_dist=True)
            assert torch.equal(a, b), (name, key)
        # Our export loads into megatron-core's BertModel: every tensor as ours, the same logits; and
        # at tensor parallel 2 (heads, MLP and the padded vocabulary split) its shards give them too.
        mine, _ = ours(resolve_checkpoint(root / "ours"), batch)
        loaded = torch.load(root / "tp1" / "megatron_tp1.pt")
        want = as_megatron(load_model_tensors(resolve_checkpoint(root / "ours")), cfg)
        assert want.keys() == loaded["params"].keys(), name
        for key, tensor in want.items():
            assert torch.equal(loaded["params"][key], tensor), (name, key)
        close(loaded["logits"][real], mine.mlm_logits[real], 2e-6)
        tp2 = torch.load(root / "tp2" / "megatron_tp2.pt")
        assert tp2["logits"].shape[-1] == ROWS_TP2 and not tp2["logits"][..., VOCAB:].any()
        close(tp2["logits"][..., :VOCAB][real], mine.mlm_logits[real], 2e-6)
        # Ours -> Megatron (padded for tensor parallel 2) -> ours: every tensor byte-identical.
        assert run(["import", "--format", "megatron", "--input", str(root / "tp2" / "iter_0000001"), "--output",
                    str(root / "round"), "--model-config", str(root / "model.yaml"), "--quiet"]) == 0
        first, back = (load_model_tensors(resolve_checkpoint(root / d)) for d in ("ours", "round"))
        assert first.keys() == back.keys(), name
        for key, tensor in first.items():
            assert tensor.dtype == back[key].dtype and torch.equal(tensor, back[key]), (name, key)


def test_encoders_megatron_bert_cannot_hold_are_refused_in_one_line_and_a_training_checkpoints_optimizer_is_skipped(
        tmp_path, capsys):
    """Post-LayerNorm BERT (BertModel is pre-LayerNorm), a model without the MLM head, a pooler
    without the binary head, a tensor-parallel size that does not divide the heads, and a config
    whose shapes or heads are not the checkpoint's: exit 2, one line, nothing written. A checkpoint
    with Megatron's optimizer state beside the model imports the model."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "out"
    make_checkpoint(tmp_path / "good", EncoderConfig(**MODEL), None)
    assert run(["export", "--format", "megatron", "--checkpoint", str(tmp_path / "good"), "--output",
                str(tmp_path / "mg"), "--quiet"]) == 0
    for n, (over, words) in enumerate((
            ({"norm_placement": "post"}, ("pre-LayerNorm", "post-LayerNorm", "--format hf")),
            ({"mlm_head": False, "binary_head": False}, ("mlm_head=false",)),
            ({"binary_head": False}, ("pooler=True with binary_head=False",)))):
        cfg = EncoderConfig(**{**MODEL, **over})
        make_checkpoint(tmp_path / f"c{n}", cfg, None)
        err = refused(capsys, ["export", "--format", "megatron", "--checkpoint", str(tmp_path / f"c{n}"),
                                "--output", str(out)])
        assert all(w in err for w in words), err
        (tmp_path / "m.yaml").write_text(yaml.safe_dump(cfg.model_dump()))
        err = refused(capsys, ["import", "--format", "megatron", "--input", str(tmp_path / "mg"), "--output",
                                str(out), "--model-config", str(tmp_path / "m.yaml")])
        assert all(w in err for w in words) and "--model-config" in err, err
    err = refused(capsys, ["export", "--format", "megatron", "--checkpoint", str(tmp_path / "good"), "--output",
                            str(out), "--tensor-parallel", "3"])
    assert "--tensor-parallel 3" in err and "num_heads (4)" in err, err
    # A Megatron-LM training checkpoint holds its optimizer's state beside the model (Megatron's
    # `optimizer.state.<kind>.<the model tensor's key>`): the model imports, the optimizer is not read.
    with_optimizer = tmp_path / "trained" / "iter_0000001"
    meta = read_dcp_metadata(tmp_path / "mg").state_dict_metadata
    state = {k: torch.empty(tuple(v.size)) for k, v in meta.items() if hasattr(v, "size")}
    dcp_load(state, tmp_path / "mg", no_dist=True)
    dcp.save({**state, "optimizer.state.exp_avg.encoder.layers.mlp.linear_fc1.weight": torch.ones(2, 64, 32)},
             checkpoint_id=str(with_optimizer), no_dist=True)
    (with_optimizer / "metadata.json").write_text((tmp_path / "mg" / "metadata.json").read_text())
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(MODEL))
    assert run(["import", "--format", "megatron", "--input", str(with_optimizer), "--output", str(tmp_path / "in"),
                "--model-config", str(tmp_path / "m.yaml"), "--quiet"]) == 0
    first, back = (load_model_tensors(resolve_checkpoint(tmp_path / d)) for d in ("good", "in"))
    assert first.keys() == back.keys() and all(torch.equal(t, back[k]) for k, t in first.items())
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({**MODEL, "ffn_hidden_size": 96}))
    err = refused(capsys, ["import", "--format", "megatron", "--input", str(tmp_path / "mg"), "--output", str(out),
                            "--model-config", str(tmp_path / "m.yaml")])
    assert "encoder.layers.mlp.linear_fc1.weight" in err and "--model-config" in err, err
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({**MODEL, "binary_head": False, "pooler": False}))
    err = refused(capsys, ["import", "--format", "megatron", "--input", str(tmp_path / "mg"), "--output", str(out),
                            "--model-config", str(tmp_path / "m.yaml")])
    assert "binary_head" in err or "pooler" in err, err
    assert not out.exists()
