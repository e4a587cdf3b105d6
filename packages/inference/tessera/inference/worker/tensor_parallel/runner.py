"""The tensor-parallel driver's model runner: the engine's `ModelRunner` with no weights, whose
forwards run on the workers (executor.py)."""

from __future__ import annotations

import torch

from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.sample.sampler import Sampler
from tessera.inference.worker.batch import (
    DecodeUpdate,
    ModelRunnerOutput,
    batch_seqs,
)
from tessera.inference.worker.model_runner import ModelRunner
from tessera.inference.worker.pooling.runner import PoolingSteps
from tessera.inference.worker.tensor_parallel.executor import TensorParallelExecutor


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
        assert tokens is None, "no async scheduling under tensor parallel"
        return self.executor.forward_decode(update, self.device)

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
