"""The tensor-parallel driver's model runner: the engine's `ModelRunner` with no weights, whose
forwards run on the workers (executor.py).

Async scheduling (`--async-scheduling`) here: the sampler is on the driver, so a step's tokens exist
only once its logits rows are back. Launching a step therefore first finishes the one in flight
(waits for its rows and samples them: `PendingStep.resolve`), then sends the new one with those
tokens in place and returns without waiting; the engine then applies the step before (output
updates, detokenizing, the server's outputs) and plans the next step while the workers run this
one. What stays between two forwards is the pipe, the driver's sampling and the send.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial

import torch

from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.core.sequence import Sequence
from tessera.inference.sample.sampler import Sampler, samples_ahead
from tessera.inference.worker.batch import (
    SAMPLING_FAILED,
    DecodeBatch,
    DecodeUpdate,
    LaunchedStep,
    ModelRunnerOutput,
    batch_seqs,
)
from tessera.inference.worker.model_runner import ModelRunner
from tessera.inference.worker.pooling.runner import PoolingSteps
from tessera.inference.worker.tensor_parallel.executor import TensorParallelExecutor, WorkerDied

log = logging.getLogger("tessera.inference")


class TensorParallelRunner(PoolingSteps, ModelRunner):
    """The driver's model runner: `execute` (which rows to compute, sampling, verifying drafts,
    pooling embed requests) is ModelRunner's own; `forward` runs on the workers. It holds no
    weights and no KV cache."""

    def __init__(self, executor: TensorParallelExecutor, device: torch.device):  # noqa: D107 - no super(): no model
        self.executor = executor
        self.device = device
        self.block_size = executor.block_size
        self.sampler = Sampler()

    @property
    def pools(self) -> bool:
        return self.executor.pools

    # Set by the MTP proposer (spec_decode/mtp.py): request id -> (start, rows) of the last step,
    # whose hidden rows the workers keep.
    step_rows: dict[str, tuple[int, int]] | None = None

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """A steady decode step goes as an update to the workers' persistent batches (unless the
        MTP keeps hidden rows, which its `step` command carries); any other as its sequences."""
        if plan.single_token and self.executor.decode_batch and self.step_rows is None:
            return self._execute_single_token(plan)
        return super().execute(plan)

    def decode_logits(self, update: DecodeUpdate, tokens: torch.Tensor | None = None) -> torch.Tensor:
        # A step that fails on its way leaves the workers' batches behind the driver's: harmless, as
        # a row is kept only when its sequence advanced by one, i.e. when the step before it ran.
        assert tokens is None, "a launched step's tokens go in its update (`launch`)"
        return self.executor.forward_decode(update, self.device)

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput, previous: PendingStep | None = None,
               rows: list[int | None] | None = None) -> PendingStep:
        """`ModelRunner.launch` under tensor parallel: `previous` is finished first (its rows read and
        sampled), row i's input is then the token it sampled at index rows[i] (None: tokens the host
        knows), and the step is sent without waiting for its rows (module docstring)."""
        host = None if previous is None else previous.resolve().tokens.tolist()
        rows = rows or [None] * len(plan.scheduled)
        if plan.single_token and self.executor.decode_batch:
            if self.decode_batch is None:
                self.decode_batch = DecodeBatch(self.block_size)
            update = self.decode_batch.plan_update(plan)
            for i, j in enumerate(rows):
                if j is not None:
                    update.tokens[i] = host[j]
            sampled = list(range(len(plan.scheduled)))
            seqs = self.decode_batch.seqs
            send = partial(self.executor.send_decode, update)
        else:
            if self.decode_batch is not None:
                self.decode_batch.clear()
            batch = batch_seqs(plan)
            sampled, logits_rows, offset = [], [], 0
            for i, (s, j) in enumerate(zip(plan.scheduled, rows)):
                if j is not None:  # its newest token, sampled by `previous`, is not in its sequence yet
                    batch[i] = replace(batch[i], tokens=[host[j]], num_q=1)
                if j is not None or s.completes_prompt and s.seq.params.max_tokens > 0:
                    sampled.append(i)
                    logits_rows.append(offset + s.num_new - 1)
                offset += s.num_new
            seqs = [plan.scheduled[i].seq for i in sampled]
            send = partial(self.executor.send_step, batch, logits_rows)
        send()  # last: a launch that raised after it would leave the workers' answer unread
        return PendingStep(self, plan, sampled, seqs)

    def forward(self, plan: SchedulerOutput, logits_rows: list[int]) -> torch.Tensor:
        hidden = None
        if self.step_rows is not None:
            self.step_rows.update({s.seq.request_id: (s.start, s.num_new) for s in plan.scheduled})
            hidden = [s.seq.request_id for s in plan.scheduled]
        pooling = None if self._pool_spans is None else (self.pool_mode, self._pool_spans)
        logits, pooled = self.executor.forward_pooled(batch_seqs(plan), logits_rows, self.device, pooling, hidden)
        if pooling is not None:
            self._pooled = pooled
        return logits

    def state_summary(self) -> str | None:
        return self.executor.state

    def close(self) -> None:
        self.executor.shutdown()


@dataclass
class WaitingRows:
    """A pending step's rows whose sampling waits for their grammar masks: their sequences
    (`DeferredRows.waiting`), known before the step's rows are back."""

    seqs: list[Sequence]

    def waiting(self) -> list[Sequence]:
        return self.seqs


class PendingStep:
    """A step sent to the workers whose logits rows have not been read (async scheduling under
    tensor parallel): the engine uses it as the `LaunchedStep` it becomes once they are read and
    sampled (`resolve`), which what needs its tokens waits for."""

    def __init__(self, runner: TensorParallelRunner, plan: SchedulerOutput, sampled: list[int], seqs: list[Sequence]):
        self.plan, self.sampled = plan, sampled
        self._runner, self._seqs = runner, seqs
        self._step: LaunchedStep | None = None
        waiting = [seq for seq in seqs if not samples_ahead(seq)]
        self._waiting = WaitingRows(waiting) if waiting else None

    @torch.inference_mode()
    def resolve(self) -> LaunchedStep:
        """The launched step, its rows read from the workers and sampled (once). A sampling that
        raises beyond one row's failure fails the step's requests, as `LaunchedStep.fail_deferred`; so
        does a read that raises once its frames are taken (never read again: nothing would answer)."""
        if self._step is None:
            runner = self._runner
            try:
                logits = runner.executor.recv_logits(runner.device)[0]
                if not self.sampled:  # prompt chunks only: their K/V is written, nothing is sampled
                    self._step = LaunchedStep.start(self.plan, [], torch.empty(0, dtype=torch.long, device=runner.device))
                else:
                    # Sampled later than on one device, which samples at launch: a step is resolved only
                    # once the engine has applied the step before it, so every sequence already holds the
                    # token it was fed, and none is in flight for penalties or min_tokens to count.
                    self._step = runner._sample_launched(self.plan, self.sampled, self._seqs, logits.float(),
                                                         [None] * len(self.sampled))
            except WorkerDied:
                raise  # the engine ends
            except Exception:
                log.exception("reading or sampling a launched tensor-parallel step failed: its requests fail")
                step = LaunchedStep.start(self.plan, self.sampled,
                                          torch.zeros(len(self.sampled), dtype=torch.long, device=runner.device))
                step.failed = {self.plan.scheduled[i].seq.request_id: SAMPLING_FAILED for i in self.sampled}
                self._step = step
        return self._step

    @property
    def deferred(self) -> WaitingRows | None:
        """Its grammar rows (their sequences), until `finish_sampling`; known without its rows."""
        return self._waiting

    @property
    def tokens(self) -> torch.Tensor:
        return self.resolve().tokens

    def finish_sampling(self) -> dict[str, Exception]:
        self._waiting = None
        step = self.resolve()
        return {} if step.deferred is None else step.finish_sampling()  # None: its sampling failed whole

    def fail_deferred(self) -> None:
        self._waiting = None
        step = self.resolve()
        if step.deferred is not None:
            step.fail_deferred()

    def output(self) -> ModelRunnerOutput:
        return self.resolve().output()
