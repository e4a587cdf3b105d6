"""The parallel training step: stages + schedule + distributed optimizer, composed.

    groups  = build_groups(layout)                       # tessera.common.parallel.state
    rt      = ParallelRuntime.build(cfg, groups, train_cfg.training, train_cfg.parallel, train_cfg.optim,
                                    build_model=lambda: build_model(cfg, seed=seed))
    result  = rt.train_step(tokens, targets)             # this data-parallel rank's rows
    rt.save(dir) / rt.load(dir)                          # DCP, layout-free names (tests, benchmarks;
                                                         # the trainer checkpoints through its engine)

`train_step` takes this rank's share of the global batch ([n_micro * micro, T] tokens and
targets, identical on every tensor and pipeline rank of the replica): the rows of
`groups.dp_ep_rank` of the dp x ep equal parts (expert ranks read their own rows, as data
ranks do; without expert parallel that is the data-parallel rank) and returns
the global mean loss (the same on every rank), the pre-clip global gradient norm and the MoE
router statistics. The run's settings are TrainConfig's own sections (training: batch shape,
seed, precision, compile; parallel: the options beyond the layout; optim: AdamW), validated once
when the config loads; the layout itself is the groups'.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from tessera.common.checkpoint import metadata_digest
from tessera.common.layers.moe import RouterStats
from tessera.common.layout import validate_layout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import Transformer
from tessera.common.parallel.expert_parallel import is_expert_shard
from tessera.common.parallel.random import TensorParallelRNG
from tessera.common.parallel.state import ParallelGroups
from tessera.common.parallel.state_dict import load_model_state_dict, model_state_dict
from tessera.common.parallel.tensor_parallel import enable_async_tp
from tessera.common.safe_dcp import dcp_load
from tessera.trainer.components.model_setup import compile_blocks
from tessera.trainer.components.precision.float8 import float8_backend
from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig
from tessera.trainer.engine import StepResult
from tessera.trainer.objectives.documents import IGNORE_INDEX
from tessera.trainer.objectives.objective import LossContext, NextToken
from tessera.trainer.parallel.fsdp import FullyShardedOptimizer, shard_stages
from tessera.trainer.parallel.optimizer import DistributedOptimizer
from tessera.trainer.parallel.pipeline import StageModule, build_stages, decoder_of, make_schedule

_AUTOCAST = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}


def _local_data(p: torch.Tensor) -> torch.Tensor:
    """A parameter's data on this rank (a fully-sharded DTensor's local shard)."""
    return p.data.to_local() if isinstance(p.data, DTensor) else p.data


class ParallelRuntime:
    """Runs training steps of one model under one layout. Build with `ParallelRuntime.build`."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, training: TrainingConfig, parallel: ParallelConfig,
                 stages: list[StageModule], optimizer: DistributedOptimizer, rng: TensorParallelRNG,
                 per_token_loss: bool = False, objective=None):
        self.cfg, self.groups, self.training, self.parallel = cfg, groups, training, parallel
        # The config of the stack the stages cut (a vision-language model's language model's).
        self.decoder_cfg = decoder_of(stages[0].model).cfg
        # The kind's objective (parallel/objective.py): batch -> stage inputs and targets, the loss.
        self.objective = objective if objective is not None else NextToken()
        if hasattr(self.objective, "stage_forward"):
            for st in stages:
                st.objective = self.objective
        self.micro_batch = training.micro_batch_size
        # Targets equal to IGNORE_INDEX count for nothing and the loss is the mean over the other
        # tokens of the global batch (data.eod_mask_loss, loss masks): one all-reduce of the count.
        self.per_token_loss = per_token_loss
        self.float8 = float8_backend(training.fp8_backend) if training.precision == "fp8" else None
        self.stages = stages
        self.optimizer = optimizer
        self.rng = rng
        self.num_microbatches = training.global_batch_size // (self.micro_batch * groups.dp_ep)
        self._schedules: dict[int, object] = {}  # pipeline schedule per micro-batch count (batch ramp-up)
        self._loss_scale = 1.0  # multiplies the loss before backward (fp16 loss scaling)
        self._micro_losses: list[torch.Tensor] = []  # unscaled, as the pipeline's last stage computed them
        self._token_weight = 0.0  # per_token_loss: dp / counted tokens of this step's global batch
        self.token_count = 0  # per_token_loss: counted label tokens of the last train/eval global batch
        self.schedule = self._schedule_for(self.num_microbatches)
        # MoE: router statistics and the balancing-bias update, loads summed over the ranks that
        # routed other tokens through the same layers.
        self.router_stats = RouterStats(list(stages), reduce=self._reduce_router) if self.decoder_cfg.moe is not None else None
        # Multi-token prediction: on the last pipeline stage.
        self.mtp = getattr(stages[-1].model, "mtp", None) if stages[-1].is_last else None
        self.mtp_cfg = getattr(self.decoder_cfg, "mtp", None)  # (other kinds' configs have no such field)

    def _reduce_router(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over data and expert ranks (each routes its own rows of the batch), context ranks
        (their own chunks of the sequence) and tensor ranks under sequence parallel (each routes its
        own chunk of the sequence; without it they route the same tokens)."""
        g = self.groups
        t = t.to(g.device)
        if g.dp_ep > 1:
            dist.all_reduce(t, group=g.dp_ep_group)
        if g.cp > 1:
            dist.all_reduce(t, group=g.cp_group)
        if g.tp > 1 and self.stages[0].model.sequence_parallel:
            dist.all_reduce(t, group=g.tp_group)
        return t.cpu()

    def _schedule_for(self, num_microbatches: int):
        """The pipeline schedule for steps of `num_microbatches` (None without pipeline): a batch-size
        ramp-up changes the count, a schedule's is fixed. Only this count's and the full batch's (used
        by evaluation) are kept: each holds receive buffers per micro-batch, and a ramp only grows."""
        if self.groups.pp == 1:
            return None
        full = self.training.global_batch_size // (self.micro_batch * self.groups.dp_ep)
        for stale in [n for n in self._schedules if n not in (num_microbatches, full)]:
            del self._schedules[stale]
        if num_microbatches not in self._schedules:
            dtype = next(self.stages[0].parameters()).dtype
            # Under autocast the head's logits come out in the autocast dtype; the residual
            # stream stays in the parameter dtype (fp32 + bf16/fp16 promotes to fp32).
            logits_dtype = self._autocast_dtype() or dtype
            vocab_rows = getattr(self.decoder_cfg, "vocab_rows", self.decoder_cfg.vocab_size)  # (a hybrid has no vocab padding)
            self._schedules[num_microbatches] = make_schedule(
                self.stages, self.groups, num_microbatches, self.micro_batch, self.decoder_cfg.hidden_size,
                vocab_rows, dtype, self.stages[0].model.sequence_parallel, self._micro_batch_loss,
                logits_dtype=logits_dtype, loss_hook=self._scale_loss,
                last_outputs=getattr(self.objective, "pipeline_outputs", None))
        return self._schedules[num_microbatches]

    def _use_microbatches(self, rows: int) -> None:
        """Set the step's micro-batch count from this rank's rows (a multiple of micro_batch)."""
        mb = self.micro_batch
        if rows % mb or rows == 0:
            raise ValueError(f"expected a positive multiple of micro_batch ({mb}) rows on this data-parallel rank, "
                             f"got {rows}")
        self.num_microbatches = rows // mb
        self.schedule = self._schedule_for(self.num_microbatches)

    @classmethod
    def build(cls, cfg: ModelConfig, groups: ParallelGroups, training: TrainingConfig, parallel: ParallelConfig,
              optim: OptimConfig, build_model: Callable[[], Transformer],
              per_token_loss: bool = False, objective=None) -> ParallelRuntime:
        t, p = training, parallel
        if groups.pp > 1 and not getattr(objective, "pipeline", True):
            raise ValueError(f"{type(objective).__name__}: this objective has no pipeline-parallel path")
        counts = validate_layout(cfg, groups.layout, seq_len=t.seq_length, global_batch=t.global_batch_size,
                                 micro_batch=t.micro_batch_size, sequence_parallel=p.sequence_parallel,
                                 world_size=groups.world_size)
        rng = TensorParallelRNG(t.seed, groups.tp_rank, groups.pp_rank, groups.device)
        rng.seed_default()
        if p.async_tp:  # before compiling: inductor reads the switch when it lowers the blocks
            enable_async_tp(groups, compiled=t.compile, sequence_parallel=p.sequence_parallel)

        def prepare(stages: list[StageModule]) -> None:
            # fp8: after the tensor-parallel swap (which would rebuild Float8Linear layers as plain
            # ones; tensor-parallel layers over more than one rank get a float8 local matmul, over
            # one rank they are plain Linear with tags and become Float8Linear), before compile and
            # fully_shard (float8 all-gather wraps the weights first).
            if t.precision == "fp8":
                float8 = float8_backend(t.fp8_backend)
                for st in stages:
                    float8.convert(st, t.fp8_recipe, fsdp_float8_all_gather=p.fsdp_float8_all_gather)
            # Before a meta build is allocated: FSDP shards the meta parameters, so only this
            # rank's data shard is ever allocated and initialised (sharded_init).
            if t.compile:  # per block, each kind once; names, hooks and state dicts as without compile
                for st in stages:
                    compile_blocks(st.model)
            if groups.dp_shard > 1:
                shard_stages(stages, groups, param_dtype=p.fsdp_param_dtype, reduce_dtype=p.fsdp_reduce_dtype,
                             cpu_offload=p.fsdp_cpu_offload)

        # The objective's word on the plain model before the cut (parallel/objective.py: prepare_model).
        prepare_model = getattr(objective, "prepare_model", None)
        build = (lambda: prepare_model(build_model())) if prepare_model is not None else build_model
        stages = build_stages(build, groups, counts, t.seq_length, p.sequence_parallel, rng,
                              init_seed=t.seed, prepare=prepare)
        adamw = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay,
                     max_grad_norm=optim.grad_clip or None)  # grad_clip 0: no clipping
        if groups.dp_shard > 1:
            named = [(n, q) for s in stages for n, q in s.global_params().items()]
            fsdp_opt = FullyShardedOptimizer(named, groups, **adamw)
            return cls(cfg, groups, t, p, stages, fsdp_opt, rng, per_token_loss, objective)  # type: ignore[arg-type]
        named = [(f"{s.stage}.{n}", q) for s in stages for n, q in s.global_params().items()]
        optimizer = DistributedOptimizer(
            named, groups, **adamw, shard=p.distributed_optimizer, bucket_numel=p.bucket_numel,
            no_decay=lambda _n, q: q.ndim < 2, overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather,
        )
        if p.overlap_param_gather:
            optimizer.register_param_gather_hooks(stages, own_forward=hasattr(objective, "stage_forward"))
        return cls(cfg, groups, t, p, stages, optimizer, rng, per_token_loss, objective)

    # ---- training ---------------------------------------------------------------------------
    def train(self, mode: bool = True) -> None:
        for s in self.stages:
            s.train(mode)

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, loss_scale: float = 1.0,
                   model_inputs: dict[str, torch.Tensor] | None = None) -> StepResult:
        """One optimizer step. With `loss_scale` != 1 (fp16) the loss is multiplied by it before
        backward, gradients are divided by it before clipping, and a step whose gradients are not
        finite (the global norm is inf/nan, so every rank agrees) is skipped. `model_inputs`
        (`positions`, `document_ids`: [rows, T], rows as `tokens`) go to every stage's forward.
        `tokens` / `targets` are the batch and labels as the kind's objective reads them."""
        tokens, model_inputs, targets = self.objective.split(tokens, targets, model_inputs)
        self._use_microbatches(tokens.shape[0])
        g, n = self.groups, self.num_microbatches
        self._set_token_weight(targets)
        tokens, targets, model_inputs = self._local(tokens, targets, model_inputs)
        self.optimizer.zero_grad(n)
        if self.router_stats is not None:
            self.router_stats.prepare(n)
        if self.mtp is not None:
            self.mtp.prepare(n, loss_scale)
        self._loss_scale = loss_scale
        total = torch.zeros((), dtype=torch.float32, device=g.device)
        with self._autocast():
            self._forward_backward(tokens, targets, model_inputs, total)
        if g.cp > 1:  # each context rank's loss covers its share of the tokens
            dist.all_reduce(total, group=g.cp_group)
        if g.dp_ep > 1:
            dist.all_reduce(total, group=g.dp_ep_group)
            total /= g.dp_ep
        scaled = loss_scale != 1.0
        norm = self.optimizer.step(inv_scale=1.0 / loss_scale, skip_nonfinite=scaled)
        if self.float8 is not None:  # e.g. the next forward's float8 all-gathers use new scales
            for st in self.stages:
                self.float8.after_optimizer_step(st)
        router = self.router_stats.step() if self.router_stats is not None else {}
        if self.mtp_cfg is not None:  # the last stage's; tensor ranks agree, data and expert ranks average
            depth = self.mtp_cfg.depth
            names = ["mtp_loss"] + ([f"mtp_loss_{k}" for k in range(1, depth + 1)] if depth > 1 else [])
            mtp = self.mtp.metrics() if self.mtp is not None else {}
            t = torch.tensor([mtp.get(k, 0.0) for k in names], dtype=torch.float64, device=g.device)
            if g.pp > 1:
                dist.all_reduce(t, group=g.pp_group)
            if g.dp_ep > 1:
                dist.all_reduce(t, group=g.dp_ep_group)
            router.update(zip(names, (t / g.dp_ep).tolist()))
        return StepResult(loss=float(total), grad_norm=norm, stepped=not scaled or math.isfinite(norm), router=router)

    def _local(self, tokens: torch.Tensor, targets: torch.Tensor, model_inputs: dict[str, torch.Tensor] | None):
        """On this rank's device; under context parallel, cut to this rank's sequence chunks
        (tokens, targets, positions and document ids alike: they travel together)."""
        g, cp = self.groups, self.stages[0].cp
        inputs = {k: v.to(g.device) for k, v in (model_inputs or {}).items()}
        tokens, targets = tokens.to(g.device), targets.to(g.device)
        if cp is None:
            return tokens, targets, inputs
        if hasattr(self.objective, "context_split"):  # an objective that cuts its own inputs (after embedding)
            return self.objective.context_split(cp, tokens, targets, inputs)
        return cp.split(tokens), cp.split(targets), {k: cp.split(v) for k, v in inputs.items()}

    def _set_token_weight(self, targets: torch.Tensor) -> None:
        """per_token_loss: the weight turning a micro-batch's summed token loss into its share of the
        global mean, dp_ep / (counted tokens over all data x expert ranks), so that the average
        of the ranks' sums is the global mean. Collective over the data x expert group."""
        if not self.per_token_loss:
            return
        g = self.groups
        count = (targets != IGNORE_INDEX).sum().to(device=g.device, dtype=torch.float64)
        if g.dp_ep > 1:
            dist.all_reduce(count, group=g.dp_ep_group)
        self.token_count = int(count)
        self._token_weight = g.dp_ep / max(self.token_count, 1)

    def _micro_batch_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the batch loss, from the last stage's output (local-vocab logits)."""
        ctx = LossContext(self.groups.tp_group, self.num_microbatches * self.groups.cp, self.per_token_loss,
                          self._token_weight, self.groups.cp_group if self.groups.cp > 1 else None)
        return self.objective.loss(logits, targets, ctx)

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Record a micro-batch's loss, return the one to backpropagate (scaled for fp16)."""
        self._micro_losses.append(loss.detach().float())
        return loss * self._loss_scale if self._loss_scale != 1.0 else loss

    def _autocast_dtype(self) -> torch.dtype | None:
        """bf16 and fp8 (bf16 around the float8 matmuls) autocast to bf16, fp16 to fp16, over fp32 weights."""
        return _AUTOCAST.get(self.training.precision)

    def _autocast(self):
        dtype = self._autocast_dtype()
        if dtype is not None:
            return torch.autocast(self.groups.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def _forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, model_inputs: dict[str, torch.Tensor],
                          total: torch.Tensor) -> None:
        """All micro-batches of one step; adds the (micro-batch-scaled) losses into `total`."""
        g, n, mb = self.groups, self.num_microbatches, self.micro_batch
        if self.schedule is None:
            stage = self.stages[0]
            for i in range(n):
                rows = slice(i * mb, (i + 1) * mb)
                mtp = {"mtp_labels": targets[rows]} if self.mtp is not None else {}  # model.py's MTP loss
                logits = stage(tokens[rows], **{k: v[rows] for k, v in model_inputs.items()}, **mtp)
                loss = self._micro_batch_loss(logits, targets[rows])
                (loss * self._loss_scale if self._loss_scale != 1.0 else loss).backward()
                total += loss.detach()
        else:
            has_first = any(s.is_first for s in self.stages)
            has_last = any(s.is_last for s in self.stages)
            args = (tokens,) if has_first else ()
            self._micro_losses.clear()
            # model_inputs are split into micro-batches and given to every stage (kwargs).
            mtp = {"mtp_labels": targets, "mtp_tokens": tokens} if self.mtp_cfg is not None else {}  # last stage's MTP
            self.schedule.step(*args, target=targets if has_last else None, return_outputs=False, **model_inputs, **mtp)
            if has_last:
                total += torch.stack(self._micro_losses).sum()
            dist.all_reduce(total, group=g.pp_group)  # only the last stage contributed

    @torch.no_grad()
    def eval_step(self, tokens: torch.Tensor, targets: torch.Tensor,
                  model_inputs: dict[str, torch.Tensor] | None = None) -> float:
        """Mean token loss of a batch shaped as for `train_step`, forward only (no state change)."""
        tokens, model_inputs, targets = self.objective.split(tokens, targets, model_inputs)
        self._use_microbatches(tokens.shape[0])
        g, n, mb = self.groups, self.num_microbatches, self.micro_batch
        self._set_token_weight(targets)
        tokens, targets, model_inputs = self._local(tokens, targets, model_inputs)
        was_training = self.stages[0].training
        self.train(False)
        total = torch.zeros((), dtype=torch.float32, device=g.device)
        try:
            with self._autocast():
                if self.schedule is None:
                    for i in range(n):
                        rows = slice(i * mb, (i + 1) * mb)
                        logits = self.stages[0](tokens[rows], **{k: v[rows] for k, v in model_inputs.items()})
                        total += self._micro_batch_loss(logits, targets[rows])
                else:
                    has_first = any(s.is_first for s in self.stages)
                    has_last = any(s.is_last for s in self.stages)
                    self._micro_losses.clear()
                    self.schedule.eval(*((tokens,) if has_first else ()), target=targets if has_last else None,
                                       **model_inputs)
                    if has_last:
                        total += torch.stack(self._micro_losses).sum()
                    dist.all_reduce(total, group=g.pp_group)
        finally:
            self.train(was_training)
        if g.cp > 1:
            dist.all_reduce(total, group=g.cp_group)
        if g.dp_ep > 1:
            dist.all_reduce(total, group=g.dp_ep_group)
            total /= g.dp_ep
        return float(total)

    @torch.no_grad()
    def replica_divergence(self) -> float:
        """Largest difference between copies that must stay equal (0.0 when healthy): replicated
        parameters across tensor ranks, every parameter across data-parallel and context ranks,
        dense ones across expert ranks, and the two copies of a tied embedding; fully sharded
        (data_shard > 1), a parameter's only copies are its HSDP replicas (data shards, context and
        expert ranks hold different pieces). The persistent buffers (the MoE balancing bias) across
        data, context and expert ranks, sharded or not. Collective; for tests and debugging."""
        g = self.groups
        worst = torch.zeros((), dtype=torch.float32, device=g.device)

        def spread(t: torch.Tensor, group, size: int) -> None:
            copies = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(copies, t.contiguous(), group=group)
            for c in copies:
                worst.copy_(torch.maximum(worst, (c - t).abs().max().float()))

        for p in self.named_global_params().values():
            local = _local_data(p)
            if g.tp > 1 and getattr(p, "tp_shard_dim", None) is None:
                spread(local, g.tp_group, g.tp)
            if g.cp > 1 and g.dp_shard == 1:  # (FSDP: shards differ per context rank)
                spread(local, g.cp_group, g.cp)
            if g.ep > 1 and not is_expert_shard(p) and g.dp_shard == 1:  # (FSDP: dense shards differ per expert rank)
                spread(local, g.ep_group, g.ep)
            if g.dp_shard == 1 and g.dp > 1:
                spread(local, g.dp_group, g.dp)
            elif g.layout.data_replicate > 1:  # fully sharded: the copies are the HSDP replicas
                spread(local, g.dp_replicate_group, g.layout.data_replicate)
        for s in self.stages:
            for buf in s.global_buffers().values():
                for group, size in ((g.dp_group, g.dp), (g.cp_group, g.cp), (g.ep_group, g.ep)):
                    if size > 1:
                        spread(buf, group, size)
        if g.embedding_group is not None and self.decoder_cfg.tie_embeddings:  # (untied: no copies to compare)
            for s in self.stages:
                embed = decoder_of(s.model).embed_tokens
                if s.is_first and embed is not None:
                    spread(_local_data(embed.weight), g.embedding_group, 2)
                if s.is_last and s.tied_head is not None:
                    spread(_local_data(s.tied_head), g.embedding_group, 2)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return float(worst)

    # ---- checkpoint state -------------------------------------------------------------------
    def named_global_params(self) -> dict[str, torch.nn.Parameter]:
        getattr(self.optimizer, "wait_param_gather", lambda: None)()  # overlap_param_gather: weights read whole
        out: dict[str, torch.nn.Parameter] = {}
        for s in self.stages:
            out.update(s.global_params())
        return out

    def named_global_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores of the model: the parameters and the persistent buffers (the
        MoE balancing bias), under their one-process names."""
        out: dict[str, torch.Tensor] = dict(self.named_global_params())
        for s in self.stages:
            out.update(s.global_buffers())
        return out

    def _global_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.named_global_params().items()}

    def model_state_dict(self) -> dict[str, object]:
        """`model.<name>` -> global DTensor for every parameter and persistent buffer on this rank (DCP-ready)."""
        return model_state_dict(self.named_global_state(), self.groups)

    def optimizer_state_dict(self) -> dict[str, object]:
        """`optimizer.state.<name>.<key>` -> global DTensor, plus `optimizer.step` (collective)."""
        return self.optimizer.state_dict(self._global_names())

    def state_dict(self) -> dict[str, object]:
        return {**self.model_state_dict(), **self.optimizer_state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        load_model_state_dict(self.named_global_state(), state)  # type: ignore[arg-type]
        if any(k.startswith("optimizer.") for k in state):
            self.load_optimizer_state_dict(state)

    def load_optimizer_state_dict(self, state: dict[str, object]) -> None:
        """The `optimizer.*` entries of `state` (after the model's: masters are re-read from it)."""
        self.optimizer.load_state_dict(state, self._global_names())

    def save(self, directory: str) -> None:
        """Write model and optimizer state with DCP (collective over all ranks)."""
        dcp.save(self.state_dict(), checkpoint_id=directory)

    def load(self, directory: str, optimizer: bool = True) -> None:
        """Read a checkpoint saved under any layout (collective over all ranks)."""
        state = self.model_state_dict()
        if optimizer:
            state.update(self.optimizer_state_dict())
        dcp_load(state, directory, expected_digest=metadata_digest(directory))
        self.load_state_dict(state)
