"""How the engine pools: an embed request's prompt runs through the model in one step (no decode),
and its hidden states are pooled into one vector.

`DecoderRunner` is the causal LM's runner (worker/kinds.py): ModelRunner's paged forward, which computes
generation and embed requests side by side in one packed batch; the final-normed hidden states of
the embed requests' rows are pooled (last-token, mean or CLS). The vector goes back raw; the server
truncates (Matryoshka `dimensions`) and normalizes it, as the model's modules declare (spec.py).

Under tensor parallel (`PoolingSteps`, worker/tensor_parallel/executor.py) the driver sends the embed requests'
row spans with the step; each worker's DecoderRunner pools them from the hidden states every rank
holds whole after the final norm, and rank 0 sends back only the pooled rows [E, d] beside the
logits, so the pipe carries one row per embed request, never a sequence's hidden states.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from tessera.common.errors import UserError
from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.worker.batch import BatchSeq, ModelRunnerOutput, StepInputs
from tessera.inference.worker.model_runner import ModelRunner
from tessera.inference.worker.pooling.spec import PoolingSpec

log = logging.getLogger("tessera.inference")


def pool(mode: str, hidden: torch.Tensor) -> torch.Tensor:
    """One sequence's hidden states [T, d] pooled to [d] (sentence-transformers' Pooling, no padding)."""
    if mode == "cls":
        return hidden[0]
    if mode == "mean":
        return hidden.float().mean(dim=0)
    if mode == "last":
        return hidden[-1]
    raise ValueError(f"unknown pooling mode {mode!r}")


def pool_rows(mode: str, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Each (first row, rows) span of a step's packed hidden states [T, d] pooled: [E, d] fp32."""
    return torch.stack([pool(mode, hidden[o:o + n]).float() for o, n in spans])


class PoolingSteps:
    """`execute` for a runner that pools embed requests beside generation (one process or the
    tensor-parallel driver): its `forward` sets `_pooled` [E, d] for `_pool_spans`, the embed
    requests' (first row, rows) in the packed step."""

    pools = True  # embedding_spec serves /v1/embeddings through it
    pool_mode: str | None = None
    _pool_spans: list[tuple[int, int]] | None = None  # set while a step pools
    _pooled: torch.Tensor | None = None

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        spans, ids, offset = [], [], 0
        for s in plan.scheduled:
            if s.seq.params.embed:
                assert s.start == 0 and s.completes_prompt, "an embed request is scheduled whole"
                spans.append((offset, s.num_new))
                ids.append(s.seq.request_id)
            offset += s.num_new
        if not spans:
            return super().execute(plan)
        if self.pool_mode is None:
            raise RuntimeError("an embed request reached a runner without pooling")
        self._pool_spans = spans
        try:
            out = super().execute(plan)
            pooled = self._pooled
        finally:
            self._pool_spans = self._pooled = None
        assert pooled is not None and len(pooled) == len(ids), "the step's forward pooled its embed requests"
        for rid, vector in zip(ids, pooled.tolist()):
            out.pooled[rid] = vector
        return out


class DecoderRunner(PoolingSteps, ModelRunner):
    """ModelRunner that also pools embed requests (set `pool_mode` to serve them)."""

    def forward_pooled(self, batch: list[BatchSeq], logits_rows: list[int], mode: str,
                       spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A tensor-parallel worker's step: this rank's logits slice and the pooled rows [E, d]."""
        self.pool_mode, self._pool_spans = mode, spans
        try:
            logits = self.forward_batch(batch, logits_rows)
            pooled = self._pooled
        finally:
            self._pool_spans = self._pooled = None
        assert pooled is not None
        return logits, pooled

    def forward_batch(self, batch: list[BatchSeq], logits_rows: list[int]) -> torch.Tensor:
        if self._pool_spans is not None and self.decode_graphs is not None:
            # Decode graphs keep no hidden states: a step that pools (one-token inputs look like decodes) runs eagerly.
            return self._logits(self.prepare(batch, logits_rows)).float()
        return super().forward_batch(batch, logits_rows)

    forward_batch.same_single_token_forward = True  # type: ignore[attr-defined]  # an embed step is never one

    def _hidden(self, step: StepInputs) -> torch.Tensor:
        return self._pool_hidden(super()._hidden(step))

    _hidden.same_single_token_forward = True  # type: ignore[attr-defined]  # pools only in an embed step

    def _pool_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step's hidden states [1, T, d], unchanged; while it pools, its embed spans pooled first."""
        if self._pool_spans is not None:
            self._pooled = pool_rows(self.pool_mode, hidden[0], self._pool_spans)
        return hidden


def check_pooling(loaded, generates: bool) -> None:
    """Refuse an encoder that declares no pooling (it would serve nothing), before any worker starts."""
    if loaded.pooling is None and not generates:
        raise UserError(f"{loaded.path}: an encoder serves embeddings only, and this one declares no pooling; "
                        "add sentence-transformers' modules.json and 1_Pooling/config.json (CLS, mean or "
                        "last-token)")


def embedding_spec(loaded, cfg, max_model_len: int, runner: ModelRunner) -> PoolingSpec | None:
    """The engine's pooling, its input bound set, with the runner told how to pool; None when the
    model declares no pooling or its runner cannot pool (a kind whose runner keeps no hidden states)."""
    spec = loaded.pooling
    if spec is None:  # an encoder without it was refused before (check_pooling)
        return None
    if not getattr(runner, "pools", False):
        log.warning("%s declares %s pooling, but /v1/embeddings is not served for model kind %r", loaded.name,
                    spec.mode, loaded.config.kind)
        return None
    runner.pool_mode = spec.mode
    bound = min(max_model_len, cfg.max_num_batched_tokens, spec.max_seq_length or max_model_len)
    return replace(spec, max_input_tokens=bound)


def embed_problem(spec: PoolingSpec | None, num_tokens: int) -> str | None:
    """Why the engine cannot embed an input of `num_tokens` (the server checks first, naming the
    input's index), or None."""
    if spec is None:
        return "this model declares no pooling: it serves no embeddings"
    if num_tokens > spec.max_input_tokens:
        return f"an input of {num_tokens} tokens is longer than the {spec.max_input_tokens} this server embeds"
    return None
