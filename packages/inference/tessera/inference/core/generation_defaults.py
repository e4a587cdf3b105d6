"""Request defaults from the model's generation settings, as vLLM's `--generation-config` and
`--override-generation-config` define them (vLLM's ModelConfig.get_diff_sampling_param):

- `auto` (default): the model's generation_config.json (an HF directory's own, or the record a
  checkpoint carries: tessera.common.hf.generation) gives the defaults; `vllm`: it gives none
  (its end ids still stop generation); a FOLDER: that folder's generation_config.json replaces the
  model's (end ids included).
- As vLLM reads the file through transformers' `to_diff_dict`, a value equal to transformers' own
  default (temperature 1.0, top_p 1.0, top_k 50, repetition_penalty 1.0) is no default here either.
- The override's fields go over the file's. Only temperature, top_p, top_k, min_p,
  repetition_penalty and max_new_tokens become defaults; max_new_tokens is the default max_tokens.
- A request's own value wins, except that max_tokens is capped (vLLM's `override_max_tokens`) by
  the override's max_new_tokens, or under a FOLDER by that folder's (override applied).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tessera.common.errors import ArtifactError, UserError
from tessera.common.hf.generation import SAMPLING_FIELDS, GenerationSettings, generation_settings

MODES = ("auto", "vllm")  # anything else names a folder
# transformers' GenerationConfig defaults of those fields: `to_diff_dict` leaves them out, so vLLM
# never applies them (a full dump's "top_k": 50 is no top-k default).
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """What the server fills into a request that leaves a field out (SamplingParams names)."""

    values: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k, min_p, repetition_penalty, max_tokens
    max_tokens_cap: int | None = None  # no request generates more (vLLM's override_max_tokens)
    source: str = ""  # where the values came from, for the startup log

    def get(self, name: str, request_value: Any) -> Any:
        """The request's value when it has one, else this default (None: the built-in one)."""
        return request_value if request_value is not None else self.values.get(name)

    @property
    def applies(self) -> bool:
        """Whether any default or cap comes from the model (or the flags); the startup log says so only then, as vLLM's does."""
        return bool(self.values) or self.max_tokens_cap is not None

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
        cap = f"; max_tokens capped at {self.max_tokens_cap}" if self.max_tokens_cap is not None else ""
        return (f"sampling defaults from {self.source}: {shown or 'none'}{cap} (a request's own values win; "
                "--generation-config vllm ignores the model's)")

    def to_wire(self) -> dict[str, Any]:
        return {"values": dict(self.values), "max_tokens_cap": self.max_tokens_cap, "source": self.source}

    @classmethod
    def from_wire(cls, data: dict[str, Any] | None) -> GenerationDefaults:
        return cls() if not data else cls(dict(data["values"]), data["max_tokens_cap"], data["source"])


def parse_override(text: str | None) -> dict[str, Any]:
    """--override-generation-config JSON -> its fields, checked (one line naming the flag and field)."""
    if text is None:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--override-generation-config: not valid JSON ({exc.msg}); e.g. "
                        "'{\"temperature\": 0.5, \"max_new_tokens\": 128}'") from None
    return check_override(obj)


def check_override(obj: Any) -> dict[str, Any]:
    """The override's fields without nulls; UserError naming the field that is not one of
    SAMPLING_FIELDS or holds a bad value (vLLM drops such a field silently; it is refused here)."""
    try:
        generation_settings(obj, "--override-generation-config", allowed=SAMPLING_FIELDS)
    except ArtifactError as exc:
        raise UserError(str(exc)) from None
    return {k: v for k, v in obj.items() if v is not None}


def resolve_defaults(record: GenerationSettings | None, mode: str, override: dict[str, Any],
                     source: str) -> GenerationDefaults:
    """The defaults of `mode` from the model's record (already the folder's under a FOLDER mode)."""
    override = check_override(override)
    config: dict[str, Any] = {}
    if mode != "vllm" and record is not None:
        config = {k: v for k, v in record.sampling().items() if _HF_DEFAULTS.get(k) != v}
    config.update(override)
    values = {("max_tokens" if k == "max_new_tokens" else k): v for k in SAMPLING_FIELDS
              if (v := config.get(k)) is not None}
    if "top_k" in values:
        values["top_k"] = max(int(values["top_k"]), 0)  # -1 and 0 both mean off; SamplingParams says 0
    cap = values.get("max_tokens") if mode not in MODES else override.get("max_new_tokens")
    where = source if mode != "vllm" and record is not None and record.sampling() else ""
    if override:
        where = f"{where} and --override-generation-config" if where else "--override-generation-config"
    return GenerationDefaults(values, cap, where)
