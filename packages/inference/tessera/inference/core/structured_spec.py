"""What a request's output must match (`StructuredSpec`: a JSON schema, any JSON object, a regex, a
choice of strings or a Lark grammar) and the HTTP process's check of it (`check_spec`), kept apart
from the engine's grammar matchers (sample/structured.py) so that a request's parameters do not
depend on the engine."""

from __future__ import annotations

import json
from typing import Any, Literal

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
