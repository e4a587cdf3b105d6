"""Per-rank memory of a training step under a layout: weights, gradients, optimizer state,
activations and buffers, and the peak they add up to.

Method: analytic. Parameters are counted on the model definition itself (a `Transformer` built
on the meta device: no memory), each parameter divided as tensor/expert parallel divides it, per
pipeline rank from the layout's layer split; the rest is bytes per parameter of each precision
and sharding mode, and activations counted tensor by tensor from what Tessera's block saves for
backward (`activations.py`). The peak is the largest of these moments of a step:

* backward of the micro-batch that has the most activations alive: weights + gradients +
  optimizer state + the activations of the micro-batches in flight (1 without pipeline; the
  schedule's warm-up depth with it) + the loss's logits buffers + FSDP's gathered blocks;
* the optimizer step: weights + gradients + state + the update's temporaries (one flat bucket
  shard, or the largest parameter);
* FSDP only, a block's reduce-scatter late in backward (activations nearly all freed): weights +
  gradients + state + the root's gathered parameters + the root's unsharded gradient (the head's,
  accumulated until the root's own reduce-scatter at the end) + the block's gathered parameters,
  its unsharded gradient and the reduce-scatter's input (measured: the peak of FSDP 2 x CP 2, which
  the first moment under-predicted by 9.8%).

Validated against measured peaks of real runs on CPU (tests/trainer/test_plan_validation.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.registry import kind_of, stage_hook
from tessera.trainer.plan.activations import (
    attention_mask_bytes,
    head_loss_bytes,
    layer_activation_bytes,
    recompute_buffer_bytes,
    resid_bytes,
    saved_head_bytes,
)
from tessera.trainer.plan.hybrid import hybrid_layer_params, is_hybrid
from tessera.trainer.plan.spec import PlanSpec


@functools.lru_cache(maxsize=256)
def _layer_params(cfg_json: str, layer: int, tp: int, ep: int) -> tuple[int, int]:
    """Parameters of global layer `layer` held by one tensor x expert rank: (all, routed experts')."""
    cfg = ModelConfig.model_validate_json(cfg_json)
    from tessera.common.models.causal_lm.model import Block

    with torch.device("meta"):
        block = Block(cfg, layer)
    plan = kind_of(cfg).parallel()  # column-parallel: split by rows (weight and bias); row-parallel: by columns
    total = experts = 0
    for name, p in block.named_parameters():
        parts = name.split(".")
        if "experts" in parts:  # stacked routed experts: whole under tensor parallel, split by expert parallel
            total += p.numel() // ep
            experts += p.numel() // ep
        elif "mlp" in parts and ("shared" in parts or "router" in parts):
            total += p.numel()
        elif parts[-2] in plan.column:
            total += p.numel() // tp
        elif parts[-2] in plan.row:
            total += p.numel() // tp if parts[-1] == "weight" else p.numel()
        else:  # norms, q/k norms
            total += p.numel()
    return total, experts


@dataclass
class RankParams:
    """Parameters one rank holds (before data-parallel sharding), by part."""

    layers: int  # transformer-block parameters
    embedding: int  # token (+ learned position) embedding, head, final norm
    num_layers: int  # transformer blocks on this rank (all its chunks)
    largest_layer: int  # parameters of the largest block it holds (FSDP's gathered unit)
    experts: int = 0  # routed experts' parameters among `layers` (FSDP shards them over data x context ranks only)
    largest_experts: int = 0  # routed experts' parameters among `largest_layer`

    @property
    def total(self) -> int:
        return self.layers + self.embedding


def rank_params(spec: PlanSpec, pp_rank: int = 0) -> RankParams:
    """Parameters on pipeline rank `pp_rank` for one tensor x expert rank."""
    cfg, lay = spec.model, spec.layout
    tp, ep = lay.tensor, lay.expert
    ranges = lay.stage_ranges(cfg.num_layers)
    stages = [s for s in range(lay.num_stages) if s % lay.pipeline == pp_rank]
    js = cfg.model_dump_json()
    layer_params = hybrid_layer_params if is_hybrid(cfg) else _layer_params
    counts = [layer_params(js, i, tp, ep) for s in stages for i in ranges[s]]
    d, v = cfg.hidden_size, cfg.vocab_rows // tp
    norm = d * (2 if getattr(cfg, "norm", "rmsnorm") == "layernorm" else 1)  # hybrid: RMSNorm, no positions
    emb = 0
    mtp = getattr(cfg, "mtp", None)
    if mtp is not None and lay.num_stages - 1 in stages:
        # Multi-token prediction on the last stage: one block per depth (global layer num_layers + k),
        # its enorm / hnorm / head_norm and eh_proj, and a copy of the embedding when not the first stage.
        counts += [layer_params(js, cfg.num_layers + k, tp, ep) for k in range(mtp.depth)]
        emb += mtp.depth * (3 * norm + 2 * d * d) + (v * d if 0 not in stages else 0)
    per_layer = [c[0] for c in counts]
    if 0 in stages:
        emb += v * d + (cfg.max_seq_len * d if getattr(cfg, "position", None) == "learned" else 0)
    if lay.num_stages - 1 in stages:
        emb += norm
        if not cfg.tie_embeddings or 0 not in stages:  # untied head, or the tied copy on the last stage
            emb += v * d
    largest = max(counts, default=(0, 0))
    return RankParams(layers=sum(per_layer), embedding=emb, num_layers=len(per_layer), largest_layer=largest[0],
                      experts=sum(c[1] for c in counts), largest_experts=largest[1])


def in_flight(spec: PlanSpec, pp_rank: int = 0) -> float:
    """Micro-batches whose activations one rank holds at its peak, in units of the rank's whole
    share of layers (all its chunks). 1 without pipeline (each micro-batch's backward follows its
    forward); 1F1B: pipeline - rank (warm-up forwards, at most the micro-batch count); interleaved
    (torch's ScheduleInterleaved1F1B): (v - 1) x pp + 2 (pp - 1 - rank) + 1 chunk-forwards in
    warm-up, each holding 1/v of the rank's layers."""
    pp, v, n = spec.layout.pipeline, spec.layout.virtual_stages, spec.num_microbatches
    if pp == 1:
        return 1.0
    if v == 1:
        return float(min(n, pp - pp_rank))
    warmup = min(n * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)
    return warmup / v


@dataclass
class MemoryPlan:
    """Bytes on one rank (the worst pipeline rank)."""

    weights: float
    grads: float
    optimizer: float
    activations: float  # saved for backward at the peak (all micro-batches in flight)
    buffers: float  # loss/logits buffers, FSDP gathered blocks and unsharded grads, comm scratch
    optimizer_temp: float  # the optimizer step's temporaries
    init: float = 0.0  # while the model is initialised (before the first step)
    late_backward: float = 0.0  # FSDP: a block's reduce-scatter late in backward, beyond `static`
    pp_rank: int = 0
    grads_in_backward: bool = True  # False: gradients appear only as activations are freed
    notes: list[str] = field(default_factory=list)

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        backward = self.static - (0.0 if self.grads_in_backward else self.grads) + self.activations + self.buffers
        return max(backward, self.static + self.optimizer_temp, self.init, self.static + self.late_backward)

    def as_dict(self) -> dict[str, float]:
        return dict(weights=self.weights, grads=self.grads, optimizer=self.optimizer, activations=self.activations,
                    buffers=self.buffers, optimizer_temp=self.optimizer_temp, init=self.init,
                    late_backward=self.late_backward, peak=self.peak, pp_rank=self.pp_rank)


def _bytes_per_param(spec: PlanSpec) -> tuple[float, float, float]:
    """(weight, grad, optimizer) bytes per parameter a rank holds before data-parallel sharding."""
    if not spec.bf16_params:  # fp32 weights (the trainer's bf16 and fp8 are autocast over them)
        return 4.0, 4.0, 8.0  # Adam moments; fp32 parameters are their own masters
    return 2.0, 4.0, 12.0  # bf16 weights, fp32 main grads, fp32 master + moments


def plan_memory(spec: PlanSpec, pp_rank: int | None = None) -> MemoryPlan:
    """Per-rank memory by the count of the model's kind (`memory_count`)."""
    return memory_count(spec.model)(spec, pp_rank)


def decoder_memory(spec: PlanSpec, pp_rank: int | None = None) -> MemoryPlan:
    """Per-rank memory of a decoder stack; without `pp_rank`, the pipeline rank with the highest peak."""
    if pp_rank is None:
        plans = [decoder_memory(spec, r) for r in range(spec.layout.pipeline)]
        return max(plans, key=lambda m: m.peak)
    lay = spec.layout
    params = rank_params(spec, pp_rank)
    wb, gb, ob = _bytes_per_param(spec)
    n = params.total
    notes: list[str] = []
    buffers = unsharded_grads = late = 0.0
    held = float(n)  # parameters this rank allocates (its FSDP shards)
    if spec.fsdp:
        # Dense parameters are sharded over data x expert x context ranks (ParallelLayout.fsdp_dims),
        # the routed experts (already split over expert ranks) over the data shards x context ranks
        # of their group.
        held = (n - params.experts) / lay.fsdp_shards + params.experts / lay.fsdp_expert_shards
        weights = held * 4.0  # sharded fp32 parameters are the masters
        grads = held * 4.0
        optimizer = held * 8.0
        gathered_b = 2.0 if spec.bf16_params else 4.0  # FSDP's param_dtype
        block_b = 1.0 if spec.fp8_all_gather and spec.float8 else gathered_b  # torchao's float8 all-gather: fp8 linear weights
        # At the peak (the loss, then the first backward block) the root (embedding, final norm,
        # head; kept gathered from forward to backward) and one gathered block are alive; the
        # prefetched block and a block's unsharded gradients come later, when activations have
        # been freed (measured: counting them over-predicted FSDP 4 by 15%). Under pipeline
        # parallel the runtime keeps every block gathered (reshard_after_forward off, as torchtitan).
        units = 1 if spec.fsdp_reshard_after_forward and lay.pipeline == 1 else params.num_layers
        buffers += units * params.largest_layer * block_b + params.embedding * gathered_b
        if lay.pipeline > 1:
            # The pipeline schedule turns FSDP's gradient sync off for all but a stage's last
            # micro-batch, so every block's unsharded gradient accumulates over the step, in the
            # reduce dtype (fp32: FSDP2 upcasts bf16 gradients into `unsharded_accumulated_grad`);
            # the sharded gradients (freed at zero_grad) only appear as these are reduce-scattered.
            unsharded_grads = n * 4.0
        # The update's temporaries: the largest block's shard (its routed experts cut only data x
        # context ways, its dense parameters data x expert x context ways).
        opt_temp = ((params.largest_layer - params.largest_experts) / lay.fsdp_shards
                    + params.largest_experts / lay.fsdp_expert_shards) * 4.0
        if spec.cpu_offload:
            notes.append("CPU offload: sharded weights, grads and optimizer state in host memory")
            weights = grads = optimizer = 0.0
    else:
        # ZeRO-1: dense buckets sharded over data x expert ranks, the routed experts' over data ranks.
        dense_shards, expert_shards = (lay.batch_readers, lay.data) if spec.distributed_optimizer else (1, 1)
        weights = n * wb
        grads = n * gb
        optimizer = ((n - params.experts) / dense_shards + params.experts / expert_shards) * ob  # moments, fp32 masters
        # The update runs on one flat bucket shard at a time: its temporaries are one shard.
        bucket = min(n, spec.bucket_numel)
        opt_temp = bucket * 4.0 / dense_shards
    flight = in_flight(spec, pp_rank)
    ranges = lay.stage_ranges(spec.model.num_layers)
    layers = [i for st in range(lay.num_stages) if st % lay.pipeline == pp_rank for i in ranges[st]]
    per_mb = sum(layer_activation_bytes(spec, i) for i in layers) + attention_mask_bytes(spec)
    acts = per_mb * flight
    if spec.fsdp and lay.pipeline == 1:
        # The first block's reduce-scatter in backward (the last layer's): the root still gathered
        # and holding the head's unsharded gradient (parameter dtype), the block gathered with its
        # unsharded gradient and the reduce-scatter's input (reduce dtype, fp32), the next block
        # prefetched, and the activations of every layer below. The head's loss buffers and saved
        # input are freed by then.
        head = spec.model.vocab_rows // lay.tensor * spec.model.hidden_size
        gathered = min(2, params.num_layers) if spec.fsdp_reshard_after_forward else params.num_layers
        below = per_mb - (layer_activation_bytes(spec, layers[-1]) if layers else 0.0)
        late = ((params.embedding + head) * gathered_b + gathered * params.largest_layer * block_b
                + params.largest_layer * (gathered_b + 4.0) + below)
    if unsharded_grads:
        # They exist from the rank's first backward on. With forwards left after it (1F1B's
        # steady state) the warm-up's micro-batches are in flight again beside them; when the
        # warm-up ran every forward (micro-batches <= warm-up) one chunk-forward has been freed.
        # The plan describes whichever of the two moments is larger.
        steady = spec.num_microbatches * lay.virtual_stages > round(flight * lay.virtual_stages)
        after = per_mb * (flight if steady else flight - 1 / lay.virtual_stages)
        if after + unsharded_grads > acts:
            acts = after
            buffers += unsharded_grads
    if lay.pipeline > 1:
        # Each chunk-forward in flight keeps its stage output for the stage's backward, and the
        # schedule holds a receive buffer per micro-batch for every stage input and output gradient.
        tokens = spec.micro_batch * spec.seq_len // lay.context
        sp = lay.tensor if spec.sequence_parallel and lay.tensor > 1 else 1
        hidden = tokens // sp * spec.model.hidden_size * resid_bytes(spec)
        chunks = [s for s in range(lay.num_stages) if s % lay.pipeline == pp_rank]
        acts += flight * lay.virtual_stages * hidden
        recv = sum((s > 0) + (s < lay.num_stages - 1) for s in chunks)
        buffers += recv * spec.num_microbatches * hidden
    last = pp_rank == (lay.num_stages - 1) % lay.pipeline
    # Full recompute rebuilds a block in its backward, after the loss's backward has freed its
    # transients: without FSDP the two are alive one after the other, not together (one process,
    # measured: counting both over-predicted the peak by 5.9% for a decoder, 14.6% for a hybrid
    # model); under FSDP x TP counting both is what matched (-12.8% with the larger alone).
    recompute = recompute_buffer_bytes(spec)
    transient = recompute if spec.fsdp else 0.0
    if last:
        acts += saved_head_bytes(spec)
        transient += head_loss_bytes(spec)
        if lay.pipeline > 1:
            # The last stage's output is the local-vocab logits, which the schedule keeps (its
            # forward cache) until that micro-batch's backward; one process frees them after the
            # loss's forward. Found by listing the storages alive at the measured pp2 peak.
            tokens = spec.micro_batch * spec.seq_len // lay.context
            acts += tokens * (spec.model.vocab_rows // lay.tensor) * (4.0 if spec.precision == "fp32" else 2.0)
    buffers += max(transient, recompute)
    if spec.precision in ("bf16", "fp8"):
        # Autocast keeps one bf16 copy of every fp32 weight a matmul uses, forward to backward
        # (its cache: once for all micro-batches; the block measurement leaves them out).
        # Float8Linear casts its weight to float8 in forward and again in backward and keeps
        # none, so under fp8 only the unconverted head's copy remains.
        last = pp_rank == (lay.num_stages - 1) % lay.pipeline
        head = spec.model.vocab_rows // lay.tensor * spec.model.hidden_size if last else 0
        buffers += (params.total if spec.precision == "bf16" else head) * 2.0
    # Sharded initialisation (tessera.trainer.parallel.sharded_init) allocates this rank's tensor x
    # pipeline share of the model in fp32 -- under FSDP only its FSDP shard of that (`held`), fully_shard
    # being applied to the meta model first -- and replays the initialisation one global module at
    # a time (the largest: the embedding, or one MoE layer's experts).
    cfg = spec.model
    largest = cfg.vocab_rows * cfg.hidden_size
    if cfg.moe is not None:
        largest = max(largest, 3 * cfg.moe.num_experts * cfg.moe.ffn_hidden_size * cfg.hidden_size)
    init = (held + largest) * 4.0
    return MemoryPlan(weights=weights, grads=grads, optimizer=optimizer, activations=acts, buffers=buffers,
                      optimizer_temp=opt_temp, init=init, late_backward=late, pp_rank=pp_rank, notes=notes,
                      # FSDP frees the sharded gradients at zero_grad and reduce-scatters new ones
                      # block by block in backward: with one micro-batch none exist at the peak.
                      grads_in_backward=not (spec.fsdp and (spec.num_microbatches == 1 or lay.pipeline > 1)))


MEMORY_COUNTS = {"decoder": decoder_memory}  # the planner's memory count per hook name (the kind registry's)


def memory_count(model) -> Callable[[PlanSpec, int | None], MemoryPlan]:
    """tessera-plan's memory count for `model`'s kind, or a one-line UserError."""
    return stage_hook(model, "plan_memory", MEMORY_COUNTS, "tessera-plan")
