"""Structured output: a request's grammar (JSON schema, any JSON object, regex, a choice of
strings, or a Lark grammar) turned into a per-step mask over the vocabulary, with llguidance.

Why llguidance (MIT; one Rust wheel with no Python dependencies): it computes each step's
mask lazily from the grammar's lexer and Earley parser state in tens of microseconds, with no
ahead-of-time compilation of the grammar against the vocabulary, and it takes context-free
grammars (any JSON object, Lark), not only regular ones. The alternatives, checked on this CPU
machine: xgrammar (Apache-2.0) also installs and is fast, but requires torch, transformers and
Triton and precompiles each grammar against the vocabulary (the first request with a new schema
pays it); outlines-core (Apache-2.0) builds a regex -> DFA index over the whole vocabulary per
schema (seconds for larger schemas) and cannot express arbitrary JSON objects (not regular).

Shape (vLLM v1's): the HTTP process validates the spec (core/structured_spec.py: `prepare`, its
shape and static bounds from core/structured_limits.py; then entrypoints/grammar_check.py compiles it
in a child process; 400 naming the field),
the spec travels in SamplingParams as plain JSON, the engine gives each constrained sequence a
matcher (`Grammars.matcher`: a copy of a cached, compiled one), computes the step's masks while
the model forward runs (`Grammars.compute_ahead`: one bitmask tensor for all constrained rows,
filled by llguidance's executor in parallel and off the GIL, on a mask thread), the sampler takes
them (`grammar_bitmask`) and applies them to the batch's logits in one vectorised masked fill
(`apply_bitmask`), and the output processor advances each matcher by its sampled token. A grammar
that has ended (nothing may follow) ends the sequence with finish_reason "stop". With async
scheduling a launched step's grammar rows wait for their masks, computed once the step before
has advanced the matchers (sampler.DeferredRows). A mask that raises is computed again row by row
(`bitmask_isolating`), so that only its own request fails.

Hence compiled matchers cached per grammar, masks computed during the forward (their time leaves
the step when a core is free), one masked fill; where a constrained step's time went:
benchmarks/results/serving.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

import torch

from tessera.inference.core.structured_limits import parser_limits

if TYPE_CHECKING:
    from tessera.inference.core.sequence import Sequence
    from tessera.inference.core.structured_spec import StructuredSpec

@dataclass(frozen=True)
class AheadMask:
    """A sequence's next-token mask being computed ahead: row `row` of `bitmask` once `done`
    has finished, valid while the sequence still has `num_output` output tokens."""

    done: Future
    bitmask: torch.Tensor
    row: int
    num_output: int


class Grammars:
    """The engine's grammar matchers, over one llguidance tokenizer (built on first use: ~0.1-1 s
    for a large vocabulary), and the thread that computes their masks during the forward."""

    _CACHED = 64  # compiled grammars kept (a new matcher is a copy of one)

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar -> a fresh matcher, never advanced
        self._thread: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    @cached_property
    def tokenizer(self):
        from llguidance import LLTokenizer

        return LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids or None)

    def matcher(self, spec: StructuredSpec):
        """A fresh matcher for one sequence; raises ValueError if the grammar is invalid."""
        from llguidance import LLMatcher

        grammar = spec.grammar()
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
            if compiled.is_error():
                raise ValueError(compiled.get_error())
            self._compiled[grammar] = compiled
            if len(self._compiled) > self._CACHED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return compiled.deep_copy()

    def compute_ahead(self, seqs: list[Sequence]) -> None:
        """Start computing the next-token masks of the constrained sequences among `seqs` (those
        about to be sampled) on the mask thread, into one new bitmask tensor; the sampler takes
        them (`grammar_bitmask`). Call `wait` before any matcher advances."""
        seqs = [s for s in seqs if s.matcher is not None]
        if not seqs:
            return
        self.wait()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tessera-grammar-mask")
        bitmask = _new_bitmask(len(seqs), self.vocab_size)
        done = self._thread.submit(_fill, [(s.matcher, i) for i, s in enumerate(seqs)], bitmask)
        for i, s in enumerate(seqs):
            s.ahead_mask = AheadMask(done, bitmask, i, len(s.output_ids))
        self._pending = done

    def wait(self) -> None:
        """Until the mask thread is idle (its errors surface where the sampler takes the masks)."""
        if self._pending is not None:
            self._pending.exception()
            self._pending = None


@lru_cache(maxsize=1)
def _executor():
    from llguidance import LLExecutor

    return LLExecutor()


def _new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _fill(pairs: list[tuple[Any, int]], bitmask: torch.Tensor) -> None:
    from llguidance.torch import fill_next_token_bitmask_par

    fill_next_token_bitmask_par(_executor(), pairs, bitmask)


def grammar_bitmask(seqs: list[Sequence], vocab_size: int) -> torch.Tensor:
    """int32 [len(seqs), ceil(V / 32)]: bit j of row i set = token j allowed for seqs[i]. Each
    row is the one computed ahead when it is still current (waiting for it if need be); the
    others are computed now, all in one call (in parallel in Rust, without the GIL)."""
    ahead = [s.ahead_mask if s.ahead_mask is not None and s.ahead_mask.num_output == len(s.output_ids) else None
             for s in seqs]
    first = ahead[0]
    if first is not None and all(a is not None and a.bitmask is first.bitmask and a.row == i
                                 for i, a in enumerate(ahead)) and len(seqs) == first.bitmask.shape[0]:
        first.done.result()  # the usual step: every row computed ahead, in this order
        return first.bitmask
    bitmask = _new_bitmask(len(seqs), vocab_size)
    missing = [(s.matcher, i) for i, (s, a) in enumerate(zip(seqs, ahead)) if a is None]
    if missing:
        _fill(missing, bitmask)
    for i, a in enumerate(ahead):
        if a is not None:
            a.done.result()
            bitmask[i, :a.bitmask.shape[1]] = a.bitmask[a.row]
    return bitmask


def bitmask_isolating(seqs: list[Sequence], vocab_size: int) -> tuple[torch.Tensor, dict[int, Exception]]:
    """`grammar_bitmask`, and when that raises, each row's alone and afresh (not from the masks
    computed ahead together, which share the failure), so that a grammar whose mask cannot be
    computed fails its own request only: returns the bitmask (a failed row allows every token) and
    the failed rows (index -> error)."""
    try:
        return grammar_bitmask(seqs, vocab_size), {}
    except Exception:
        pass
    bitmask, failed = _new_bitmask(len(seqs), vocab_size), {}
    for i, seq in enumerate(seqs):
        try:
            _fill([(seq.matcher, i)], bitmask)
        except Exception as exc:
            bitmask[i] = -1
            failed[i] = exc
    return bitmask, failed


def allow_all(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask [rows, W] that allows every token (rows whose mask is moot)."""
    return _new_bitmask(rows, vocab_size)


# Bit j of an int32 word, as int32 (bit 31 is the sign bit); per device, made there once.
_BITS = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int32)
_BITS_ON: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor,
                  to_device: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Set to -inf, in one masked fill, every token the bitmask disallows in the given rows of
    logits [N, V] (rows [R] long, or None for all N rows in order; bitmask [R, W] int32). Tokens
    past the bitmask's 32 * W are disallowed. `to_device` (async scheduling's host-to-device copy
    without waiting): the words go to the logits' device and are expanded there, so that the host
    does not wait for the forward still running (a plain copy from pageable memory would)."""
    vocab = logits.shape[1]
    bits = _BITS
    if to_device is not None and logits.device != bitmask.device:
        bitmask = to_device(bitmask)
        bits = _BITS_ON.get(logits.device)
        if bits is None:
            bits = _BITS_ON[logits.device] = to_device(_BITS)
    allowed = (bitmask.unsqueeze(-1) & bits).view(bitmask.shape[0], -1)[:, :vocab] != 0
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    banned = ~allowed.to(logits.device)
    if rows is None:
        logits.masked_fill_(banned, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
