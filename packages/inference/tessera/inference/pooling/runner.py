"""How the engine pools: an embed request's prompt runs through the model in one step (no decode),
and its hidden states are pooled into one vector.

`DecoderRunner` is the causal LM's runner (kinds.py): ModelRunner's paged forward, which computes
generation and embed requests side by side in one packed batch; the final-normed hidden states of
the embed requests' rows are pooled (last-token, mean or CLS). The vector goes back raw; the server
truncates (Matryoshka `dimensions`) and normalizes it, as the model's modules declare (spec.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from tessera.common.errors import UserError
from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.pooling.spec import PoolingSpec
from tessera.inference.worker.batch import ModelRunnerOutput, StepInputs
from tessera.inference.worker.model_runner import ModelRunner

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


class DecoderRunner(ModelRunner):
    """ModelRunner that also pools embed requests (set `pool_mode` to serve them)."""

    pool_mode: str | None = None
    _kept: torch.Tensor | None = None  # the step's hidden states, kept while a step pools

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        embed = [s.seq.params.embed for s in plan.scheduled]
        if not any(embed):
            return super().execute(plan)
        if self.pool_mode is None:
            raise RuntimeError("an embed request reached a runner without pooling")
        self._kept = torch.empty(0)  # a marker: _hidden keeps this step's states
        try:
            out = super().execute(plan)
            hidden = self._kept
        finally:
            self._kept = None
        offset = 0
        for s, e in zip(plan.scheduled, embed):
            if e:
                assert s.start == 0 and s.completes_prompt, "an embed request is scheduled whole"
                out.pooled[s.seq.request_id] = pool(self.pool_mode, hidden[offset:offset + s.num_new]).float().tolist()
            offset += s.num_new
        return out

    def _hidden(self, step: StepInputs) -> torch.Tensor:
        hidden = super()._hidden(step)
        if self._kept is not None:
            self._kept = hidden[0]
        return hidden


def embedding_spec(loaded, cfg, max_model_len: int, runner: ModelRunner) -> PoolingSpec | None:
    """The engine's pooling, its input bound set, with the runner told how to pool; None when the
    model declares no pooling or its runner cannot pool (a decoder under tensor parallel: logits
    come back, not hidden states; an encoder's workers pool)."""
    spec = loaded.pooling
    if spec is None:
        if not getattr(runner, "generates", True):
            raise UserError(f"{loaded.path}: an encoder serves embeddings only, and this one declares no pooling; "
                            "add sentence-transformers' modules.json and 1_Pooling/config.json (CLS, mean or "
                            "last-token)")
        return None
    if not hasattr(runner, "pool_mode"):
        why = f"under --tensor-parallel {cfg.tensor_parallel}" if cfg.tensor_parallel > 1 else "for this model kind"
        log.warning("%s declares %s pooling, but /v1/embeddings is not served %s", loaded.name, spec.mode, why)
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
