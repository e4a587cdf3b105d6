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

Shape (vLLM v1's): the HTTP process validates the spec (`check_spec`, 400 naming the field),
the spec travels in SamplingParams as plain JSON, the engine gives each constrained sequence a
matcher (`Grammars.matcher`), the sampler fills one bitmask for all constrained rows of the
step (llguidance's executor computes the rows in parallel, off the GIL) and applies it to the
batch's logits in one masked fill (`apply_bitmask`), and the output processor advances each
matcher by its sampled token. A grammar that has ended (nothing may follow) ends the sequence
with finish_reason "stop".
"""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]

# JSON compiled without free whitespace between tokens (llguidance's default is the same): a
# model left free to emit whitespace can run to max_tokens inside a valid prefix.
_JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredSpec(BaseModel):
    """What the output must match: `json` (a JSON schema), `json_object` (any JSON object),
    `regex`, `choice` (exactly one of the strings) or `grammar` (Lark, llguidance's dialect)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Kind
    value: Any = None

    def grammar(self) -> str:
        """The llguidance grammar (a JSON string) of this spec."""
        from llguidance import LLMatcher

        if self.kind == "json":
            schema = self.value if isinstance(self.value, dict) else json.loads(self.value)
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        return LLMatcher.grammar_from_lark(self.value)


def check_spec(spec: StructuredSpec) -> str | None:
    """Why this spec cannot be used (a bad schema, regex or grammar), or None."""
    from llguidance import LLMatcher

    if spec.kind == "choice" and (not isinstance(spec.value, list) or not spec.value
                                  or not all(isinstance(c, str) and c for c in spec.value)):
        return "the choices must be a non-empty list of non-empty strings"
    if spec.kind in ("regex", "grammar") and not (isinstance(spec.value, str) and spec.value):
        return f"the {spec.kind} must be a non-empty string"
    if spec.kind == "json" and not isinstance(spec.value, (dict, str)):
        return "the JSON schema must be an object"
    try:
        grammar = spec.grammar()
    except (ValueError, TypeError) as exc:
        return f"invalid: {exc}"
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return f"invalid: {messages[0]}" if is_error else None


class Grammars:
    """The engine's grammar matchers, over one llguidance tokenizer (built on first use: ~0.1-1 s
    for a large vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    @cached_property
    def tokenizer(self):
        from llguidance import LLTokenizer

        return LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids or None)

    def matcher(self, spec: StructuredSpec):
        """A fresh matcher for one sequence; raises ValueError if the grammar is invalid."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, spec.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher



@lru_cache(maxsize=1)
def _executor():
    from llguidance import LLExecutor

    return LLExecutor()


def fill_bitmask(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """int32 [len(matchers), ceil(V / 32)]: bit j of row i set = token j allowed for row i.
    All rows in one call (computed in parallel in Rust, without the GIL)."""
    from llguidance.torch import fill_next_token_bitmask_par

    bitmask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    fill_next_token_bitmask_par(_executor(), [(m, i) for i, m in enumerate(matchers)], bitmask)
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in one masked fill over the batch, every token the bitmask disallows in
    the given rows of logits [N, V] (rows [R] long, bitmask [R, W] int32)."""
    vocab = logits.shape[1]
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    banned[rows] = ~allowed.to(logits.device)
    logits.masked_fill_(banned, float("-inf"))
