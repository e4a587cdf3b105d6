"""Rendering a chat into a prompt with the tokenizer's own template (chat_template.jinja or
tokenizer_config.json's chat_template, as `tessera.common.tokenizer` reads it), in the same sandboxed Jinja2 environment transformers' apply_chat_template uses.

One renderer for the server's chat endpoint and for `tessera-data prep --format chat` (fine-tuning
data), so a model is trained on exactly the prompt layout it is served with."""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from typing import Any

from tessera.common.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=4)
def _compile(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                **kwargs: Any) -> str:
    source = tokenizer.chat_template
    if isinstance(source, list):  # named templates: take "default"
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        raise ChatTemplateError("this model's tokenizer has no chat template (no chat_template.jinja, no "
                                "chat_template in tokenizer_config.json); use /v1/completions, or add a template")
    special = {k: v.get("content") if isinstance(v, dict) else v
               for k, v in tokenizer.config.items() if k.endswith("_token") and isinstance(v, (str, dict))}
    try:
        return _compile(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **special, **kwargs)
    except ChatTemplateError:
        raise
    except Exception as exc:  # jinja2 errors of a broken template or unexpected messages
        raise ChatTemplateError(f"chat template failed: {exc}") from None
