"""The parallel layout: how many ways each dimension is split, and which layers each pipeline stage holds.

Rank order (fastest-varying first): tensor, context, expert, data, pipeline (expert ranks hold
different experts and read different rows of the batch: data x expert ranks share it); within data, the
shard index (FSDP, `data_shard`) varies faster than the replica index (HSDP, `data_replicate`). The process-group
module (tessera.common.parallel.state) builds groups from this; the trainer cuts pipeline stages
by `stage_layers`, `tessera-ckpt reshard` places each layer's tensors by the same rule, and
checkpoints record the layout they were saved from, split included (for information and for
exact resume of per-rank RNG streams: what is stored does not depend on it).

Pipeline stages: the L layers form S = pipeline x virtual_stages consecutive stages in layer
order, stage s holding `stage_layers(L)[s]` layers; stage s runs on pipeline rank s mod pipeline
(virtual_stages = 1: contiguous stages; above 1: interleaved 1F1B, model chunk s // pipeline of
that rank). The embedding lives on stage 0, the final norm and head on stage S - 1.

`validate_layout` is the one check of a layout against a model (and, for training, the batch
and the launched world size); every problem is one UserError line naming the flag and what to
change. The trainer and `tessera-ckpt reshard` both call it, so reshard accepts exactly the
layer splits the trainer runs.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tessera.common.config import StrictModel
from tessera.common.errors import UserError


def parse_pipeline_layers(text: str | None) -> list[int] | None:
    """The --pipeline-layers flag (trainer and reshard): '5,4,4,3' -> [5, 4, 4, 3]; None or '' or
    'auto' -> None (automatic split)."""
    if text is None or text.strip() in ("", "auto"):
        return None
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--pipeline-layers {text!r}: expected comma-separated layer counts, e.g. 5,4,4,3") from None
    return counts


def split_layers(num_layers: int, num_stages: int, explicit: list[int] | None = None) -> list[int]:
    """Layers per pipeline stage (stage = virtual stage when interleaved), in stage order.

    Automatic: as even as possible, the remainder going to the middle stages, since the first
    stage also holds the embedding and the last the head and loss.
    """
    if explicit is not None:
        if len(explicit) != num_stages:
            raise UserError(f"--pipeline-layers: {len(explicit)} values given but the layout has {num_stages} "
                            "stages (pipeline x virtual-stages); give one count per stage")
        if any(n < 1 for n in explicit):
            raise UserError("--pipeline-layers: every stage needs at least one layer")
        if sum(explicit) != num_layers:
            raise UserError(f"--pipeline-layers: counts sum to {sum(explicit)} but the model has {num_layers} layers")
        return list(explicit)
    if num_layers < num_stages:
        raise UserError(f"layout: {num_stages} pipeline stages (pipeline x virtual-stages) but the model has only "
                        f"{num_layers} layers; lower --pipeline-parallel or --virtual-stages")
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    # Hand the extra layers to the stages nearest the middle.
    order = sorted(range(num_stages), key=lambda s: (abs(s - (num_stages - 1) / 2), s))
    for s in order[:extra]:
        counts[s] += 1
    return counts


class ParallelLayout(StrictModel):
    tensor: int = Field(1, ge=1, description="Tensor-parallel size (with sequence parallel when enabled).")
    context: int = Field(1, ge=1, description="Context-parallel size (sequence split across ranks in attention).")
    expert: int = Field(1, ge=1, description="Expert-parallel size (MoE experts split across ranks).")
    data: int = Field(1, ge=1, description="Data-parallel size (replicas; sharded optimizer with the distributed optimizer).")
    data_shard: int = Field(1, ge=1, description="Of the data-parallel ranks, how many shard parameters, gradients and "
                            "optimizer state among themselves (FSDP / ZeRO-3); data / data_shard copies of each shard "
                            "(HSDP). 1: parameters replicated (ZeRO-1 or plain data parallel).")
    pipeline: int = Field(1, ge=1, description="Pipeline-parallel size (stages).")
    virtual_stages: int = Field(1, ge=1, description="Model chunks per pipeline rank (interleaved 1F1B).")
    pipeline_layers: list[int] | None = Field(
        None, description="Layers per pipeline stage in stage order (pipeline x virtual_stages values; stage s runs "
                          "on pipeline rank s mod pipeline); null = automatic (split_layers: as even as possible, "
                          "extra layers to the middle stages). Checkpoints record the resolved split.")

    @property
    def world_size(self) -> int:
        return self.tensor * self.context * self.expert * self.data * self.pipeline

    @property
    def batch_readers(self) -> int:
        """How many ways the global batch is split: data x expert (expert ranks read their own rows,
        as data ranks do; they are also the replicas of a dense parameter)."""
        return self.data * self.expert

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """The mesh dimensions a fully-sharded (data_shard > 1) dense parameter is sharded over,
        slowest first: the data shards, and the expert and context ranks, which hold the same
        dense parameters (torchtitan's dp_shard_cp; expert ranks are replicas as data ranks are)."""
        return ("dp_shard",) + ("ep",) * (self.expert > 1) + ("cp",) * (self.context > 1)

    @property
    def fsdp_expert_dims(self) -> tuple[str, ...]:
        """The mesh dimensions a fully-sharded MoE layer's experts are sharded over: the data shards
        and context ranks of their expert group (expert ranks hold different experts)."""
        return ("dp_shard",) + ("cp",) * (self.context > 1)

    @property
    def fsdp_shards(self) -> int:
        """How many pieces FSDP cuts a dense parameter into when it runs (data_shard > 1): data_shard
        x expert x context. The product whatever data_shard is; without FSDP nothing is cut."""
        return self.data_shard * self.expert * self.context

    @property
    def fsdp_expert_shards(self) -> int:
        """How many pieces FSDP (data_shard > 1) cuts an expert-parallel rank's experts into: data_shard
        x context (the product whatever data_shard is)."""
        return self.data_shard * self.context

    @property
    def data_replicate(self) -> int:
        """Copies of each fully-sharded group (HSDP); data when parameters are not sharded."""
        return self.data // self.data_shard if self.data % self.data_shard == 0 else 0

    @property
    def num_stages(self) -> int:
        """Pipeline stages over all ranks: pipeline x virtual_stages."""
        return self.pipeline * self.virtual_stages

    def short(self) -> str:
        return (f"tp{self.tensor}-cp{self.context}-ep{self.expert}-dp{self.data}"
                + (f"s{self.data_shard}" if self.data_shard > 1 else "") + f"-pp{self.pipeline}"
                + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
                + (f"[{','.join(map(str, self.pipeline_layers))}]"
                   if self.pipeline_layers is not None and self.num_stages > 1 else ""))

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per stage for a model of `num_layers` layers: the explicit split, checked, or the automatic one."""
        if self.virtual_stages > 1 and self.pipeline == 1:
            raise UserError("--virtual-stages above 1 needs --pipeline-parallel above 1")
        return split_layers(num_layers, self.num_stages, self.pipeline_layers)

    def stage_ranges(self, num_layers: int) -> list[range]:
        """Global layer numbers of each stage, in stage order."""
        ranges, start = [], 0
        for count in self.stage_layers(num_layers):
            ranges.append(range(start, start + count))
            start += count
        return ranges

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        """The stage holding global layer `layer` (its pipeline rank is this mod `pipeline`)."""
        for stage, layers in enumerate(self.stage_ranges(num_layers)):
            if layer in layers:
                return stage
        raise ValueError(f"layer {layer} is outside a model of {num_layers} layers")

    def resolved(self, num_layers: int) -> ParallelLayout:
        """This layout with `pipeline_layers` set to the split it runs (what checkpoints record)."""
        return self.model_copy(update={"pipeline_layers": self.stage_layers(num_layers)})


def check_expert_parallel(cfg: Any, layout: ParallelLayout) -> None:
    """The expert-parallel part of `validate_layout`, which needs only the model's MoE settings (the
    trainer's config checks it as it loads, before any process is launched)."""
    if layout.expert == 1:
        return
    if cfg.moe is None:
        raise UserError(f"--expert-parallel {layout.expert}: the model has no mixture-of-experts layers "
                        "(model.moe); set it to 1")
    if cfg.moe.num_experts % layout.expert:
        raise UserError(f"--expert-parallel {layout.expert} must divide model.moe.num_experts "
                        f"({cfg.moe.num_experts}); each rank holds num_experts / expert_parallel experts")
    ds = layout.fsdp_expert_shards
    if layout.data_shard > 1 and (cfg.moe.ffn_hidden_size % ds or cfg.hidden_size % ds):
        # Experts are fully sharded over their expert group's data shards (x context ranks) along
        # dim 1 (their output rows: ffn for gate/up, hidden for down); FSDP2 shards a non-leading
        # dim only evenly.
        by = f"--data-shard {layout.data_shard}" + (f" x --context-parallel {layout.context}" if layout.context > 1 else "")
        raise UserError(f"{by} with --expert-parallel {layout.expert} must divide model.moe.ffn_hidden_size "
                        f"({cfg.moe.ffn_hidden_size}) and hidden_size ({cfg.hidden_size}): FSDP splits each expert "
                        f"along its output rows, evenly; change {by.replace(' x ', ' or ')}")


def check_context_parallel(cfg: Any, layout: ParallelLayout) -> None:
    """Context parallel is built for standard and latent attention; a kind without it refuses it in
    its own check (its config's `check_layout`). Multi-token prediction reads each position's next
    token, which lies in another rank's chunk at a chunk's end: not built."""
    if layout.context > 1 and getattr(cfg, "mtp", None) is not None:
        raise UserError(f"--context-parallel {layout.context} (parallel.context): context parallel with multi-token "
                        "prediction (model.mtp) is not built; set it to 1 or drop model.mtp")


def _check_tensor_parallel(cfg: Any, tp: int) -> None:
    """Each tensor rank holds whole heads (and key/value heads), an equal slice of the MLPs and of
    the vocabulary: `tp` must divide each of them. A kind with other layers gives its own rule
    (its config's `check_tensor_parallel`, e.g. for Mamba heads and groups)."""
    own = getattr(cfg, "check_tensor_parallel", None)
    if own is not None:
        own(tp)
        return
    if cfg.num_heads % tp:
        raise UserError(f"--tensor-parallel {tp} must divide num_heads ({cfg.num_heads})")
    if cfg.kv_heads % tp:
        raise UserError(f"--tensor-parallel {tp} must divide num_kv_heads ({cfg.kv_heads}); key/value heads are "
                        "split, not replicated, so tensor parallel cannot exceed them")
    if cfg.ffn_hidden_size % tp:
        raise UserError(f"--tensor-parallel {tp} must divide ffn_hidden_size ({cfg.ffn_hidden_size})")
    if cfg.vocab_rows % tp:
        raise UserError(f"--tensor-parallel {tp} must divide the vocabulary rows ({cfg.vocab_rows}); pad the vocabulary "
                        f"(model.vocab_size_divisible_by; `tessera-ckpt reshard` re-pads a checkpoint)")


def validate_layout(
    cfg: Any,
    layout: ParallelLayout,
    *,
    world_size: int | None = None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    micro_batch: int | None = None,
    sequence_parallel: bool = False,
) -> list[int]:
    """Raise UserError on the first size that does not divide; return the layers per stage.

    The model and the layout alone decide the shapes (what `reshard` checks); the trainer also
    passes the launched world size, the sequence length and the batch (micro-batch counts the
    pipeline schedules need)."""
    tp, pp, dp, v = layout.tensor, layout.pipeline, layout.data, layout.virtual_stages
    # What the kind lacks comes before the sizes: no launch size makes it work.
    own = getattr(cfg, "check_layout", None)
    inner = own(layout) if own is not None else None
    if world_size is not None and layout.world_size != world_size:
        raise UserError(f"layout: tensor x context x expert x data x pipeline = {layout.world_size} but "
                        f"{world_size} processes were launched; data parallel is world size / (tensor x pipeline)")
    if inner is not None:  # the kind checked its own modules; the rest is `inner`'s (a VLM's language model)
        return validate_layout(inner, layout, world_size=world_size, seq_len=seq_len, global_batch=global_batch,
                               micro_batch=micro_batch, sequence_parallel=sequence_parallel)
    check_expert_parallel(cfg, layout)
    check_context_parallel(cfg, layout)
    if layout.virtual_stages > 1 and getattr(cfg, "mtp", None) is not None:
        raise UserError(f"model.mtp: multi-token prediction under the interleaved pipeline (--virtual-stages "
                        f"{layout.virtual_stages}) is not built; use --virtual-stages 1 (MTP then runs on the last "
                        "stage), or set model.mtp=null")
    cp = layout.context
    if dp % layout.data_shard:
        raise UserError(f"--data-shard {layout.data_shard} must divide the data-parallel size ({dp} = world size / "
                        "(tensor x context x expert x pipeline)); data / data_shard is the number of HSDP replicas")
    if layout.data_shard > 1 and tp > 1 and cfg.hidden_size % layout.fsdp_shards:
        # A tensor-split weight is fully sharded (over data x expert x context ranks) along its
        # other dim, the hidden size; FSDP2 shards a non-leading dim only evenly. (Over one tensor
        # rank everything is sharded along dim 0, unevenly if need be: no condition.)
        by = (f"--data-shard {layout.data_shard}" + (f" x --expert-parallel {layout.expert}" if layout.expert > 1 else "")
              + (f" x --context-parallel {cp}" if cp > 1 else ""))
        raise UserError(f"{by} with --tensor-parallel {tp} must divide hidden_size "
                        f"({cfg.hidden_size}): FSDP splits each tensor-parallel weight along the hidden dim, evenly; "
                        f"change {by.replace(' x ', ' or ')}, or use --tensor-parallel 1")
    _check_tensor_parallel(cfg, tp)
    if seq_len is not None:
        if cp > 1 and seq_len % (2 * cp):
            raise UserError(f"--context-parallel {cp}: seq_len ({seq_len}) must be divisible by 2 x {cp} = {2 * cp} "
                            "(each context rank holds two of 2 x context equal chunks: i and 2C-1-i)")
        if sequence_parallel and tp > 1 and (seq_len // cp) % tp:
            by = f"--tensor-parallel {tp}" if cp == 1 else f"--context-parallel {cp} x --tensor-parallel {tp}"
            raise UserError(f"sequence parallel: seq_len ({seq_len}) must be divisible by {by}")
        if seq_len > cfg.max_seq_len:
            raise UserError(f"seq_len ({seq_len}) exceeds the model's max_seq_len ({cfg.max_seq_len})")
    counts = layout.stage_layers(cfg.num_layers)
    if global_batch is None:
        return counts
    readers = layout.batch_readers
    if micro_batch is None or micro_batch < 1 or global_batch % (micro_batch * readers):
        by = f"data parallel ({dp})" if layout.expert == 1 else f"data parallel ({dp}) x expert parallel ({layout.expert})"
        raise UserError(f"global batch ({global_batch}) must be a multiple of micro batch ({micro_batch}) x {by}")
    n_micro = global_batch // (micro_batch * readers)
    if pp > 1 and n_micro < pp:
        raise UserError(f"pipeline: {n_micro} micro-batches per step but {pp} stages; 1F1B needs at least as many "
                        "micro-batches as stages (raise the global batch or lower the micro batch)")
    if v > 1 and n_micro % pp:
        raise UserError(f"interleaved pipeline: micro-batches per step ({n_micro}) must be a multiple of "
                        f"--pipeline-parallel ({pp})")
    return counts
