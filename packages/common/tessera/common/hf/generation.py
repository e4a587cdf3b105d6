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
with nulls). Real repositories ship odd files (`top_p: 0`, a string, an end id of -1): reading one
never fails. A value the server's sampler cannot take is left out of the record and kept, as found,
in `ignored` (import warns, `tessera-ckpt info` shows it); serving decides what to do with it
(`for_serving`: as vLLM would). Only --override-generation-config, a flag, is refused outright.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessera.common.errors import ArtifactError
from tessera.common.fileio import artifact_path

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
    ignored: dict[str, Any] | None = Field(None, description=(
        "Fields of the source file left out for a value the sampler cannot take, as found (not written back)."))

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
    """A mapping of generation fields as a record, every value checked: ArtifactError naming `where`
    and the field. `allowed`: the only keys accepted (any other is refused), for
    --override-generation-config."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{where}: expected a JSON object")
    if allowed is not None:
        extra = sorted(k for k in data if k not in allowed)
        if extra:
            raise ArtifactError(f"{where}: field {extra[0]!r} is not supported; use {', '.join(allowed)}")
    record = lenient_generation_settings(data, where)
    if record.ignored:
        name, value = next(iter(record.ignored.items()))
        raise ArtifactError(f"{where}: field {name} is {value!r}; {_what(name)}")
    return record


def lenient_generation_settings(data: Any, where: str) -> GenerationSettings:
    """A generation_config.json's mapping as a record that never fails on a value: one the sampler
    cannot take (an end id that is no token id included) is left out and kept in `ignored`."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{where}: expected a JSON object")
    values: dict[str, Any] = {}
    ignored: dict[str, Any] = {}
    for name, (ok, _) in _CHECKS.items():
        v = data.get(name)
        if v is None:
            continue
        if not ok(v):
            ignored[name] = v
            continue
        values[name] = float(v) if name not in ("top_k", "max_new_tokens", "do_sample") else v
    eos = data.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]  # [] is no end id, as in transformers
        good = [i for i in ids if _integer(i) and i >= 0]
        if len(good) != len(ids):
            ignored["eos_token_id"] = eos  # the good ids still end generation (vLLM never matches a bad one)
        values["eos_token_ids"] = list(dict.fromkeys(good))  # order kept (the export writes it back), no repeats
    return GenerationSettings(**values, ignored=ignored or None)


# field -> what vLLM's SamplingParams also accepts. A default outside it fails every vLLM request that
# leaves the field out; one inside it that the server's sampler cannot take (temperature 150,
# repetition_penalty 20) vLLM serves, so it is dropped here with a warning, never refused.
_VLLM_TAKES = {
    "temperature": lambda v: _number(v) and v >= 0,
    "repetition_penalty": lambda v: _number(v) and v > 0,
}


def for_serving(record: GenerationSettings | None, mode: str, where: str,
                warn: Any = None) -> GenerationSettings | None:
    """The record a server uses under --generation-config `mode` (auto, vllm or a folder), as vLLM
    treats the same file: under vllm the sampling fields are not read (the end ids are); otherwise a
    field vLLM's sampler refuses too is one line naming the file, the field and the way out, and any
    other ignored value is dropped with a `warn(message)`."""
    if record is None:
        return None
    for name, value in (record.ignored or {}).items():
        if name == "do_sample" or (mode == "vllm" and name in SAMPLING_FIELDS):
            continue  # not read when serving (do_sample never is, as in vLLM)
        if name in SAMPLING_FIELDS and not _VLLM_TAKES.get(name, lambda v: False)(value):
            raise ArtifactError(f"{where}: field {name} is {value!r}; {_what(name)} (vLLM's sampler "
                                "refuses it too); serve with --generation-config vllm to leave the file's sampling "
                                "defaults out")
        if warn is not None:
            warn(f"{where}: field {name} is {value!r}; ignored ({_what(name)})")
    return GenerationSettings(eos_token_ids=record.eos_token_ids) if mode == "vllm" else record


def _what(name: str) -> str:
    return f"expected {_CHECKS[name][1]}" if name in _CHECKS else "expected a token id or a list of them"


def read_generation_config(directory: str | os.PathLike, warn: Any = None) -> GenerationSettings | None:
    """The record of `directory`/generation_config.json (odd values in `ignored`); None when there is
    none, or when it is not valid JSON (then `warn(message)`): transformers raises OSError for such a
    file and vLLM serves without it."""
    path = artifact_path(directory, GENERATION_CONFIG)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        if warn is not None:
            warn(f"{path}: not valid JSON ({getattr(exc, 'msg', exc)}); ignored, as vLLM ignores it (no end ids "
                 "or sampling defaults from it)")
        return None
    return lenient_generation_settings(data, str(path))
