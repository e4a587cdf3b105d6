"""`tessera-ckpt export --format megatron`: a Tessera checkpoint -> a Megatron-Core `torch_dist` checkpoint.

Causal LMs become GPTModel checkpoints (below; with multi-latent attention and MoE, DeepSeek-V3's:
megatron_mla.py); hybrid models MambaModel ones (megatron_hybrid.py); pre-LayerNorm encoders
BertModel ones (megatron_bert.py).

The inverse of import_megatron (names and layouts there): global tensors with layers stacked along
a leading axis, fused QKV in Megatron's grouped order, fused [gate; up] for SwiGLU, plus
`metadata.json` (`sharded_backend: torch_dist`) and an empty `common.pt` (megatron-core reads
both). Because torch_dist stores global tensors, one export loads at any tensor/pipeline layout;
the only layout-dependent part is Megatron's vocabulary padding, so the embedding and output
layer get the rows Megatron computes for `--tensor-parallel T` (vocab_size rounded up to
vocab_size_divisible_by x T; padding rows zero). The `_extra_state` entries Megatron's linear
layers keep are written as `[None]` per layer (what its local, non-Transformer-Engine layers write).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from tessera.ckpt_convert.dcp_writer import ShardedDcpWriter, whole
from tessera.ckpt_convert.exporters import megatron_bert, megatron_hybrid, megatron_mla
from tessera.ckpt_convert.exporters.hf import expected_model_shapes
from tessera.ckpt_convert.importers.megatron import is_torch_dist_checkpoint
from tessera.ckpt_convert.kinds import check_convertible
from tessera.ckpt_convert.progress import Progress
from tessera.ckpt_convert.source import CheckpointSource
from tessera.common.errors import UserError
from tessera.common.fileio import atomic_directory, check_output_directory
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.encoder.config import EncoderConfig
from tessera.common.models.hybrid.config import HybridConfig


def tessera_to_megatron(cfg: ModelConfig, t: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Megatron-Core tensors (global, layers stacked) from Tessera parameters `t`."""
    if cfg.moe is not None or cfg.qk_norm or cfg.sliding_window is not None or cfg.mla is not None:
        raise UserError("model config: MoE, qk_norm, sliding-window and multi-head latent attention (model.mla) models "
                        "have no Megatron-Core GPT mapping here")

    def vocab(w: torch.Tensor) -> torch.Tensor:
        real = w[:cfg.vocab_size]
        return torch.cat([real, real.new_zeros(rows - cfg.vocab_size, *real.shape[1:])])

    out = {"embedding.word_embeddings.weight": vocab(t["embed_tokens.weight"])}
    if cfg.position == "learned":
        out["embedding.position_embeddings.weight"] = t["pos_embed.weight"]
    L, hd, per_group = cfg.num_layers, cfg.head_dim, cfg.num_heads // cfg.kv_heads
    layer = "decoder.layers."

    def stack(fn) -> torch.Tensor:
        return torch.stack([fn(f"layers.{i}.") for i in range(L)])

    for suffix in ("weight", "bias"):
        if f"layers.0.attn_norm.{suffix}" in t:
            out[layer + "self_attention.linear_qkv.layer_norm_" + suffix] = stack(lambda p, suffix=suffix: t[p + "attn_norm." + suffix])
            out[layer + "mlp.linear_fc1.layer_norm_" + suffix] = stack(lambda p, suffix=suffix: t[p + "mlp_norm." + suffix])
        if f"layers.0.attn.q_proj.{suffix}" in t:
            def qkv(p: str, suffix: str = suffix) -> torch.Tensor:
                fuse = megatron_hybrid.fuse_qkv(cfg.kv_heads, per_group, hd)
                return fuse([t[p + f"attn.{n}_proj." + suffix] for n in "qkv"])
            out[layer + "self_attention.linear_qkv." + suffix] = stack(qkv)
        if f"layers.0.attn.o_proj.{suffix}" in t:
            out[layer + "self_attention.linear_proj." + suffix] = stack(lambda p, suffix=suffix: t[p + "attn.o_proj." + suffix])
        if f"layers.0.mlp.up_proj.{suffix}" in t:
            if cfg.activation == "swiglu":
                fc1 = stack(lambda p, suffix=suffix: torch.cat([t[p + "mlp.gate_proj." + suffix], t[p + "mlp.up_proj." + suffix]]))
            else:
                fc1 = stack(lambda p, suffix=suffix: t[p + "mlp.up_proj." + suffix])
            out[layer + "mlp.linear_fc1." + suffix] = fc1
            out[layer + "mlp.linear_fc2." + suffix] = stack(lambda p, suffix=suffix: t[p + "mlp.down_proj." + suffix])
        if f"final_norm.{suffix}" in t:
            out["decoder.final_layernorm." + suffix] = t["final_norm." + suffix]
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = vocab(t["lm_head.weight"])
    return out


def check_tensor_parallel(cfg: ModelConfig | HybridConfig | EncoderConfig, tp: int) -> None:
    """Megatron splits heads, query groups and MLP widths across tensor ranks (its `divide` asserts):
    a size `tp` does not divide cannot be loaded there, so say which field before writing."""
    moe = cfg.moe
    widths = {"num_heads": cfg.num_heads, "ffn_hidden_size": cfg.ffn_hidden_size,
              "moe.ffn_hidden_size": moe.ffn_hidden_size if moe else None,
              "moe shared expert width": moe.shared_size if moe else None}
    if getattr(cfg, "mla", None) is None:
        widths["num_kv_heads"] = cfg.kv_heads
    mamba = getattr(cfg, "mamba", None)
    if mamba is not None:  # MambaMixer splits its heads and B/C groups
        widths.update({"mamba.num_heads": mamba.num_heads, "mamba.num_groups": mamba.num_groups})
    for field, n in widths.items():
        if n and n % tp:
            raise UserError(f"--tensor-parallel {tp} does not divide the model's {field} ({n}); Megatron splits it "
                            "across tensor ranks: choose a tensor-parallel size that divides it")


def export_megatron(checkpoint: str | Path, output: str | Path, tp: int = 1, dtype: torch.dtype | None = None,
                    overwrite: bool = False, quiet: bool = False, sync: bool = True) -> Path:
    src = CheckpointSource(checkpoint)
    output = Path(output)
    check_output_directory(output, overwrite, [src.directory], "Megatron-Core torch_dist checkpoint (metadata.json)",
                           is_torch_dist_checkpoint)
    cfg = src.sidecar.model
    check_convertible(cfg, "export --format megatron")
    if cfg.kind == "encoder":
        megatron_bert.check_megatron(cfg, f"{checkpoint}: model config")
    check_tensor_parallel(cfg, tp)
    shapes = expected_model_shapes(cfg)
    if isinstance(cfg, HybridConfig):  # Megatron's MambaModel: one entry per layer (megatron_hybrid)
        rows = megatron_hybrid.padded_rows(cfg, tp)
        rules = megatron_hybrid.export_rules(cfg, shapes, rows)
        loaded = src.load_model(list(shapes))
        tensors = {r.target: r.apply([loaded[s] for s in r.sources]) for r in rules}
        extra_state = megatron_hybrid.extra_state_keys(cfg)
    elif cfg.kind == "encoder" or cfg.mla is not None:  # BertModel; DeepSeek-V3-class GPTModel (megatron_mla)
        rows = cfg.padded_for(tp).vocab_rows
        if cfg.kind == "encoder":
            rules, extra_state = megatron_bert.export_rules(cfg, rows), megatron_bert.extra_state_keys(cfg)
        else:
            megatron_mla.check_megatron(cfg)
            rules, extra_state = megatron_mla.export_rules(cfg, rows), megatron_mla.extra_state_keys(cfg)
        unread = sorted(set(src.model_specs) - {s for r in rules for s in r.sources})
        if unread:  # a tensor no rule reads would be dropped: never silently
            raise UserError(f"{checkpoint}: {unread[0]} has no Megatron-Core mapping ({len(unread)} such tensors)")
        loaded = src.load_model(sorted({s for r in rules for s in r.sources}))
        tensors = {r.target: r.apply([loaded[s] for s in r.sources]) for r in rules}
    else:
        rows = cfg.padded_for(tp).vocab_rows  # Megatron's padded vocabulary at --tensor-parallel T
        tensors = tessera_to_megatron(cfg, src.load_model(list(shapes)), rows)
        extra_state = [f"decoder.layers.{module}._extra_state/shard_{i}_{cfg.num_layers}"
                       for i in range(cfg.num_layers) for module in megatron_hybrid.EXTRA_STATE_MODULES]
    none = io.BytesIO()
    torch.save([None], none)  # what megatron-core writes for a local layer's extra state (a one-shard list)
    with src.checksum_check() as checksums, atomic_directory(output, overwrite=overwrite, sync=sync) as tmp, \
            Progress(sum(t.numel() * t.element_size() for t in tensors.values()), len(tensors),
                     f"export megatron -> {output.name}", quiet) as bar:
        writer = ShardedDcpWriter(tmp, 1, sync=sync)
        try:
            for key, tensor in tensors.items():
                writer.write_tensor(key, tensor, whole(tuple(tensor.shape)), dtype=dtype)
                bar.update(tensor.numel() * tensor.element_size())
            for key in extra_state:
                writer.write_bytes(key, none.getvalue())
        except BaseException:
            writer.abort()
            raise
        writer.planner_data = None  # none, as megatron-core writes it: its loader maps keys itself
        writer.close()
        torch.save({}, tmp / "common.pt")
        (tmp / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
        checksums.wait()
    return output
