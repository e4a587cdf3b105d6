"""`tessera-ckpt import --format megatron`: a Megatron-Core `torch_dist` checkpoint -> a Tessera checkpoint.

GPTModel checkpoints (names below) become causal LMs; hybrid MambaModel ones (`--model-config` of
kind hybrid; names in exporters/megatron_hybrid.py) hybrid models; BertModel ones (kind encoder,
norm_placement pre; names in exporters/megatron_bert.py) encoders.

Megatron-Core's distributed checkpoint (`metadata.json` says `sharded_backend: torch_dist`) is a
torch.distributed.checkpoint directory of global tensors, so the tensor-parallel and pipeline
layout it was saved from does not matter here. Layers are stacked along a leading layer axis
(`decoder.layers.<module>` of shape [L, ...]). Names and layouts (GPTModel, local or Transformer
Engine layer spec, which store the same keys):

    embedding.word_embeddings.weight                         embed_tokens.weight  (rows: Megatron's padded vocab)
    embedding.position_embeddings.weight                     pos_embed.weight     (learned positions)
    decoder.layers.self_attention.linear_qkv.layer_norm_{weight,bias}  layers.i.attn_norm
    decoder.layers.self_attention.linear_qkv.{weight,bias}   q/k/v_proj: rows grouped per query group g
                                                             as [q heads of g | k_g | v_g], head_dim each
    decoder.layers.self_attention.linear_proj.{weight,bias}  o_proj
    decoder.layers.mlp.linear_fc1.layer_norm_{weight,bias}   layers.i.mlp_norm
    decoder.layers.mlp.linear_fc1.{weight,bias}              SwiGLU: [gate; up] (stored in that global order
                                                             whatever the TP size); GELU: up_proj
    decoder.layers.mlp.linear_fc2.{weight,bias}              down_proj
    decoder.final_layernorm.{weight,bias}                    final_norm
    output_layer.weight                                      lm_head.weight (absent when tied)

A torch_dist checkpoint has no model description Tessera can read without unpickling
(`common.pt` is a torch pickle; it is never opened), so the model is given as a ModelConfig file
(`--model-config`, YAML or JSON: the shapes must match the tensors, which is checked). The index
(`.metadata`) is read by the restricted unpickler of tessera.common.safe_dcp. Legacy
`mp_rank_XX/model_optim_rng.pt` checkpoints are whole pickles and are refused with a line saying
how to convert them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from tessera.ckpt_convert.dcp_writer import write_imported_checkpoint
from tessera.ckpt_convert.exporters import megatron_bert, megatron_hybrid, megatron_mla
from tessera.ckpt_convert.kinds import check_convertible
from tessera.ckpt_convert.progress import Progress
from tessera.common.checkpoint import CHECKPOINT_KIND, is_checkpoint_output
from tessera.common.errors import ArtifactError, UserError
from tessera.common.fileio import (
    artifact_path,
    atomic_directory,
    check_output_directory,
    holds_only,
)
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.encoder.config import EncoderConfig
from tessera.common.models.hybrid.config import HybridConfig
from tessera.common.models.registry import DEFAULT_KIND, model_kind
from tessera.common.safe_dcp import dcp_load, read_dcp_metadata
from tessera.common.tokenizer import check_tokenizer_fits, load_tokenizer

LEGACY_HINT = ("legacy Megatron checkpoints (mp_rank_XX/model_optim_rng.pt) are pickles, which Tessera never loads; "
               "convert it to torch_dist with Megatron-LM (load it with --ckpt-format torch --ckpt-convert-format "
               "torch_dist --ckpt-convert-save DIR) and import DIR")


def check_torch_dist(directory: Path) -> None:
    if any(directory.glob("mp_rank_*")) or any(directory.glob("*/mp_rank_*")):
        raise ArtifactError(f"{directory}: {LEGACY_HINT}")
    meta = artifact_path(directory, "metadata.json")
    if not meta.is_file():
        raise ArtifactError(f"{directory}: no metadata.json; not a Megatron-Core distributed checkpoint (give the "
                            "iter_NNNNNNN directory)")
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except (ValueError, AttributeError):
        raise ArtifactError(f"{meta}: not valid JSON") from None
    if backend != "torch_dist":
        raise ArtifactError(f"{meta}: sharded_backend {backend!r}; only torch_dist checkpoints are read")


def is_torch_dist_checkpoint(path: Path) -> bool:
    """A metadata.json naming the torch_dist backend, beside nothing but DCP's files and common.pt:
    what `export --format megatron` writes, so what its --overwrite may replace."""
    try:
        is_torch_dist = json.loads((path / "metadata.json").read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False
    return is_torch_dist and holds_only(path, lambda name: name in ("metadata.json", "common.pt", ".metadata")
                                        or name.endswith(".distcp"))


def megatron_to_tessera(cfg: ModelConfig, get) -> dict[str, torch.Tensor]:
    """Tessera parameters from Megatron tensors (`get(name)` -> global tensor, None when absent)."""
    out: dict[str, torch.Tensor] = {"embed_tokens.weight": get("embedding.word_embeddings.weight")}
    if cfg.position == "learned":
        out["pos_embed.weight"] = get("embedding.position_embeddings.weight")
    L, hd = cfg.num_layers, cfg.head_dim
    per_group = cfg.num_heads // cfg.kv_heads
    f = cfg.ffn_hidden_size
    layer = "decoder.layers."
    names = {"attn_norm": "self_attention.linear_qkv.layer_norm_", "mlp_norm": "mlp.linear_fc1.layer_norm_"}
    stacked = {}
    for suffix in ("weight", "bias"):
        for ours, theirs in names.items():
            stacked[f"{ours}.{suffix}"] = get(layer + theirs + suffix)
        stacked[f"qkv.{suffix}"] = get(layer + "self_attention.linear_qkv." + suffix)
        stacked[f"o.{suffix}"] = get(layer + "self_attention.linear_proj." + suffix)
        stacked[f"fc1.{suffix}"] = get(layer + "mlp.linear_fc1." + suffix)
        stacked[f"fc2.{suffix}"] = get(layer + "mlp.linear_fc2." + suffix)
    for i in range(L):
        t = f"layers.{i}."
        for suffix in ("weight", "bias"):
            for ours in ("attn_norm", "mlp_norm"):
                if stacked[f"{ours}.{suffix}"] is not None:
                    out[t + f"{ours}.{suffix}"] = stacked[f"{ours}.{suffix}"][i]
            qkv = stacked[f"qkv.{suffix}"]
            if qkv is not None:
                for part, name in enumerate("qkv"):
                    split = megatron_hybrid.split_qkv(cfg.kv_heads, per_group, hd, part)
                    out[t + f"attn.{name}_proj.{suffix}"] = split([qkv[i]])
            if stacked[f"o.{suffix}"] is not None:
                out[t + f"attn.o_proj.{suffix}"] = stacked[f"o.{suffix}"][i]
            fc1 = stacked[f"fc1.{suffix}"]
            if fc1 is not None:
                if cfg.activation == "swiglu":
                    out[t + f"mlp.gate_proj.{suffix}"], out[t + f"mlp.up_proj.{suffix}"] = fc1[i][:f], fc1[i][f:]
                else:
                    out[t + f"mlp.up_proj.{suffix}"] = fc1[i]
            if stacked[f"fc2.{suffix}"] is not None:
                out[t + f"mlp.down_proj.{suffix}"] = stacked[f"fc2.{suffix}"][i]
    for suffix in ("weight", "bias"):
        norm = get("decoder.final_layernorm." + suffix)
        if norm is not None:
            out["final_norm." + suffix] = norm
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("output_layer.weight")
    return out


def _load_model_config(path: str | Path) -> Any:
    """--model-config as the config of the kind it names (`kind` absent: causal_lm)."""
    from tessera.common.config import load_config, read_yaml

    data = read_yaml(path)
    kind = model_kind(data.get("kind", DEFAULT_KIND) if isinstance(data, dict) else DEFAULT_KIND,
                      f"--model-config {path}: kind")
    return load_config(kind.config, path)


def _rules_tensors(cfg: Any, rules: list, input_dir: Path, specs: dict[str, Any], what: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors through import `rules`: every tensor they read present with its shape,
    and no other, before any is read. `what` names the config fields a mismatch points at."""
    for rule in rules:
        for name, want in zip(rule.sources, rule.input_shapes()):
            if name not in specs:
                raise ArtifactError(f"{input_dir}: no Megatron tensor {name} (the --model-config describes a model "
                                    f"this checkpoint is not: {what})")
            if tuple(specs[name].size) != want:
                raise ArtifactError(f"{input_dir}: {name} has shape {list(specs[name].size)} but --model-config "
                                    f"implies {list(want)}; fix the config ({what})")
    extra = sorted(set(specs) - {s for r in rules for s in r.sources})
    if extra:
        raise ArtifactError(f"{input_dir}: {extra[0]} is in the checkpoint but not in the --model-config's model "
                            f"({len(extra)} such; {what})")
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in specs.items()}
    dcp_load(state, input_dir, no_dist=True)
    return {r.target: r.apply([state[s] for s in r.sources]) for r in rules}


def _hybrid_tensors(cfg: HybridConfig, input_dir: Path, specs: dict[str, Any], rows: int) -> dict[str, torch.Tensor]:
    """A MambaModel checkpoint's tensors as the hybrid model's (names and layouts: megatron_hybrid)."""
    from tessera.ckpt_convert.exporters.hf import expected_model_shapes

    megatron_hybrid.check_megatron(cfg, f"--model-config (model kind {cfg.kind})")
    rules = megatron_hybrid.import_rules(cfg, expected_model_shapes(cfg), rows)
    return _rules_tensors(cfg, rules, input_dir, specs, f"pattern {cfg.pattern!r}, biases or shared experts differ")


def _mla_tensors(cfg: ModelConfig, input_dir: Path, specs: dict[str, Any], rows: int) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-class GPTModel checkpoint's tensors (names and layouts: megatron_mla); a norm
    absent under its Transformer Engine name is read under Megatron's local-spec name."""
    megatron_mla.check_megatron(cfg, where="--model-config")

    def stored(name: str) -> str:
        for te, local in megatron_mla.LOCAL_NAMES.items():
            if name not in specs and name.endswith(te) and name.replace(te, local) in specs:
                return name.replace(te, local)
        return name

    rules = [dataclasses.replace(r, sources=tuple(stored(s) for s in r.sources))
             for r in megatron_mla.import_rules(cfg, rows, "decoder.layers.input_layernorm.weight" in specs)]
    return _rules_tensors(cfg, rules, input_dir, specs, "mla ranks and head dims, moe experts, first_k_dense, "
                          "mtp depth")


def _bert_tensors(cfg: EncoderConfig, input_dir: Path, specs: dict[str, Any], rows: int) -> dict[str, torch.Tensor]:
    """A BertModel checkpoint's tensors as the pre-LayerNorm encoder's (names and layouts: megatron_bert)."""
    return _rules_tensors(cfg, megatron_bert.import_rules(cfg, rows), input_dir, specs,
                          "heads, token types, learned positions, a tied output layer or the binary head differ")


def import_megatron(input_dir: str | Path, output: str | Path, model_config: str | Path,
                    tokenizer: str | Path | None = None, dtype: torch.dtype | None = None, overwrite: bool = False,
                    quiet: bool = False, sync: bool = True) -> Path:
    from tessera.ckpt_convert.exporters.hf import expected_model_shapes

    input_dir, output = Path(input_dir), Path(output)
    if not input_dir.is_dir():
        raise UserError(f"{input_dir}: input directory not found")
    check_output_directory(output, overwrite, [input_dir] + ([tokenizer] if tokenizer else []), CHECKPOINT_KIND,
                           is_checkpoint_output)
    check_torch_dist(input_dir)
    cfg = model_config if isinstance(model_config, BaseModel) else _load_model_config(model_config)
    check_convertible(cfg, "import --format megatron")
    if cfg.kind == "encoder":
        megatron_bert.check_megatron(cfg, f"--model-config {model_config}")
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if tok is not None:
        check_tokenizer_fits(tok, cfg.vocab_size, f"--model-config {model_config}")
    metadata = read_dcp_metadata(input_dir)  # restricted unpickler: refuses anything but DCP's index classes
    # A Megatron-LM training checkpoint also holds its optimizer's state (`optimizer.state.*`,
    # `optimizer.distributed.*`): not the model's, never read.
    specs = {k: v for k, v in metadata.state_dict_metadata.items()
             if hasattr(v, "size") and not k.startswith("optimizer.")}
    rows = specs["embedding.word_embeddings.weight"].size[0] if "embedding.word_embeddings.weight" in specs else None
    if rows is None:
        raise ArtifactError(f"{input_dir}: no embedding.word_embeddings.weight; not a Megatron-Core GPT, Mamba or "
                            "BERT checkpoint")
    if rows < cfg.vocab_size:
        raise UserError(f"--model-config: vocab_size {cfg.vocab_size} exceeds the checkpoint's {rows} embedding rows")
    by_rules = (_bert_tensors if cfg.kind == "encoder" else _hybrid_tensors if isinstance(cfg, HybridConfig)
                else _mla_tensors if getattr(cfg, "mla", None) is not None else None)
    if by_rules is not None:  # one rule per tensor (megatron_bert, megatron_hybrid, megatron_mla)
        tensors = by_rules(cfg, input_dir, specs, rows)
        out_dtype = dtype or tensors["embed_tokens.weight"].dtype
        with atomic_directory(output, overwrite=overwrite, sync=sync) as tmp, \
                Progress(sum(t.numel() for t in tensors.values()) * out_dtype.itemsize, len(tensors),
                         f"import megatron -> {output.name}", quiet) as bar:
            write_imported_checkpoint(tmp, iter(tensors.items()), cfg, tok, out_dtype,
                                      {"path": str(input_dir.resolve()), "format": "megatron"}, bar, sync)
        return output
    cfg = cfg.model_copy(update={"padded_vocab_size": rows if rows > cfg.vocab_size else None})  # Megatron's padding
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in specs.items()}
    dcp_load(state, input_dir, no_dist=True)
    tensors = megatron_to_tessera(cfg, state.get)
    expected = expected_model_shapes(cfg)
    for name, shape in expected.items():
        got = tensors.get(name)
        if got is None:
            raise ArtifactError(f"{input_dir}: no Megatron tensor for {name} (the --model-config describes a model "
                                "this checkpoint is not)")
        if tuple(got.shape) != shape:
            raise ArtifactError(f"{input_dir}: {name} has shape {list(got.shape)} but --model-config implies "
                                f"{list(shape)}; fix the config (heads, kv heads, sizes)")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ArtifactError(f"{input_dir}: {extra[0]} is in the checkpoint but not in the --model-config's model "
                            "(bias or norm flags differ)")
    if cfg.vocab_rows > cfg.vocab_size:
        for name in ("embed_tokens.weight", "lm_head.weight"):
            if name in tensors:  # Megatron's padding rows are never used (logits -inf): stored as zeros
                tensors[name] = tensors[name].clone()
                tensors[name][cfg.vocab_size:] = 0
    out_dtype = dtype or tensors["embed_tokens.weight"].dtype
    with atomic_directory(output, overwrite=overwrite, sync=sync) as tmp, \
            Progress(sum(t.numel() for t in tensors.values()) * out_dtype.itemsize, len(tensors),
                     f"import megatron -> {output.name}", quiet) as bar:
        write_imported_checkpoint(tmp, ((name, tensors[name]) for name in expected), cfg, tok, out_dtype,
                                  {"path": str(input_dir.resolve()), "format": "megatron"}, bar, sync)
    return output
