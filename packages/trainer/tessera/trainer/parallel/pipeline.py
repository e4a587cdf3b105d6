"""Pipeline stages of the plain model, and the torch.distributed.pipelining schedules that run them.

A stage (a "chunk" when interleaved) is the model with the layers of other stages deleted
(ModuleDict keyed by global layer number, so names stay global), the embedding only on stage 0
and the final norm and head only on the last. Stage s of S lives on pipeline rank s % pp
(looped placement, as interleaved 1F1B expects).

The stack the pipeline cuts is the kind's plan's `layers` (a dotted path); the module holding it
is the decoder (`decoder_of`: the model itself, or a vision-language model's language model),
whose embedding, final norm, head and config the stages keep and read. Names in the plan's
`first_stage` / `last_stage` are dotted paths too.

Tied embeddings with more than one stage: the last stage holds its own copy of the embedding
matrix as the head (`tied_head`), initialised from the same weights; both copies are tagged
`tied_embedding`, their gradients are summed over the embedding group before the optimizer
step (GradientBuckets), so they stay equal. The checkpoint stores it once, as the decoder's
`embed_tokens.weight`.

A frozen parameter (requires_grad off: training.freeze) stays frozen through the tensor-parallel
swap, which builds new parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from tessera.common.models.causal_lm.model import Transformer
from tessera.common.models.registry import kind_of
from tessera.common.parallel.context_parallel import ContextParallel, ContextParallelAttention
from tessera.common.parallel.expert_parallel import shard_experts
from tessera.common.parallel.layers import tag
from tessera.common.parallel.random import TensorParallelRNG
from tessera.common.parallel.state import ParallelGroups
from tessera.common.parallel.tensor_parallel import parallel_logits
from tessera.trainer.parallel.sharded_init import materialize_stages

TIED_NAME = "embed_tokens.weight"


def decoder_of(model: nn.Module) -> nn.Module:
    """The module holding the stack of layers the kind's plan names (`plan.layers`, dotted): the
    model itself, or the language model inside a vision-language model."""
    path = kind_of(model.cfg).parallel().layers.rpartition(".")[0]
    return model.get_submodule(path) if path else model


def _drop(model: nn.Module, path: str) -> None:
    """Remove the submodule at dotted `path` (set it to None, so the forward skips it)."""
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, None)


class StageModule(nn.Module):
    """One pipeline chunk: tokens or hidden states in; hidden states, or local-vocab logits, out.

    Under context parallel (`cp` of size C > 1) the chunk sees this rank's T/C tokens (chunks i
    and 2C-1-i of the sequence, cut by the runtime): `seq_len` is that local length, the default
    positions are those tokens' global positions, and attention runs through
    `ContextParallelAttention` (all-gathered keys/values, mask by global token index)."""

    def __init__(self, model: Transformer, stage: int, num_stages: int, seq_len: int,
                 tied_head: nn.Parameter | None = None, cp: ContextParallel | None = None, tied_name: str = TIED_NAME):
        super().__init__()
        self.objective = None  # the runtime's, when it has its own stage_forward (parallel/objective.py)
        self.model = model
        self.stage = stage
        self.num_stages = num_stages
        self.cp = cp if cp is not None and cp.enabled else None
        self.seq_len = seq_len // cp.size if self.cp is not None else seq_len
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.tied_head = tied_head
        self.tied_name = tied_name  # the checkpoint name of the embedding the tied head copies
        self.full_seq_len = seq_len
        self.register_buffer("positions", torch.empty(1, self.seq_len, dtype=torch.long), persistent=False)
        self.register_buffer("key_index", torch.empty(seq_len if self.cp else 0, dtype=torch.long), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Default positions (this rank's tokens' global positions) and, under context parallel,
        the global indices of the gathered keys; again after `to_empty` (sharded initialisation)."""
        device = self.positions.device
        if self.cp is None:
            self.positions.copy_(torch.arange(self.seq_len, device=device).unsqueeze(0))
        else:
            self.positions.copy_(self.cp.local_index(self.full_seq_len, device).unsqueeze(0))
            self.key_index.copy_(self.cp.key_index(self.full_seq_len, device))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, mtp_labels: torch.Tensor | None = None,
                mtp_tokens: torch.Tensor | None = None, **side: torch.Tensor):
        """`positions` / `document_ids` [B, T] (whole sequence) for packed documents; the pipeline
        schedule hands every stage its micro-batch's rows of them (and of an objective's side inputs)."""
        if self.objective is not None:  # packed rows' positions / document ids go on to it too
            packed = {k: v for k, v in (("positions", positions), ("document_ids", document_ids)) if v is not None}
            return self.objective.stage_forward(self, x, **side, **packed)
        if not isinstance(self.model, Transformer):
            # A kind without position inputs (hybrid: the Mamba layers carry order); under context
            # parallel it is told the local and gathered tokens' global indices.
            context = None if self.cp is None else (self.cp, self.positions[0], self.key_index)
            h = self.model(x, document_ids=document_ids, return_hidden=True, context=context)
        # Positions are explicit: under sequence parallel a later stage sees T/tp rows.
        elif self.cp is not None:
            # The local queries' global indices order causality (positions restart per document).
            attention = ContextParallelAttention(self.cp, self.model, self.positions[0], self.key_index, document_ids)
            positions = self.positions if positions is None else positions
            h = self.model(x, positions=positions, return_hidden=True, attention_fn=attention)
        else:
            positions = self.positions if positions is None else positions
            # mtp_labels: the multi-token-prediction loss (one stage holding the whole model).
            mtp = {"mtp_labels": mtp_labels, "mtp_tokens": mtp_tokens} if mtp_labels is not None else {}
            h = self.model(x, positions=positions, return_hidden=True, document_ids=document_ids, **mtp)
        if not self.is_last:
            return h
        weight = self.tied_head if self.tied_head is not None else self.model.output_weight()
        return parallel_logits(h, weight, self.model)

    def global_buffers(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> persistent buffer (model state that is not trained: the MoE balancing bias)."""
        persistent = {f"{n}.{b}" if n else b for n, m in self.named_modules()
                      for b in m._buffers if b not in m._non_persistent_buffers_set}
        return {n.removeprefix("model."): b for n, b in self.named_buffers() if n in persistent}

    def global_params(self) -> dict[str, nn.Parameter]:
        """Checkpoint name -> parameter (the tied head under the embedding's name)."""
        out = {n.removeprefix("model."): p for n, p in self.named_parameters() if n != "tied_head"}
        if self.tied_head is not None:
            out[self.tied_name] = self.tied_head
        return out


def stage_layer_ranges(counts: list[int]) -> list[range]:
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def build_stages(build_model: Callable[[], Transformer], groups: ParallelGroups, layer_counts: list[int],
                 seq_len: int, sequence_parallel: bool = False,
                 rng: TensorParallelRNG | None = None, init_seed: int = 0,
                 prepare: Callable[[list[StageModule]], None] | None = None) -> list[StageModule]:
    """This rank's chunks. `build_model()` returns the full plain model (on meta or a device); it
    is called once per chunk, the chunk's layers are kept, the rest dropped, and weights are
    sliced for tensor parallel (and MoE experts for expert parallel) on the way. A materialised model gives exactly the single-process
    weights; so does a meta model, allocated only for the local shards and initialised there to
    the weights `build_model(cfg, seed=init_seed)` would have (sharded_init.materialize_stages),
    for models too large to build whole on each rank. `prepare(stages)` runs on the cut stages
    before a meta build is allocated (the runtime's compile and `fully_shard`: FSDP applied on the
    meta stages, so allocation and initialisation touch only this rank's data shard)."""
    pp, v = groups.pp, groups.layout.virtual_stages
    num_stages = pp * v
    ranges = stage_layer_ranges(layer_counts)
    stages = []
    mine = [groups.pp_rank + k * pp for k in range(v)]
    for s in mine:
        model = build_model()
        plan = kind_of(model.cfg).parallel()  # where this kind's stages cut, what tensor parallel splits
        decoder = decoder_of(model)
        tied = decoder.cfg.tie_embeddings and num_stages > 1
        if num_stages > 1:  # one stage keeps the whole model (an encoder-decoder has two stacks, no cut)
            keep = {str(i) for i in ranges[s]}
            layers = model.get_submodule(plan.layers)
            for name in list(layers.keys()):
                if name not in keep:
                    del layers[name]
        first, last = s == 0, s == num_stages - 1
        if not last:
            for name in plan.last_stage:
                _drop(model, name)
        # MTP on the last stage embeds tokens t+k: it keeps a copy of the embedding, synchronised
        # with the first stage's like a tied head (tagged tied_embedding below).
        mtp_embedding = last and not first and getattr(decoder.cfg, "mtp", None) is not None
        if not first and not (last and tied) and not mtp_embedding:
            for name in plan.first_stage:
                _drop(model, name)
        if mtp_embedding:
            decoder.pos_embed = None
            decoder.dropout = nn.Identity()  # the embedding dropout is the first stage's
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        plan.tensor(model, groups, sequence_parallel, rng)
        shard_experts(model, groups.ep_group, groups.ep, groups.ep_rank)  # expert parallel (ep > 1)
        for n, p in model.named_parameters():  # the swap made new parameters, all requiring gradients
            if n in frozen:
                p.requires_grad_(False)
        tied_head = None
        if tied and last:
            # Keep the embedding (now a vocab-parallel slice) as this stage's head, then drop the
            # lookup so the stage takes hidden states.
            assert decoder.embed_tokens is not None
            weight = decoder.embed_tokens.weight
            tied_head = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
            tag(tied_head, 0)
            tied_head.tied_embedding = True  # type: ignore[attr-defined]
            if not first:
                for name in plan.first_stage:
                    _drop(model, name)
        if (tied or getattr(decoder.cfg, "mtp", None) is not None) and num_stages > 1 and decoder.embed_tokens is not None:
            decoder.embed_tokens.weight.tied_embedding = True  # type: ignore[attr-defined]
        decoder.has_head = last
        cp = ContextParallel(groups.cp_group if groups.cp > 1 else None, groups.cp, groups.cp_rank)
        prefix = plan.layers.rpartition(".")[0]
        stage = StageModule(model, s, num_stages, seq_len, tied_head, cp, f"{prefix}.{TIED_NAME}" if prefix else TIED_NAME)
        if not any(p.is_meta for p in stage.parameters()):
            stage.to(groups.device)
        stages.append(stage)
    if prepare is not None:
        prepare(stages)
    if any(p.is_meta for st in stages for p in st.parameters()):
        materialize_stages(stages, groups, init_seed)
    return stages


def make_schedule(stages: list[StageModule], groups: ParallelGroups, num_microbatches: int,
                  micro_batch: int, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                  sequence_parallel: bool, micro_batch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  logits_dtype: torch.dtype | None = None,
                  loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  last_outputs: Callable[..., tuple[torch.Tensor, ...]] | None = None):
    """A Schedule1F1B (one chunk per rank) or ScheduleInterleaved1F1B (several) over the stages.

    `micro_batch_loss(logits, targets)` is a micro-batch's share of the batch loss (e.g. its mean
    token loss divided by the number of micro-batches), so the accumulated gradient is the
    gradient of the batch loss (scale_grads is off: gradients live in flat buffers whose
    reduction may already be under way when the schedule ends).
    Input/output shapes are given explicitly: shape inference would run the forward on meta
    tensors, through tensor-parallel collectives that cannot take them. `loss_hook(loss)`, when given,
    sees each micro-batch's loss and returns what the schedule backpropagates (fp16 loss scaling).
    """
    tp = groups.tp
    seq = stages[0].seq_len
    local_seq = seq // tp if (sequence_parallel and tp > 1) else seq
    meta = torch.device("meta")
    # requires_grad on the metadata is what tells the stage to send/receive gradients.
    hidden = torch.empty(micro_batch, local_seq, hidden_size, dtype=dtype, device=meta, requires_grad=True)
    logits = torch.empty(micro_batch, seq, vocab_size // tp, dtype=logits_dtype or dtype, device=meta,
                         requires_grad=True)
    tokens = torch.empty(micro_batch, seq, dtype=torch.long, device=meta)
    # An objective's last stage may return several tensors (parallel/objective.py: pipeline_outputs).
    last = (last_outputs(micro_batch, seq, local_seq, vocab_size // tp, logits_dtype or dtype)
            if last_outputs is not None else (logits,))
    pipe_stages = []
    for st in stages:
        inp = tokens if st.is_first else hidden
        out = last if st.is_last else (hidden,)
        pipe_stages.append(PipelineStage(st, st.stage, st.num_stages, groups.device, input_args=(inp,),
                                         output_args=out, group=groups.pp_group))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = micro_batch_loss(out, target)
        return loss_hook(loss) if loss_hook is not None else loss

    if len(stages) == 1:
        return Schedule1F1B(pipe_stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return ScheduleInterleaved1F1B(pipe_stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
