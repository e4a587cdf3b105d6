"""Which rank of a parallel layout owns which block of each global tensor.

This is the contract `reshard` writes to (docs/formats/checkpoint.md, "Partitioned payloads"):

- Rank order: tensor fastest, then expert, data, pipeline (context is 1 here), i.e.
  rank = tp + T * (ep + E * (dp + D * pp)).
- Pipeline: the trainer's rule (tessera.common.layout): the L layers form S = P x V consecutive
  stages of `layout.stage_layers(L)` layers (the explicit `pipeline_layers` split, else as even as
  possible with the extra layers in the middle stages); stage s lives on pipeline rank s mod P
  (interleaved schedule; V = 1 is plain contiguous stages). The embedding (and learned positions)
  live on the first stage, the final norm and lm_head on the last; a tied head is stored once,
  with the embedding.
- Tensor parallel: column-parallel weights and biases (q/k/v, gate/up; the vocab-parallel
  embedding and lm_head) split along dim 0; row-parallel weights (o_proj, down_proj) along dim 1;
  norms, row-parallel biases and learned positions are replicated and stored by tp rank 0.
- The encoder (BERT) likewise: its token-type embedding and embedding norm live with the
  embedding on the first stage, its heads (pooler, MLM, binary) on the last; the MLM decoder's
  bias (and its weight when untied) is split by vocabulary rows like the embedding.
- Expert parallel: an MoE layer's stacked experts (`mlp.experts.*`, [num_experts, ...]) split
  along dim 0 over the E expert ranks (experts are not tensor-split: tp rank 0 stores them);
  every other tensor is replicated over expert ranks and stored by ep rank 0.
- Hybrid models (kind hybrid), as their parallel plan (common/models/hybrid/parallelize.py) and
  Megatron's MambaMixer split them: a Mamba-2 mixer's in_proj.{z,x,b,c,dt} (rows: whole heads and
  groups), conv.{x,b,c} weights and biases, dt_bias, A_log, D and its gated norm's weight along
  dim 0, out_proj's weight along dim 1; attention's q/k/v and o, the MLPs' up and down as the
  causal LM's (all under `mixer.`); an MoE layer's stacked experts (`mixer.experts.*`) over the
  expert ranks; everything else (layer norms, router, shared experts) replicated.
- The encoder-decoder (T5) likewise within both stacks' blocks (self- and cross-attention, MLP);
  its relative-bias tables split by heads (dim 1), its shared embedding and own head by rows.
- The vision-language kind (LLaVA) likewise: the tower's blocks (`vision.layers.N.`) split as the
  causal LM's, the projector's linear_1 by rows and linear_2 by columns, the language model as the
  causal LM under `language_model.`; the tower, projector and text embedding on the first stage,
  the language model's layers cut by the pipeline, its final norm and head on the last.
- Data parallel: model tensors are replicas, stored by dp rank 0. Optimizer state of a parameter
  takes the parameter's block and is further split along dim 0 across its replicas, as the
  distributed optimizer shards it (expert weights over the D data ranks, every other parameter
  over the D x E data x expert ranks), when that dimension divides; otherwise the block's owner
  keeps it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tessera.ckpt_convert.dcp_writer import Chunk
from tessera.common.layout import ParallelLayout
from tessera.common.models.registry import kind_of

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
# Split by vocabulary rows (the encoder's MLM decoder: its bias too) and kept by the first stage.
_VOCAB = ("embed_tokens.weight", "lm_head.weight", "mlm_head.decoder.weight", "mlm_head.decoder.bias")
_FIRST_STAGE = ("embed_tokens.", "pos_embed.", "token_type_embed.", "embed_norm.")


@dataclass(frozen=True)
class _TensorSplit:
    """One kind's tensor-parallel split by name within a layer: `column` prefixes and `rows` exact
    names go along dim 0, `row` exact names along dim 1; `experts` matches the stacked experts."""

    column: tuple[str, ...]
    row: tuple[str, ...]
    experts: re.Pattern
    rows: tuple[str, ...] = ()
    layer: re.Pattern = _LAYER_RE  # the prefix of a block's names, stripped before matching
    # The layers pipeline stages cut (group 1: the global layer number) and the name prefixes the
    # first stage keeps beside them; everything else not in a layer lives on the last stage.
    stage_layer: re.Pattern = _LAYER_RE
    first_stage: tuple[str, ...] = _FIRST_STAGE


_SPLITS = {  # by model kind (the `kind` of its config)
    "causal_lm": _TensorSplit(
        column=("attn.q_proj.", "attn.k_proj.", "attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.",
                "attn.q_b_proj.", "attn.kv_b_proj."),  # latent attention's up projections, by heads
        row=("attn.o_proj.weight", "mlp.down_proj.weight"),
        experts=re.compile(r"^(mtp\.)?layers\.\d+\.mlp\.experts\.")),  # mtp: DeepSeek's MTP depths
    "hybrid": _TensorSplit(
        column=("mixer.in_proj.", "mixer.conv.", "mixer.q_proj.", "mixer.k_proj.", "mixer.v_proj.", "mixer.up_proj."),
        row=("mixer.out_proj.weight", "mixer.o_proj.weight", "mixer.down_proj.weight"),
        experts=re.compile(r"^layers\.\d+\.mixer\.experts\."),
        rows=("mixer.dt_bias", "mixer.A_log", "mixer.D", "mixer.norm.weight")),
    "encoder": _TensorSplit(  # BERT: the causal LM's names (its MLP has no gate)
        column=("attn.q_proj.", "attn.k_proj.", "attn.v_proj.", "mlp.up_proj."),
        row=("attn.o_proj.weight", "mlp.down_proj.weight"),
        experts=re.compile(r"^layers\.\d+\.mlp\.experts\.")),
    "encoder_decoder": _TensorSplit(  # T5: both stacks' blocks; relative-bias tables split by heads
        column=tuple(f"{a}.{p}_proj." for a in ("self_attn", "cross_attn") for p in "qkv") + ("mlp.gate_proj.", "mlp.up_proj."),
        row=("self_attn.o_proj.weight", "cross_attn.o_proj.weight", "mlp.down_proj.weight",
             "encoder.relative_attention_bias.weight", "decoder.relative_attention_bias.weight"),
        experts=re.compile(r"^$"), layer=re.compile(r"^(encoder|decoder)\.blocks\.\d+\.")),
    "vision_language": _TensorSplit(  # LLaVA: tower and LM blocks as the causal LM's; projector column then row
        column=("attn.q_proj.", "attn.k_proj.", "attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.", "projector.linear_1."),
        row=("attn.o_proj.weight", "mlp.down_proj.weight", "projector.linear_2.weight"),
        experts=re.compile(r"^language_model\.layers\.\d+\.mlp\.experts\."),
        layer=re.compile(r"^(vision|language_model)\.layers\.\d+\."),
        stage_layer=re.compile(r"^language_model\.layers\.(\d+)\."),
        first_stage=("vision.", "projector.", "language_model.embed_tokens.", "language_model.pos_embed.")),
}


def _kind_vocab(cfg: Any) -> tuple[str, ...]:
    return kind_of(cfg).vocab_params


def _split_of(cfg: Any) -> _TensorSplit:
    return _SPLITS[getattr(cfg, "kind", "causal_lm")]


def rank_of(layout: ParallelLayout, tp: int, dp: int, pp: int, ep: int = 0) -> int:
    return tp + layout.tensor * (ep + layout.expert * (dp + layout.data * pp))


def is_expert(name: str, cfg: Any) -> bool:
    """An MoE layer's stacked expert weights (split over expert-parallel ranks along dim 0)."""
    return bool(_split_of(cfg).experts.match(name))


def pipeline_rank(name: str, cfg: Any, layout: ParallelLayout) -> int:
    split = _split_of(cfg)
    m = split.stage_layer.match(name)
    if m:
        return layout.stage_of_layer(int(m.group(1)), cfg.num_layers) % layout.pipeline
    if name.startswith(split.first_stage):
        return 0
    return layout.pipeline - 1  # final_norm, lm_head; the encoder's heads


def tp_dim(name: str, cfg: Any) -> int | None:
    """Dimension split across tensor-parallel ranks, or None when replicated."""
    split = _split_of(cfg)
    local = split.layer.sub("", name.removeprefix("mtp."))  # an MTP depth splits as a layer (last stage)
    if local.startswith(split.column) or local in split.rows or name in _VOCAB or name in _kind_vocab(cfg):
        return 0
    if local in split.row:
        return 1
    return None


def _split(offsets: tuple[int, ...], sizes: tuple[int, ...], dim: int, n: int, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    step = sizes[dim] // n
    return (offsets[:dim] + (offsets[dim] + i * step,) + offsets[dim + 1:],
            sizes[:dim] + (step,) + sizes[dim + 1:])


def model_chunks(name: str, shape: tuple[int, ...], cfg: Any, layout: ParallelLayout) -> list[Chunk]:
    pp = pipeline_rank(name, cfg, layout)
    dim = tp_dim(name, cfg)
    zero = (0,) * len(shape)
    if is_expert(name, cfg):
        return [Chunk(rank_of(layout, 0, 0, pp, ep), *_split(zero, tuple(shape), 0, layout.expert, ep))
                for ep in range(layout.expert)]
    if dim is None or layout.tensor == 1:
        return [Chunk(rank_of(layout, 0, 0, pp), zero, tuple(shape))]
    return [Chunk(rank_of(layout, tp, 0, pp), *_split(zero, tuple(shape), dim, layout.tensor, tp))
            for tp in range(layout.tensor)]


def state_chunks(param: str, shape: tuple[int, ...], cfg: Any, layout: ParallelLayout) -> list[Chunk]:
    """Optimizer state shaped like `param`: the parameter's blocks, split over its replicas (data
    ranks for expert weights, data x expert ranks for the rest)."""
    chunks = model_chunks(param, shape, cfg, layout)
    expert = is_expert(param, cfg)
    d, e = layout.data, layout.expert
    n = d if expert else d * e
    if n == 1 or not shape or chunks[0].sizes[0] % n:
        return chunks
    out = []
    for c in chunks:
        tp = c.rank % layout.tensor
        ep = (c.rank // layout.tensor) % e
        pp = c.rank // (layout.tensor * e * d)
        for i in range(n):
            offs, sizes = _split(c.offsets, c.sizes, 0, n, i)
            dp, rep_ep = (i, ep) if expert else divmod(i, e)
            out.append(Chunk(rank_of(layout, tp, dp, pp, rep_ep), offs, sizes))
    return out


def match_param(key: str, shapes: dict[str, tuple[int, ...]], shape: tuple[int, ...]) -> str | None:
    """The model parameter a training-state tensor belongs to: its name appears as a dotted
    component run of `key` and the shapes agree (e.g. `optimizer.state.layers.0.attn.q_proj.weight.exp_avg`)."""
    best = None
    for name, pshape in shapes.items():
        if pshape != shape:
            continue
        if f".{name}." in f".{key}." and (best is None or len(name) > len(best)):
            best = name
    return best
