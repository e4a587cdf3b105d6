"""A model's generation settings: what its generation_config.json says about ending and sampling.

The record travels with the model through every stage: `tessera-ckpt import` reads it from the HF
directory into the checkpoint's sidecar (`generation`), reshard and the trainer carry it, `export
--format hf` writes it back into generation_config.json, and the server stops on its end ids and
takes its sampling fields as request defaults (vLLM's `--generation-config auto`; see
tessera.inference.core.generation_defaults).

Kept: `eos_token_id` (an int or a list: Llama-3-Instruct lists <|eot_id|> only here), the sampling
fields vLLM applies (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) and
`do_sample` (serving ignores it, as vLLM does; kept so an export's `generate` samples as the
original's did). Every other key is ignored; null means absent (transformers writes full dumps
with nulls). A value of the wrong type or out of range is one line naming the file and the field.
"""

from __future__ import annotations

import math
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessera.common.errors import ArtifactError
from tessera.common.fileio import artifact_path, read_json

GENERATION_CONFIG = "generation_config.json"
# The fields vLLM takes from generation_config.json as request defaults (its `available_params`).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


class GenerationSettings(BaseModel):
    """The part of a generation_config.json that Tessera keeps (every field optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    eos_token_ids: list[int] = Field(default_factory=list, description="Ids that end generation (eos_token_id).")
    temperature: float | None = Field(None, description="0 = greedy.")
    top_p: float | None = None
    top_k: int | None = Field(None, description="0 or -1 = off.")
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = Field(None, description="The default max_tokens of a request that sets none.")
    do_sample: bool | None = Field(None, description="Written back on export; serving ignores it (as vLLM).")

    @model_validator(mode="after")
    def _in_range(self) -> GenerationSettings:
        # A sidecar edited by hand is held to the same ranges as generation_config.json.
        for name, (ok, what) in _CHECKS.items():
            v = getattr(self, name)
            if v is not None and not ok(v):
                raise ValueError(f"{name} is {v!r}; expected {what}")
        if any(i < 0 for i in self.eos_token_ids):
            raise ValueError("eos_token_ids must be token ids (integers >= 0)")
        return self

    def sampling(self) -> dict[str, float | int]:
        """The sampling fields that are set, in generation_config.json's names."""
        return {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}

    def to_hf(self) -> dict[str, Any]:
        """The keys this record contributes to a generation_config.json (eos an int when it is one id)."""
        out: dict[str, Any] = {}
        if self.eos_token_ids:
            out["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        if self.do_sample is not None:
            out["do_sample"] = self.do_sample
        return {**out, **self.sampling()}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# field -> (check, what a good value is); ranges as the server's SamplingParams accepts them.
_CHECKS = {
    "temperature": (lambda v: _number(v) and 0 <= v <= 100, "a number in [0, 100]"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _integer(v) and v >= -1, "an integer >= -1 (0 or -1: off)"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _number(v) and 0.01 <= v <= 10, "a number in [0.01, 10]"),
    "max_new_tokens": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
}


def generation_settings(data: Any, where: str, allowed: tuple[str, ...] | None = None) -> GenerationSettings:
    """A generation_config.json's mapping as a record; ArtifactError naming `where` and the field.
    `allowed`: the only keys accepted (any other is refused), for --override-generation-config."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{where}: expected a JSON object")
    if allowed is not None:
        extra = sorted(k for k in data if k not in allowed)
        if extra:
            raise ArtifactError(f"{where}: field {extra[0]!r} is not supported; use {', '.join(allowed)}")
    values: dict[str, Any] = {}
    for name, (ok, what) in _CHECKS.items():
        v = data.get(name)
        if v is None:
            continue
        if not ok(v):
            raise ArtifactError(f"{where}: field {name} is {v!r}; expected {what}")
        values[name] = float(v) if name not in ("top_k", "max_new_tokens", "do_sample") else v
    eos = data.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]  # [] is no end id, as in transformers
        if not all(_integer(i) and i >= 0 for i in ids):
            raise ArtifactError(f"{where}: field eos_token_id is {eos!r}; expected a token id or a list of them")
        values["eos_token_ids"] = list(dict.fromkeys(ids))  # order kept (the export writes it back), no repeats
    return GenerationSettings(**values)


def read_generation_config(directory: str | os.PathLike) -> GenerationSettings | None:
    """The record of `directory`/generation_config.json; None when there is none."""
    path = artifact_path(directory, GENERATION_CONFIG)
    if not path.is_file():
        return None
    return generation_settings(read_json(path, "generation config"), str(path))
