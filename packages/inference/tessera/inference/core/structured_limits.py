"""Bounds on a structured-output constraint, checked before anything compiles it, and the limits
llguidance itself runs under (set explicitly, the same in the grammar check and the engine).

Why each bound (llguidance 1.9.1 on this 2-core machine): a Lark grammar whose rules reference
each other in a chain recurses once per rule when compiled, about 2.7 KB of stack a rule, so a
chain of ~2,800 rules overflows an 8 MiB stack (the segfault of a 278 KB, 10,000-rule grammar);
a JSON schema recurses the same way through nested subschemas and `$ref`s (~8 KB a level: 900
levels of `properties` overflow 8 MiB). A schema whose `$ref`s fan out (d30 = allOf of two d29,
...) describes 2^30 subschemas in 2 KB. 20,000 choices take 1.4 s to compile, 200,000 far longer,
and over 2,000 exceed llguidance's Earley row limit at the first token; a 1 MB regex literal or
`(a{1000}){1000}` costs 0.6-1.7 s and ~250 MB before llguidance gives up at the first token. The
grammar check (grammar_check.py) catches what gets past these bounds; they refuse the known
shapes in microseconds, with a message naming the limit.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import Field

from tessera.common.config import StrictModel

# llguidance's ParserLimits, explicit: its defaults, except verbose_errors (an error message that
# goes back to a client holds the limit hit, not a dump of the parser state).
PARSER_LIMITS: dict[str, Any] = {
    "max_items_in_row": 2000,  # Earley items in one row (alternatives of one rule, choices)
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regex ASTs (~50k/ms)
    "step_lexer_fuel": 200_000,  # one mask's lexer work (~14k/ms)
    "step_max_items": 50_000,  # Earley items of one mask (~20k/ms)
    "max_lexer_states": 250_000,  # lexer states of one grammar (1-2 KB each)
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
    "precompute_large_lexemes": True,
    "verbose_errors": False,
}


def parser_limits():
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)


class GrammarLimits(StrictModel):
    """What one request's structured-output constraint may be (tessera-serve flags)."""

    max_grammar_bytes: int = Field(
        128 * 2**10, gt=0, description="Largest constraint source in UTF-8 bytes: a Lark grammar, a JSON schema "
                                       "(as JSON), or the choices together.")
    max_grammar_rules: int = Field(500, gt=0, description="Most rule and terminal definitions in a Lark grammar.")
    # At most 256: the walk below recurses twice a level, within Python's recursion limit.
    max_schema_depth: int = Field(64, gt=0, le=256, description="Deepest nesting of a JSON schema's objects and "
                                                                "arrays, counted through $ref.")
    max_schema_refs: int = Field(2000, gt=0, description="Most $ref expansions of a JSON schema: each $ref counted "
                                                         "once per place its target is inlined (cycles cut).")
    max_choices: int = Field(1000, gt=0, description="Most strings in a guided_choice.")
    max_regex_bytes: int = Field(16 * 2**10, gt=0, description="Longest regex (guided_regex, a schema's pattern) in "
                                                               "UTF-8 bytes.")
    max_regex_repeat: int = Field(10_000, gt=0, description="Largest product of nested counted repetitions "
                                                            "({n}, {m,n}, ~ n) in a regex or Lark grammar.")
    check_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False, description="Seconds the grammar check child may take per grammar.")
    check_memory_bytes: int = Field(512 * 2**20, gt=0, description="Memory (address space) the grammar check child "
                                                                   "may add while checking one grammar.")


# The tessera-serve flag of each limit (docs/cli/tessera-serve.md), for messages.
FLAGS = {
    "max_grammar_bytes": "--max-grammar-bytes", "max_grammar_rules": "--max-grammar-rules",
    "max_schema_depth": "--max-schema-depth", "max_schema_refs": "--max-schema-refs",
    "max_choices": "--max-guided-choices", "max_regex_bytes": "--max-regex-bytes",
    "max_regex_repeat": "--max-regex-repeat", "check_timeout_s": "--grammar-check-timeout",
    "check_memory_bytes": "--grammar-check-memory",
}


def _over(what: str, value: int, name: str, limits: GrammarLimits) -> str:
    return f"{what} is {value}, over this server's limit of {getattr(limits, name)} ({FLAGS[name]})"


def bounds_problem(kind: str, value: Any, limits: GrammarLimits) -> str | None:
    """Why a constraint of this kind (structured.Kind) is over a limit, or None. Its shape (types)
    is checked before this."""
    if kind == "choice":
        if len(value) > limits.max_choices:
            return _over("the number of choices", len(value), "max_choices", limits)
        size = sum(len(c.encode("utf-8", "surrogatepass")) for c in value)
        return _over("the choices' total size in bytes", size, "max_grammar_bytes", limits) \
            if size > limits.max_grammar_bytes else None
    if kind == "regex":
        return _regex_problem(value, limits)
    if kind == "grammar":
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > limits.max_grammar_bytes:
            return _over("the grammar's size in bytes", size, "max_grammar_bytes", limits)
        rules = sum(1 for line in value.splitlines() if _RULE.match(line))
        if rules > limits.max_grammar_rules:
            return _over("the number of rule definitions", rules, "max_grammar_rules", limits)
        repeat = repetition(value, lark=True)
        return _over("the grammar's nested repetition count", repeat, "max_regex_repeat", limits) \
            if repeat > limits.max_regex_repeat else None
    if kind == "json":
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limits.max_grammar_bytes:
            return _over("the schema's size in bytes", size, "max_grammar_bytes", limits)
        if isinstance(value, str):
            from tessera.inference.core.json_depth import loads

            value = loads(value)  # a ValueError (not JSON, too deep) is the caller's 400
        return _SchemaWalk(value, limits).problem()
    return None


def _regex_problem(regex: str, limits: GrammarLimits, what: str = "the regex") -> str | None:
    size = len(regex.encode("utf-8", "surrogatepass"))
    if size > limits.max_regex_bytes:
        return _over(f"{what}'s size in bytes", size, "max_regex_bytes", limits)
    repeat = repetition(regex)
    if repeat > limits.max_regex_repeat:
        return _over(f"{what}'s nested repetition count", repeat, "max_regex_repeat", limits)
    return None


# A Lark definition starts a line: `name:`, `?name:`, `!name:`, `NAME:`, `name{x}:`, `name.2:`.
_RULE = re.compile(r"\s*[?!]?[A-Za-z_]\w*(?:\{[^}]*\})?(?:\.-?\d+)?\s*:")
# What matters to repetition counting: escapes, classes, groups, counted repetitions; everything
# else is a run of plain atoms. In Lark, string literals are atoms, regex literals are regexes
# (counted as one), and [...] is an optional group.
_COUNTED = r"\{(\d{1,12})(?:,(\d{0,12}))?\}|~\s*(\d{1,12})(?:\s*\.\.\s*(\d{1,12}))?"
_REGEX_TOKEN = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|[()]|" + _COUNTED + r"|[^\\\[(){~]+|.", re.S)
_LARK_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|/(?:\\.|[^/\\\n])+/[a-z]*|[(\[)\]]|' + _COUNTED
                         + r'|\s+|[^"/(\[)\]{~\s]+|.', re.S)


def repetition(text: str, lark: bool = False) -> int:
    """The largest product of nested counted repetitions in a regex (or a Lark grammar):
    `(a{1000}){1000}` is 1,000,000, `a{5}b{7}` is 7, Lark's `(/a{10}/ ~ 5){3}` 150. Unbounded
    repetition ({m,}, *, +) counts as m: it is a loop, not copies."""
    frames = [1]  # the largest element value inside each open group
    prev = 1  # the value of the element just read (an atom 1, a group its inside's largest)
    for m in (_LARK_TOKEN if lark else _REGEX_TOKEN).finditer(text):
        token = m.group(0)
        if lark and token.isspace():
            continue  # between an item and its repetition
        if token == "(" or (lark and token == "["):
            frames.append(1)
            prev = 1
        elif lark and len(token) > 2 and token[0] == "/":  # a regex literal: one element
            prev = repetition(token[1:token.rindex("/")])
            frames[-1] = max(frames[-1], prev)
        elif token == ")" or (lark and token == "]"):
            prev = frames.pop() if len(frames) > 1 else 1
            frames[-1] = max(frames[-1], prev)
        elif m.group(1) is not None or m.group(3) is not None:
            low, high = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
            prev *= max(1, int(high) if high else int(low))
            frames[-1] = max(frames[-1], prev)
        else:
            prev = 1
    return max(frames)


class _SchemaWalk:
    """Nesting depth and $ref expansions of a JSON schema, following local refs (#, #/$defs/x,
    any JSON pointer), each target's totals computed once, a ref to a target already on the path
    (recursion) counted once and not followed. Stops at the first limit passed, so its own
    recursion is bounded by max_schema_depth."""

    def __init__(self, schema: Any, limits: GrammarLimits):
        self.root, self.limits = schema, limits
        self.memo: dict[str, tuple[int, int]] = {}  # ref -> (expansions, height) of its target
        self.active: set[str] = set()

    def problem(self) -> str | None:
        try:
            self._walk(self.root, 1)
        except _Over as over:
            return str(over)
        return None

    def _walk(self, node: Any, level: int) -> tuple[int, int]:
        """(ref expansions, height) of node, at nesting level `level`."""
        if not isinstance(node, (dict, list)):
            return 0, 0
        if level > self.limits.max_schema_depth:
            raise _Over(_over("the schema's nesting depth (through $ref)", level, "max_schema_depth", self.limits))
        refs, height = 0, 0
        for child in node.values() if isinstance(node, dict) else node:
            r, h = self._walk(child, level + 1)
            refs, height = refs + r, max(height, h)
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                problem = _regex_problem(node["pattern"], self.limits, "a pattern")
                if problem:
                    raise _Over(problem)
            ref = node.get("$ref")
            if isinstance(ref, str):
                r, h = self._ref(ref, level)
                refs, height = refs + r, max(height, h - 1)
        if refs > self.limits.max_schema_refs:
            raise _Over(_over("the number of $ref expansions in the schema", refs, "max_schema_refs", self.limits))
        return refs, height + 1

    def _ref(self, ref: str, level: int) -> tuple[int, int]:
        if ref in self.active:
            return 1, 0  # recursion: compiled as a rule that refers to itself
        if ref not in self.memo:
            target = _resolve(self.root, ref)
            if target is None:
                return 1, 0  # not local, or missing: llguidance says what is wrong with it
            self.active.add(ref)
            try:
                self.memo[ref] = self._walk(target, level)
            finally:
                self.active.discard(ref)
        refs, height = self.memo[ref]
        if level + height - 1 > self.limits.max_schema_depth:
            raise _Over(_over("the schema's nesting depth (through $ref)", level + height - 1, "max_schema_depth",
                              self.limits))
        return refs + 1, height


class _Over(Exception):
    pass


def _resolve(root: Any, ref: str) -> Any:
    """The target of a local JSON pointer ref ("#", "#/$defs/x"), or None."""
    from urllib.parse import unquote

    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
