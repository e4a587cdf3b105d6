"""Rendering a chat into a prompt with the tokenizer's own template (chat_template.jinja or
tokenizer_config.json's chat_template, as `tessera.common.tokenizer` reads it), in the sandboxed
Jinja2 environment transformers' apply_chat_template uses, with bounds on what a render may cost.

One renderer for the server's chat endpoint and for `tessera-data prep --format chat` (fine-tuning
data), so a model is trained on exactly the prompt layout it is served with.

A template comes with the model, from wherever the model came from, and Jinja's sandbox stops it
from reaching Python but not from looping or allocating without end (nested `range(99999)` loops;
`'a' * 10**10`). Each render therefore runs under `RenderLimits`: loop iterations (every `for`,
recursive loops and macro calls included), the size of every value it builds (repetition, `+`, `~`, `%` and `**`
operands, call and filter arguments and results, `replace`/`join`/format widths predicted before
they run) and of its output (streamed, stopped past the cap), and wall time (checked at every
iteration, call, filter and operator). Going over one is a `ChatTemplateLimit` naming it. What the
sandbox cannot see (a single C-level call inside a filter) is bounded where the server renders:
in a child process with an address-space limit, killed at the time limit (tokenizer_process.py).
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tessera.common.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    pass


class ChatTemplateLimit(ChatTemplateError):
    """A render went over one of its RenderLimits; `limit` is that field's name."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class RenderLimits:
    timeout_s: float = 5.0  # wall time of one render
    max_iterations: int = 1_000_000  # loop iterations and macro calls of one render, all together
    max_chars: int = 1 << 22  # characters of the output, and items or characters of any value built
    max_memory_mb: int = 1024  # address space a render process may add (where rendered in one: the server)


_MAX_INT_BITS = 1 << 16  # integers a template computes (`**`, `*`): far beyond any counter it needs
# Filters and functions whose integer arguments are widths or counts of what they build (others',
# e.g. `default(10**9)` or a macro's data, are plain values).
_SIZED_BY_ARGUMENT = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "batch",
                                "slice", "tojson", "generate_lorem_ipsum"})
# Filters that make text of their whole value (a list's items' text too, in one C-level call).
_AS_TEXT = frozenset({"string", "tojson", "pprint", "join", "format", "e", "escape", "forceescape", "safe", "urlencode",
                      "trim", "upper", "lower", "title", "capitalize", "replace", "center", "indent", "wordwrap",
                      "truncate", "striptags", "urlize", "xmlattr"})
_state = threading.local()  # the render under way on this thread (its _Budget)


class _Budget:
    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.iterations = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimit(f"the chat template took longer than {self.limits.timeout_s:g} s to render",
                                    "timeout_s")

    def iteration(self) -> None:
        self.iterations += 1
        if self.iterations > self.limits.max_iterations:
            raise ChatTemplateLimit(f"the chat template ran more than {self.limits.max_iterations:,} loop "
                                    "iterations and macro calls in one render", "max_iterations")
        self.tick()

    def size(self, n: int, what: str = "a value") -> None:
        if n > self.limits.max_chars:
            raise ChatTemplateLimit(f"the chat template went over {self.limits.max_chars:,} characters or items: "
                                    f"{what} of {n:,}", "max_chars")

    def bits(self, n: int) -> None:
        if n > _MAX_INT_BITS:
            raise ChatTemplateLimit(f"the chat template computed an integer of about {n:,} bits, more than "
                                    f"{_MAX_INT_BITS:,}", "max_chars")

    def value(self, value: Any) -> Any:
        """`value`, after checking its size (strings and containers; other values are small)."""
        if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
            self.size(len(value))
        elif isinstance(value, int):
            self.bits(value.bit_length())
        return value

    def text_of(self, value: Any) -> Any:
        """`value`, after checking the text a container would make (str(), tojson, `~`, a join: its
        items' text, nested), counted up to the cap before any of it is made."""
        total, todo = 0, [value] if isinstance(value, (list, tuple, dict, set, frozenset)) else []
        while todo:
            item = todo.pop()
            if isinstance(item, dict):
                todo.extend((*item.keys(), *item.values()))
            elif isinstance(item, (list, tuple, set, frozenset)):
                todo.extend(item)
            total += len(item) if isinstance(item, (str, bytes)) else 1
            if total > self.limits.max_chars:
                self.size(total, "the text of a container")
        return value

    def arguments(self, args: tuple, kwargs: dict) -> None:
        """An integer argument (a width, a count) beyond the size cap would make a value beyond it."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.limits.max_chars:
                self.size(abs(a), "a width or count argument")

    def format_string(self, text: str, args: Any = ()) -> None:
        """A width or precision in a format string (`%9999999d`, `{:>9999999}`) is a value that size;
        one taken from the arguments (`%*d`, `%.*f`, `{:{}}`, `{:.{w}f}`) is checked among them."""
        for digits in re.findall(rf"\d{{{len(str(self.limits.max_chars))},}}", text):
            self.size(int(digits) if len(digits) < 19 else 10**18, "a formatted field")
        if re.search(r"%[^a-zA-Z%]*\*|\{[^{}]*:[^{}]*\{", text):  # `{:{0[1]}}` may take it from inside a list
            todo = [args]
            while todo:
                value = todo.pop()
                if isinstance(value, (list, tuple, dict)):
                    self.tick()
                    todo.extend(value.values() if isinstance(value, dict) else value)
                else:
                    self.arguments((value,), {})


def _budget() -> _Budget | None:
    return getattr(_state, "budget", None)


def _loop_items(iterable: Any) -> Any:
    """What every `for` loop of a template iterates over (the AST is rewritten to call this)."""
    budget = _budget()
    for item in iterable:
        if budget is not None:
            budget.iteration()
        yield item


def _sized(value: Any) -> Any:
    """Every `~` concatenation's result (the AST is rewritten to call this)."""
    budget = _budget()
    return value if budget is None else budget.value(value)


def _as_text(value: Any) -> Any:
    """Every `~` operand, before it is made text (the AST is rewritten to call this)."""
    budget = _budget()
    return value if budget is None else budget.text_of(value)


def _predict(budget: _Budget, name: str, value: Any, args: tuple, kwargs: dict | None = None) -> None:
    """The size of a result that a width or count multiplies (`replace`, `join`, format widths,
    `indent`, `expandtabs`, `lipsum`, lists `sum`med), before it is built."""
    kwargs = kwargs or {}
    if name == "replace" and isinstance(value, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        count = value.count(old) if old else len(value) + 1
        budget.size(len(value) + count * max(0, len(new) - len(old)))
    elif name == "join" and isinstance(value, (list, tuple)):  # a list's join, the filter's order
        sep = args[0] if args and isinstance(args[0], str) else ""
        budget.size(sum(len(v) if isinstance(v, (str, list, tuple, dict)) else 1 for v in value)
                    + len(sep) * len(value))
    elif name in ("format", "format_map") and isinstance(value, str):
        budget.format_string(value, (*args, *kwargs.values()))
        budget.text_of([*args, *kwargs.values()])
    elif name == "sum" and isinstance(value, (list, tuple)) and "attribute" not in kwargs and len(args) < 1:
        budget.size(sum(len(v) for v in value if isinstance(v, (str, list, tuple))))  # lists summed: one list
    elif name in ("indent", "expandtabs") and isinstance(value, str):  # the width again on every line / tab
        width = args[0] if args else kwargs.get(*(("width", 4) if name == "indent" else ("tabsize", 8)))
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        budget.size(len(value) + value.count("\n" if name == "indent" else "\t") * max(width, 0) + width)
    elif name == "generate_lorem_ipsum":  # lipsum(n, html, min, max): up to `max` words of ~8 characters a paragraph
        given = {**dict(zip(("n", "html", "min", "max"), args)), **kwargs}
        n, words = given.get("n", 5), given.get("max", 100)
        if isinstance(n, int) and isinstance(words, int):
            budget.size(max(n, 0) * max(words, 0) * 8, "a lorem ipsum text")


def _bounded_filter(name: str, f: Any) -> Any:
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # a context or environment comes first

    @functools.wraps(f)  # keeps that mark
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            return f(*args, **kwargs)
        budget.tick()
        if len(args) > skip:  # the value filtered, then the filter's own arguments
            if name in _AS_TEXT:
                budget.text_of(args[skip])
            if name in _SIZED_BY_ARGUMENT:
                budget.arguments(args[skip + 1:], kwargs)
            _predict(budget, name, args[skip], args[skip + 1:], kwargs)
        return budget.value(f(*args, **kwargs))
    return bounded


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


@functools.lru_cache(maxsize=4)
def _compile(source: str):
    from jinja2 import nodes
    from jinja2.ext import loopcontrols
    from jinja2.runtime import LoopContext, Macro
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _budget()
            if budget is not None:
                budget.tick()
                if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                    budget.bits(max(left.bit_length() - 1, 1) * right)
                elif operator == "*":
                    n, seq = (right, left) if isinstance(right, int) else (left, right)
                    if isinstance(n, int) and hasattr(seq, "__len__"):
                        budget.size(len(seq) * max(n, 0))
                    elif isinstance(left, int) and isinstance(right, int):
                        budget.bits(left.bit_length() + right.bit_length())
                elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
                    budget.size(len(left) + len(right))
                elif operator == "%" and isinstance(left, str):
                    budget.format_string(left, right)
                    budget.text_of(right)
            result = super().call_binop(context, operator, left, right)
            return result if budget is None else budget.value(result)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            if __obj is _loop_items or __obj is _sized or __obj is _as_text:
                return __obj(*args)
            budget = _budget()
            if budget is None:
                return super().call(__context, __obj, *args, **kwargs)
            if isinstance(__obj, Macro):  # recursion is a loop too
                budget.iteration()
            else:
                budget.tick()
            if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
                args = (_loop_items(args[0]), *args[1:])
            method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
            if getattr(method, "__name__", None) in _SIZED_BY_ARGUMENT:
                budget.arguments(args, kwargs)
            owner = getattr(method, "__self__", None)
            if isinstance(owner, str) and method.__name__ == "join" and args:
                _predict(budget, "join", args[0], (owner,))
            elif isinstance(owner, str):
                _predict(budget, method.__name__, owner, args, kwargs)
            elif getattr(method, "__name__", None) == "generate_lorem_ipsum":
                _predict(budget, "generate_lorem_ipsum", None, args, kwargs)
            return budget.value(super().call(__context, __obj, *args, **kwargs))

    def finalize(value: Any) -> Any:  # every {{ expression }}, in set blocks and macros too
        budget = _budget()
        return value if budget is None else budget.value(budget.text_of(value))

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=finalize)
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    def checked(function: Any, node: Any) -> Any:
        return nodes.Call(nodes.ImportedName(f"{__name__}.{function.__name__}"), [node], [], None, None,
                          lineno=node.lineno)

    class Bound(NodeTransformer):
        """Every loop iterates through _loop_items, every `a ~ b` operand through _as_text and result through _sized."""

        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = checked(_loop_items, node.iter)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.nodes = [checked(_as_text, n) for n in node.nodes]
            return checked(_sized, node)

    return env.from_string(Bound().visit(env.parse(source)))


def template_source(tokenizer: Tokenizer) -> tuple[str, dict[str, str]]:
    """(the template source, the special tokens it may use) of a tokenizer; ChatTemplateError when
    it has no template."""
    source = tokenizer.chat_template
    if isinstance(source, list):  # named templates: take "default"
        source = next((t["template"] for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not source or not isinstance(source, str):
        raise ChatTemplateError("this model's tokenizer has no chat template (no chat_template.jinja, no "
                                "chat_template in tokenizer_config.json); use /v1/completions, or add a template")
    special = {k: v.get("content") if isinstance(v, dict) else v
               for k, v in tokenizer.config.items() if k.endswith("_token") and isinstance(v, (str, dict))}
    return source, special


def render_template(source: str, special: dict[str, Any], messages: list[dict[str, Any]], add_generation_prompt: bool,
                    variables: dict[str, Any], limits: RenderLimits) -> str:
    """The template rendered under `limits` (ChatTemplateLimit past one; ChatTemplateError for a
    template that fails)."""
    budget = _Budget(limits)
    _state.budget = budget
    try:
        template = _compile(source)
        pieces, total = [], 0
        for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **special, **variables):
            total += len(piece)
            budget.size(total, "an output")
            pieces.append(piece)
        return "".join(pieces)
    except ChatTemplateError:
        raise
    except RecursionError:
        raise ChatTemplateError("chat template failed: it recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateLimit("the chat template ran out of memory while rendering", "max_memory_mb") from None
    except Exception as exc:  # jinja2 errors of a broken template or unexpected messages
        raise ChatTemplateError(f"chat template failed: {exc}") from None
    finally:
        _state.budget = None


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                limits: RenderLimits | None = None, **kwargs: Any) -> str:
    """Render in this process under `limits` (default RenderLimits())."""
    source, special = template_source(tokenizer)
    return render_template(source, special, messages, add_generation_prompt, kwargs, limits or RenderLimits())
