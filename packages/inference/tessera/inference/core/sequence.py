"""One request's state inside the engine: its tokens, progress and stop state (its KV blocks are
the block manager's: `BlockManager.tables`)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.inference.core.detokenizer import IncrementalDetokenizer
from tessera.inference.core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The logprob of one chosen token, and the top-n alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    eos_ids: frozenset[int]
    max_model_len: int
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first scheduled (the end of its queue time)
    first_token_time: float | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # Tokens whose K/V are in the cache. Recompute-preemption resets it to 0; chunked prefill
    # advances it by the chunk; a prefix-cache hit starts it past the shared blocks.
    num_computed: int = 0
    block_hashes: list = field(default_factory=list)  # prefix-cache keys of its full blocks (int or bytes)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    finish_reason: str | None = None
    stop_token: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # handed out with the first output
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # since the last output
    num_preemptions: int = 0
    error: str | None = None  # why computing this request failed (finish_reason "error")
    client_error: bool = False  # the request's own doing (its grammar hit a limit): a 4xx, not a 500
    matcher: Any = None  # llguidance LLMatcher of a structured-output request (structured.py)
    # Speculative decoding (spec_decode/proposers.py): draft tokens proposed to follow the newest token, to be
    # verified by the next step, and for a draft model the distributions they were drawn from
    # ([k, vocab]; None for n-gram proposals, a point mass, and for greedy requests).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    ahead_mask: Any = None  # its next-token mask computed during the forward (structured.AheadMask)
    embedding: list[float] | None = None  # an embed request's pooled hidden state (worker/pooling/)
    # Greedy with no logprobs, penalties, bias or min_tokens: the sampler's argmax-only rows (with no grammar).
    plain: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain = (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
                      and not p.frequency_penalty and not p.logit_bias and not p.min_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token: int) -> None:
        """Add a sampled token and decide whether the sequence stops here."""
        self.output_ids.append(token)
        p = self.params
        n_out = len(self.output_ids)
        stopped = self.detokenizer.append(token, check_stop=n_out >= p.min_tokens)
        if not p.ignore_eos and token in self.eos_ids and n_out > p.min_tokens:
            self._finish("stop", token)
        elif token in p.stop_token_ids and n_out > p.min_tokens:
            self._finish("stop", token)
        elif stopped is not None:
            self._finish("stop", stopped)
        elif n_out >= p.max_tokens or len(self.prompt_ids) + n_out >= self.max_model_len:
            self._finish("length", None)

    def _finish(self, reason: str, stop: int | str | None) -> None:
        self.finish_reason = reason
        self.stop_token = stop
        self.status = Status.FINISHED
        # EOS and stop ids never reach the text; the held-back tail is released.
        self.detokenizer.finish(drop_last_token=isinstance(stop, int), flush=stop is None)

    def fail(self, error: str, client: bool = False) -> None:
        """Computing this request raised: it ends here with an error, its batch mates go on."""
        self.error = error
        self.client_error = client
        self.finish_reason = "error"
        self.status = Status.FINISHED
        self.new_logprobs = []

    def abort(self) -> None:
        if not self.is_finished:
            self.finish_reason = "abort"
            self.status = Status.FINISHED
