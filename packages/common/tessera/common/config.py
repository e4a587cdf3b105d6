"""Typed configs: YAML files plus dotted command-line overrides, validated before any work.

Configs are pydantic models whose every field carries a description (so `--help` and the docs
can list them). `load_config` reads a YAML file, applies `a.b.c=value` overrides (values parsed as
YAML, so `true`, `3`, `1e-4` and `[1,2]` have their natural types) and validates; any problem
becomes a one-line UserError naming the field, and the override that set it, or else the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from tessera.common.errors import UserError

T = TypeVar("T", bound=BaseModel)


class StrictModel(BaseModel):
    """Base for all Tessera configs: unknown fields are errors, assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def expand_preset(data: Any, presets: dict[str, dict[str, Any]], what: str = "preset") -> Any:
    """A model config's fields with its `preset` (a named shape) expanded under them: the fields
    given beside it win. Used by every kind's config in a before-validator."""
    if isinstance(data, dict) and "preset" in data:
        data = dict(data)
        name = data.pop("preset")
        if name not in presets:
            raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(presets)}")
        data = {**presets[name], **data}
    return data


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str],
                    origins: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply `dotted.key=value` overrides to a nested dict (in place; also returned). `origins`, if
    given, records each dotted key's override as the user typed it, for validate_config's errors."""
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        if not key:
            raise UserError(f"override {item!r}: empty key")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
        if origins is not None:
            origins[key] = f"override {item}"
    return data


def _origin(loc: list[str], message: str, origins: dict[str, str], source: str) -> str:
    """Who gave the value an error is about: the override of that key (or of a section above it);
    for a check over a whole section (a cross-field rule, loc above the keys), the overrides
    under it whose keys the message names; else the file."""
    best: list[str] = []
    for key in origins:
        parts = key.split(".")
        if loc[:len(parts)] == parts and len(parts) > len(best):
            best = parts
    if best:
        return origins[".".join(best)]
    named = []
    for key, origin in origins.items():
        parts = key.split(".")
        if parts[:len(loc)] == loc and any(
                re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message)
                for name in (key, ".".join(parts[len(loc):]))):
            named.append(origin)
    return ", ".join(named) if named else source


def format_validation_error(exc: ValidationError, source: str, origins: dict[str, str] | None = None) -> str:
    """One line: per problem, the dotted field and what is wrong, under the name of what gave the
    value (`origins`: dotted key -> the override or flag that set it), else `source` (the file)."""
    by_origin: dict[str, list[str]] = {}
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        origin = _origin([str(p) for p in err["loc"]], err["msg"], origins or {}, source)
        by_origin.setdefault(origin, []).append(f"{loc}: {err['msg']}")
    more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
    return "; ".join(f"{origin}: invalid config: " + "; ".join(problems)
                     for origin, problems in by_origin.items()) + more


def validate_config(model_cls: type[T], data: dict[str, Any], source: str = "config",
                    origins: dict[str, str] | None = None) -> T:
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc, source, origins)) from None


def load_config(
    model_cls: type[T], path: str | os.PathLike | None = None, overrides: list[str] | None = None
) -> T:
    data = read_yaml(path) if path is not None else {}
    origins: dict[str, str] = {}
    apply_overrides(data, overrides or [], origins)
    return validate_config(model_cls, data, str(path) if path is not None else "config", origins)


def describe_fields(model_cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, description) for every field, recursing into nested configs."""
    rows = []
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe_fields(ann, f"{prefix}{name}."))
        else:
            default = "" if field.is_required() else repr(field.get_default(call_default_factory=True))
            rows.append((f"{prefix}{name}", default, field.description or ""))
    return rows
