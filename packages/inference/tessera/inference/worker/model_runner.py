"""Executes one step's plan (`scheduler.SchedulerOutput`) through the model and samples.

`prepare` packs every scheduled sequence's new tokens into one [1, T] batch (batch.StepInputs);
the layer stack runs eagerly, compiled (CPU: compiled.py) or, for a pure decode step, from padded
graphs (cuda_graphs.py), and its attention hook writes the new K/V into the paged cache and attends
(`tessera.kernels.paged_attention`; on CPU decode rows in groups: decode_attention.py). Only the
rows to sample go through the output head; `execute` samples them (batch.ModelRunnerOutput). The
runner reads the sequences and never changes them (the output processor applies the results), so
a failed execution leaves nothing half-applied and can be retried: the KV slots it wrote are
rewritten with the same values.

A sequence scheduled with k draft tokens computes its newest token and the drafts in one row of
1 + k tokens; `sampler.verify` accepts a prefix of them. The K/V of rejected drafts sit past the
computed length, where nothing reads them, until later tokens overwrite them. Sliding-window layers
pass their window to every attention path; blocks wholly outside every window stay allocated.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from tessera.common.models.causal_lm.model import Transformer
from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.sample.sampler import DeferredRows, Sampler, samples_ahead, token_logprob, verify
from tessera.inference.worker.batch import (
    SAMPLING_FAILED,
    BatchSeq,
    DecodeBatch,
    DecodeUpdate,
    LaunchedStep,
    ModelRunnerOutput,
    StepInputs,
    batch_seqs,
    host_to_device,
)
from tessera.inference.worker.cuda_graphs import DecodeGraphs, GraphSpec
from tessera.inference.worker.decode_attention import decode_split, split_attention
from tessera.inference.worker.kv_cache import kv_block_bytes, local_kv_heads, store_kv
from tessera.kernels import paged_attention

if TYPE_CHECKING:
    from tessera.inference.worker.compiled import CompiledForward

log = logging.getLogger("tessera.inference")
_KEEPS_DECODE_BATCH: dict[type, bool] = {}  # ModelRunner.keeps_decode_batch, by class


def undivided(tp: int, counts: list[tuple[str, int | None]]) -> str | None:
    """The phrase a kind's `tensor_parallel_problem` returns for the first (what, count) that `tp`
    does not divide (None counts: the config has no such part), or None when it divides them all."""
    for what, n in counts:
        if n is not None and n % tp:
            return f"must divide the {n} {what}"
    return None


class ModelRunner:
    """Executes plans on one device (`forward`); under tensor parallel the engine uses
    `executor.TensorParallelRunner`, which keeps `execute` (sampling on the driver) and sends
    `forward` to the workers, each of which runs a ModelRunner over its shard."""

    # Pure decode steps go through bucket-padded CUDA graphs once the engine calls
    # `use_decode_graphs` (cuda_graphs.py); everything else runs below.
    decode_graphs: DecodeGraphs | None = None
    # On CPU the layer stack runs through inductor when the engine sets this (compiled.py).
    compiled: CompiledForward | None = None
    # (the pool, per layer its K/V views): `_layer_kv`, rebuilt when the pool is replaced.
    _kv_views: tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]] | None = None
    # Why a kind's runner is never compiled on CPU (prepare.py serves it eagerly and says so); None:
    # compiled.py's own checks decide.
    eager_reason: str | None = None
    # Single-token steps' inputs, kept across steps (batch.DecodeBatch); made by the first such step.
    decode_batch: DecodeBatch | None = None
    supports_speculative = True  # drafts can be verified and rejected (nothing but K/V past the length to undo)

    @staticmethod
    def block_bytes(cfg, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
        """Bytes one KV block takes on one tensor rank (the engine sizes the pool by it)."""
        return kv_block_bytes(cfg, block_size, dtype, tp)

    @staticmethod
    def prepare_model(model) -> None:
        """Change the model's modules for this runner, before prepare.py merges and packs them."""

    @staticmethod
    def state_bytes_per_sequence(cfg, dtype: torch.dtype, tp: int = 1) -> int:
        """Bytes of one sequence's slot in a per-sequence state pool on one tensor rank (0: none)."""
        return 0

    @classmethod
    def serving_kwargs(cls, prep) -> dict:
        """Constructor arguments beyond the common ones, from prepare.ServingPrep."""
        return {}

    def state_summary(self) -> str | None:
        """A per-sequence state pool beside the KV cache, or what else the startup line says of the cache, in words (None: nothing)."""
        return None

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, kv_dtype: torch.dtype | None = None):
        cfg = model.cfg
        self.model = model
        self.cfg = cfg
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # One allocation for the whole pool: [layer, K/V, block, slot, kv_head, head_dim]; under
        # tensor parallel this rank's key/value heads only (those of its query heads), stored in
        # `kv_dtype` (default: the model's; fp8 with --kv-cache-dtype) with per-tensor K and V scales.
        self.kv = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, local_kv_heads(cfg, tp_size), cfg.head_dim,
                              device=device, dtype=kv_dtype or dtype)
        self.kv_scales = (1.0, 1.0)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # The Triton kernel handles mixed batches in one launch; only CPU needs the split.
        self.batch_decodes = device.type == "cpu"
        self.sampler = Sampler()

    @classmethod
    def keeps_decode_batch(cls) -> bool:
        """Whether single-token steps take their inputs from the persistent `DecodeBatch`: only when
        this runner forwards them as ModelRunner does (a runner that prepares or attends otherwise:
        hybrid states, an encoder, keeps `prepare`; the tensor-parallel driver asks its workers' runner).
        An override tagged `same_single_token_forward` differs only on steps that are never
        single-token, or takes a single-token step's StepInputs as DecodeBatch and DecodeGraphs build
        them (with the CPU split or none: latent attention's)."""
        keeps = _KEEPS_DECODE_BATCH.get(cls)
        if keeps is None:
            keeps = _KEEPS_DECODE_BATCH[cls] = all(
                getattr(cls, name) is getattr(ModelRunner, name)
                or getattr(getattr(cls, name), "same_single_token_forward", False)
                for name in ("forward", "forward_batch", "prepare", "_hidden", "_attention", "_logits"))
        return keeps

    def use_decode_graphs(self, spec: GraphSpec) -> None:
        """Pure decode steps from now on through bucket-padded graphs of this runner's forward."""
        self.decode_graphs = self._graphs_of(spec, self._logits)

    def _graphs_of(self, spec: GraphSpec, forward) -> DecodeGraphs:
        """DecodeGraphs over `forward(step) -> fp32 logits` (a subclass's padded forward)."""
        return DecodeGraphs(spec, self.device, self.block_size, self.model.output_weight().shape[0], forward)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the plan, then sample each sequence that reached its last token and compute
        the prompt logprobs asked for."""
        if plan.single_token and self.keeps_decode_batch():
            return self._execute_single_token(plan)
        if self.decode_batch is not None:
            self.decode_batch.clear()
        rows: list[int] = []
        sample: list[tuple[int, int]] = []  # (index in plan, logits row)
        prompt_lp: list[tuple[int, int, int, int]] = []  # (index in plan, first position, last, first row)
        speculative: list[tuple[int, int]] = []  # (index in plan, first of its k + 1 logits rows)
        offset = 0
        for i, s in enumerate(plan.scheduled):
            seq = s.seq
            if seq.params.prompt_logprobs:
                # Position p predicts prompt token p+1; record each position once (recompute
                # after preemption must not duplicate).
                first = max(s.start, len(seq.prompt_logprobs))
                last = min(s.end, len(seq.prompt_ids) - 1)
                if first < last:
                    prompt_lp.append((i, first, last, len(rows)))
                    rows.extend(range(offset + first - s.start, offset + last - s.start))
            if s.spec_token_ids:
                k = len(s.spec_token_ids)
                speculative.append((i, len(rows)))
                rows.extend(range(offset + s.num_new - k - 1, offset + s.num_new))
            elif s.completes_prompt and seq.params.max_tokens > 0:
                sample.append((i, len(rows)))
                rows.append(offset + s.num_new - 1)
            offset += s.num_new
        out = ModelRunnerOutput()
        logits = self.forward(plan, rows)
        if prompt_lp:
            logprobs = torch.log_softmax(logits, dim=-1)
            for i, first, last, row in prompt_lp:
                seq = plan.scheduled[i].seq
                out.prompt_logprobs[seq.request_id] = [
                    token_logprob(logprobs[row + p - first], seq.prompt_ids[p + 1], seq.params.logprobs or 0)
                    for p in range(first, last)]
        if sample:
            seqs = [plan.scheduled[i].seq for i, _ in sample]
            # Only sampled rows went through the head (no prompt logprobs, no drafts): they are the sample's rows, in order.
            rows_in_order = len(rows) == len(sample)
            self._sample(out, seqs, logits if rows_in_order else logits[[r for _, r in sample]])
        for i, row in speculative:
            s = plan.scheduled[i]
            seq = s.seq
            block = logits[row:row + len(s.spec_token_ids) + 1]
            try:
                new = verify(seq, s.spec_token_ids, s.spec_probs, block)
            except Exception as exc:
                log.error("request %s: verifying draft tokens failed: %s: %s", seq.request_id, type(exc).__name__, exc)
                out.failed[seq.request_id] = SAMPLING_FAILED
                continue
            out.sampled[seq.request_id] = new
            if seq.params.logprobs is not None:
                lp = torch.log_softmax(block[:len(new)], dim=-1)
                out.logprobs[seq.request_id] = [token_logprob(lp[j], t, seq.params.logprobs) for j, t in enumerate(new)]
        return out

    def _execute_single_token(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """A steady decode step: inputs from the persistent batch, every row through the head and sampled."""
        logits = self._single_token_logits(plan)
        out = ModelRunnerOutput()
        self._sample(out, self.decode_batch.seqs, logits)  # the plan's sequences, in its order
        return out

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput, previous: LaunchedStep | None = None,
               rows: list[int | None] | None = None) -> LaunchedStep:
        """Async scheduling: start a step (no drafts, prompt logprobs or pooling) and return without
        reading its tokens back (on CPU the step has run when this returns). With `previous`, the step
        still in flight: row i's input is the token `previous` sampled at index rows[i] (None: tokens
        the host knows), read on the device (the sequences do not hold it yet); such a row computes
        that one token and samples. Rows that `samples_ahead` are sampled here; a grammar's row waits
        for its mask (`LaunchedStep.finish_sampling`, once the step before is applied)."""
        if plan.single_token:
            tokens = None
            if previous is not None:
                assert rows is not None
                tokens = previous.tokens
                if len(rows) != len(tokens):  # rows are increasing: as many as the tokens means all, in order
                    tokens = tokens.index_select(0, host_to_device(torch.tensor(rows), tokens.device))
            logits = self._single_token_logits(plan, tokens)
            sampled = list(range(len(plan.scheduled)))
            pending = [None] * len(sampled) if tokens is None else [tokens[i:i + 1] for i in sampled]
            return self._sample_launched(plan, sampled, self.decode_batch.seqs, logits, pending)
        if self.decode_batch is not None:
            self.decode_batch.clear()
        rows = rows or [None] * len(plan.scheduled)
        batch = batch_seqs(plan)
        logits_rows: list[int] = []
        sampled: list[int] = []
        fed: list[tuple[int, int]] = []  # (packed row, index in previous.tokens)
        fed_rows: list[int | None] = []  # per sampled row: its packed row when fed
        offset = 0
        for i, (s, j) in enumerate(zip(plan.scheduled, rows)):
            if j is not None:  # its newest token is in flight: a placeholder, replaced on the device below
                batch[i] = replace(batch[i], tokens=[0], num_q=1)
                fed.append((offset, j))
            if j is not None or s.completes_prompt and s.seq.params.max_tokens > 0:
                sampled.append(i)
                logits_rows.append(offset + s.num_new - 1)
                fed_rows.append(offset if j is not None else None)
            offset += s.num_new
        step = self.prepare(batch, logits_rows)
        if fed:
            assert previous is not None
            at, src = (host_to_device(torch.tensor(x), self.device) for x in zip(*fed))
            step.tokens[0].index_copy_(0, at, previous.tokens.index_select(0, src))
        logits = self._logits(step).float()  # a step that samples nothing still writes its chunks' K/V
        if not sampled:
            return LaunchedStep.start(plan, sampled, torch.empty(0, dtype=torch.long, device=self.device))
        seqs = [plan.scheduled[i].seq for i in sampled]
        pending = [None if r is None else step.tokens[0, r:r + 1] for r in fed_rows]
        return self._sample_launched(plan, sampled, seqs, logits, pending)

    def _sample_launched(self, plan: SchedulerOutput, sampled: list[int], seqs: list, logits: torch.Tensor,
                         pending: list[torch.Tensor | None]) -> LaunchedStep:
        """The launched step's tokens: every row's now, or, with grammar rows, the others' now and
        theirs deferred, in one tensor that `finish_sampling` completes in place (the next step's
        inputs read it as they read any)."""
        waiting = [k for k, seq in enumerate(seqs) if not samples_ahead(seq)]
        if not waiting:
            return LaunchedStep.start(plan, sampled, *self.sampler.sample_on_device(seqs, logits, pending,
                                                                                    self._to_device))
        tokens = torch.zeros(len(seqs), dtype=torch.long, device=logits.device)
        if ahead := [k for k in range(len(seqs)) if samples_ahead(seqs[k])]:
            at = self._to_device(torch.tensor(ahead))
            tokens.index_copy_(0, at, self.sampler.choose_on_device(
                [seqs[k] for k in ahead], logits.index_select(0, at), [pending[k] for k in ahead], self._to_device))
        return LaunchedStep.start(plan, sampled, tokens, deferred=DeferredRows(list(seqs), logits, waiting,
                                                                               self._to_device))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return host_to_device(t, self.device)

    def _single_token_logits(self, plan: SchedulerOutput, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of every row of a steady decode step, its inputs from the persistent batch;
        `tokens` [rows] on the device replace the sequences' newest tokens (async scheduling)."""
        if self.decode_batch is None:
            self.decode_batch = DecodeBatch(self.block_size)
        return self.decode_logits(self.decode_batch.plan_update(plan), tokens)

    def decode_logits(self, update: DecodeUpdate, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`_single_token_logits` from the step's update to the persistent batch (a tensor-parallel
        worker gets it from the driver, which plans it: this rank's vocabulary slice then)."""
        if self.decode_batch is None:
            self.decode_batch = DecodeBatch(self.block_size)
        graphs, size = self.decode_graphs, None
        if graphs is not None:
            size = graphs.step_bucket(len(update.starts), max(update.starts) // self.block_size + 1)
        # The CPU grouping only (SteadySplit keeps host tensors); a runner that splits on CUDA too
        # (latent/) attends a step without a split through the kernel.
        step = self.decode_batch.apply(update, split=self.batch_decodes and size is None and self.device.type == "cpu")
        if tokens is not None:
            step.tokens = tokens.view(1, -1)
        if size is not None:
            return graphs.forward_step(step, size)
        return self._logits(step.to(self.device)).float()

    def _sample(self, out: ModelRunnerOutput, seqs: list, logits: torch.Tensor) -> None:
        """Sample one token for each of `seqs` from its row of `logits` into `out`."""
        tokens, lps, failed = self.sampler(seqs, logits)
        if not failed and not any(lps):  # the common step: one dict, no per-row branches
            out.sampled.update(zip([seq.request_id for seq in seqs], [[t] for t in tokens]))
            return
        for j, seq in enumerate(seqs):
            if j in failed:
                log.error("request %s: sampling failed: %s: %s", seq.request_id, type(failed[j]).__name__, failed[j])
                out.failed[seq.request_id] = SAMPLING_FAILED
                continue
            out.sampled[seq.request_id] = [tokens[j]]
            if lps[j] is not None:
                out.logprobs[seq.request_id] = [lps[j]]

    def forward(self, plan: SchedulerOutput, logits_rows: list[int]) -> torch.Tensor:
        """Forward the step; returns fp32 logits [len(logits_rows), vocab]."""
        return self.forward_batch(batch_seqs(plan), logits_rows)

    def forward_batch(self, batch: list[BatchSeq], logits_rows: list[int]) -> torch.Tensor:
        """fp32 logits [len(logits_rows), vocab rows]; under tensor parallel this rank's vocabulary
        slice [len(logits_rows), vocab rows / tp] (the worker gathers them)."""
        if self.decode_graphs is not None and self.decode_graphs.bucket(batch) is not None:
            return self.decode_graphs.forward(batch, logits_rows)  # pure decode: padded, replayed
        return self._logits(self.prepare(batch, logits_rows)).float()

    def prepare(self, batch: list[BatchSeq], logits_rows: list[int]) -> StepInputs:
        """The step packed: tokens and positions [1, T], each new token's KV slot, block tables,
        lengths, row offsets, and on CPU which rows attend as decode groups."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        bs = self.block_size
        for s in batch:
            start, n, table = s.start, s.num_new, s.block_table
            tokens.extend(s.tokens)
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(start + n)
            starts.append(starts[-1] + n)
        width = max(len(s.block_table) for s in batch)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch]
        # Built on the host, then copied without waiting for the device (host_to_device).
        inputs = StepInputs(
            tokens=torch.tensor([tokens], dtype=torch.long),
            positions=torch.tensor([positions], dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
        ).to(self.device)
        num_q = [s.num_q for s in batch]
        if self.batch_decodes and any(num_q):
            inputs.split = decode_split(num_q, starts, inputs.block_tables, inputs.seq_lens, self.block_size)
        return inputs

    def _logits(self, step: StepInputs) -> torch.Tensor:
        """The step through the layer stack (compiled or eager) and the output head, in the model's
        dtype, for step.logits_rows (None: every row). Padded vocabulary rows come out at -inf."""
        hidden = self._hidden(step)
        rows = hidden[0] if step.logits_rows is None else hidden[0].index_select(0, step.logits_rows)
        weight = self.model.output_weight()
        return self.model.logits(rows, weight, vocab_start=self.tp_rank * weight.shape[0])

    def _hidden(self, step: StepInputs) -> torch.Tensor:
        """The step's final-normed hidden states [1, T, d] (compiled or eager); pooling runners read them too."""
        attention = partial(self._attention, step)
        if self.compiled is not None:
            return self.compiled(step.tokens, step.positions, attention)
        return self.model(step.tokens, positions=step.positions, attention_fn=attention, return_hidden=True)

    def _attention(self, step: StepInputs, layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
        """The model's attention hook for one step: the new K/V into their cache slots, then paged
        attention (on CPU decode rows through the grouped path, decode_attention.py)."""
        k_cache, v_cache, flat_k, flat_v = self._layer_kv(layer)
        k_scale, v_scale = self.kv_scales
        store_kv(flat_k, step.slot_mapping, k[0], k_scale)
        store_kv(flat_v, step.slot_mapping, v[0], v_scale)
        window = self.cfg.window(layer)
        if step.split is None:
            out = paged_attention(q[0], k_cache, v_cache, step.block_tables, step.seq_lens,
                                  step.query_start_loc, self.scale, window, k_scale=k_scale, v_scale=v_scale)
        else:
            out = split_attention(q[0], k_cache, v_cache, step.split, self.scale, window, self.kv_scales)
        return out.unsqueeze(0)

    def _layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of one layer's pools, made once per pool rather than once per layer and step:
        K and V [blocks, block_size, Hkv, D] and the same as [slots, Hkv, D]. Made outside inference
        mode: a view made inside it could not be written outside it (a forward without it)."""
        views = self._kv_views
        if views is None or views[0] is not self.kv:
            layers = []
            with torch.inference_mode(False):
                for kv in self.kv:
                    k, v = kv[0], kv[1]
                    layers.append((k, v, k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])))
            views = self._kv_views = (self.kv, layers)
        return views[1][layer]
