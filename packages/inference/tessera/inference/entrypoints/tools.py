"""Tool calling for chat: the grammar that enforces `tool_choice` "required" or a named function,
and the parsers that turn generated text into OpenAI `tool_calls`, whole or as stream deltas.

- `tool_choice: "none"`: plain content (the tools still reach the chat template, as in vLLM).
- `"auto"`: the model decides; its text is parsed in the format the chat template teaches:
  Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen, Hermes,
  Mistral-instruct-style templates) or Llama-3's JSON `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`, several separated by `;`). Text that does not parse stays
  content.
- `"required"`: the output is constrained (structured.py) to a JSON array of one or more
  `{"name", "parameters"}` calls of the given tools (one only with `parallel_tool_calls: false`).
- a named function: the output is constrained to that function's parameters schema; the text
  is the call's `arguments`.

Streaming (`ToolCallStream`): content is sent as it comes, holding back only what could start
a tool call; a call goes out as OpenAI sends it: one delta with its index, id, type and name
(arguments ""), then its arguments. A named call streams its arguments as they are generated;
parsed calls ("auto", "required") go out when the choice ends.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from tessera.inference.core.json_depth import loads
from tessera.inference.core.structured_spec import StructuredSpec

Mode = Literal["none", "auto", "required", "named"]
PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_.-]{1,64}")


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parser_for_template(template: str | None) -> str:
    """The parser for a chat template that renders tools: Hermes when it teaches <tool_call>."""
    return "hermes" if template and _HERMES_OPEN in template else "llama3_json"


def tool_grammar(mode: Mode, tools: list[dict[str, Any]], name: str | None,
                 parallel: bool | None) -> StructuredSpec | None:
    """The constraint that enforces `required` or a named choice (None for auto/none)."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if mode == "named":
        return StructuredSpec(kind="json", value=params[name])
    if mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False} for n, p in params.items()]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if parallel is False:
            schema["maxItems"] = 1
        return StructuredSpec(kind="json", value=schema)
    return None


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _json_objects(text: str, separators: str) -> list[Any] | None:
    """Consecutive JSON values in text (separated by whitespace or `separators`), or None."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):  # generated text can nest deeper than json recurses
            return None
        values.append(value)


def _named(obj: Any, args_key: tuple[str, ...]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_key:
        if key in obj:
            return _call(obj["name"], obj[key])
    return _call(obj["name"], {})


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the first call or None, calls) of `<tool_call>{json}</tool_call>` text."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in text[start:].split(_HERMES_OPEN)[1:]:
        body = block.split(_HERMES_CLOSE)[0].strip()
        try:
            call = _named(loads(body), ("arguments", "parameters"))
        except ValueError:  # not JSON, or nested deeper than json_depth.MAX_JSON_DEPTH
            call = None
        if call is None:
            return text, []  # not a well-formed call: leave the text as it is
        calls.append(call)
    content = text[:start]
    return (content if content.strip() else None), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(None, calls) when the text is Llama-3 JSON tool calls, else (text, [])."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):]
    if not body.lstrip().startswith("{"):
        return text, []
    values = _json_objects(body, ";")
    calls = [_named(v, ("parameters", "arguments")) for v in values or []]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls  # type: ignore[return-value]


def parse_required(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    try:
        values = loads(text)
    except ValueError:
        return text, []  # cut short (max_tokens): not a complete array
    calls = [_named(v, ("parameters",)) for v in values] if isinstance(values, list) else []
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls  # type: ignore[return-value]


def _call_deltas(index: int, call: dict[str, Any]) -> list[dict[str, Any]]:
    head = {"index": index, "id": call["id"], "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]}]


class ToolCallStream:
    """One choice's text in, OpenAI message deltas out (`feed`, then `finish`); afterwards
    `content` and `tool_calls` hold the whole message."""

    def __init__(self, mode: Mode, parser: str, name: str | None = None):
        self.mode = mode
        self.parser = parser
        self.name = name
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.in_call = False  # the text has reached a tool call: held until the end
        self.content: str | None = None
        self.tool_calls: list[dict[str, Any]] = []
        self._named_id = call_id()

    def feed(self, piece: str) -> list[dict[str, Any]]:
        if self.mode == "none":
            return [{"content": piece}] if piece else []
        if self.mode == "named":
            first = not self.text and not self.sent
            self.text += piece
            out = []
            if first:
                self.sent = 1
                out.append({"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                            "function": {"name": self.name, "arguments": ""}}]})
            if piece:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        self.text += piece
        if self.mode == "required" or self.in_call:
            return []
        return self._content_deltas()

    def _content_deltas(self) -> list[dict[str, Any]]:
        """auto: send content up to what could still turn out to be the start of a tool call."""
        if self.parser == "hermes":
            at = self.text.find(_HERMES_OPEN, self.sent)
            if at >= 0:
                self.in_call = True
                end = at
            else:
                end = len(self.text)
                for k in range(min(len(_HERMES_OPEN) - 1, len(self.text) - self.sent), 0, -1):
                    if _HERMES_OPEN.startswith(self.text[-k:]):
                        end = len(self.text) - k
                        break
        else:
            stripped = self.text.lstrip()
            if not stripped:
                return []  # leading whitespace: undecided
            if stripped.startswith("{") or _PYTHON_TAG.startswith(stripped[:len(_PYTHON_TAG)]):
                self.in_call = True
                return []
            end = len(self.text)
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return [{"content": piece}] if piece else []

    def finish(self) -> list[dict[str, Any]]:
        if self.mode == "none":
            return []
        if self.mode == "named":
            self.tool_calls = [{"id": self._named_id, "type": "function",
                                "function": {"name": self.name, "arguments": self.text}}]
            return [] if self.sent else self.feed("")
        parse = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}[self.parser]
        content, calls = parse_required(self.text) if self.mode == "required" else parse(self.text)
        self.tool_calls = calls
        self.content = content if calls else (self.text or None)
        out: list[dict[str, Any]] = []
        if not calls:  # nothing parsed: the rest is content after all
            rest = self.text[self.sent:]
            return [{"content": rest}] if rest else []
        if content is not None and len(content) > self.sent:
            out.append({"content": content[self.sent:]})
        for i, call in enumerate(calls):
            out.extend(_call_deltas(i, call))
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI: "tool_calls" when the model chose to call (auto, required); a named choice
        ends with "stop"."""
        if self.tool_calls and self.mode in ("auto", "required") and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def valid_function_name(name: Any) -> bool:
    return isinstance(name, str) and _FUNCTION_NAME.fullmatch(name) is not None
