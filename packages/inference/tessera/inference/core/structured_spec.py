"""What a request's output must match (`StructuredSpec`: a JSON schema, any JSON object, a regex, a
choice of strings or a Lark grammar) and the HTTP process's check of its shape and static bounds
(`prepare`), kept apart from the engine's grammar matchers (sample/structured.py) so that a
request's parameters do not depend on the engine. The compile itself is checked in a child process
(entrypoints/grammar_check.py) before the engine sees the grammar."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tessera.inference.core.json_depth import JsonTooDeep, loads
from tessera.inference.core.structured_limits import GrammarLimits, bounds_problem

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]

# JSON compiled without free whitespace between tokens (llguidance's default is the same): a
# model left free to emit whitespace can run to max_tokens inside a valid prefix.
_JSON_OPTIONS = {"whitespace_flexible": False}
# Appended to every client Lark grammar (the last %llguidance line wins). llguidance 1.9.1's
# forcing (finding the bytes every continuation must start with) loops forever, growing memory
# ~6 MB/s, on a lexeme followed by one it can swallow: `start: /a+/ "a"`; after a prefix
# (`/[0-9]{6}/ /a+/ "a"`) that would hang the engine's mask thread mid-generation, where no check
# can see it coming. Without forcing the same masks allow every token the grammar allows.
_LARK_OPTIONS = '\n%llguidance {"no_forcing": true}\n'


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
            schema = self.value if isinstance(self.value, dict) else loads(self.value)
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        return LLMatcher.grammar_from_lark(self.value + _LARK_OPTIONS)


def prepare(spec: StructuredSpec, limits: GrammarLimits) -> str:
    """The llguidance grammar of a request's constraint, after checking its shape and the static
    bounds (structured_limits.py); ValueError naming what is wrong. Nothing here compiles it: the
    grammar check (grammar_check.py) does that in a child process before the engine does."""
    if spec.kind == "choice" and (not isinstance(spec.value, list) or not spec.value
                                  or not all(isinstance(c, str) and c for c in spec.value)):
        raise ValueError("the choices must be a non-empty list of non-empty strings")
    if spec.kind in ("regex", "grammar") and not (isinstance(spec.value, str) and spec.value):
        raise ValueError(f"the {spec.kind} must be a non-empty string")
    if spec.kind == "json" and not isinstance(spec.value, (dict, str)):
        raise ValueError("the JSON schema must be an object")
    try:
        problem = bounds_problem(spec.kind, spec.value, limits)
    except JsonTooDeep as exc:
        raise ValueError(f"the JSON schema {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON ({exc.msg})") from None
    if problem:
        raise ValueError(problem)
    try:
        return spec.grammar()
    except (ValueError, TypeError) as exc:  # UnicodeEncodeError (a lone surrogate) is a ValueError
        raise ValueError(f"invalid: {exc}") from None
