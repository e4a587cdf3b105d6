"""What one Hugging Face architecture must provide, and a typed reader for its config.json.

An architecture (Llama, GPT-2; Mistral, Qwen2 and Mixtral next) is one `HFArchitecture`
subclass in its own module, listed once in `registry.ARCHITECTURES`: its config mapping in both
directions (config.json <-> ModelConfig) and its tensor mapping in both directions (Tessera names
<-> transformers names, with any transposes, fused tensors and head tying). Everything else
(reading a directory, validating weights, import, export, serving) is shared and goes through it.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from pydantic import BaseModel, ValidationError

from tessera.common.errors import ArtifactError, UserError
from tessera.common.hf.rules import Rule
from tessera.common.models.causal_lm.config import ModelConfig

HEAD = "lm_head.weight"  # the untied output head, under this name in every causal-LM class
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MISSING = object()


class HFConfig:
    """config.json values read with their JSON types checked: every problem is one line naming the
    file and the field. A value of null counts as absent (transformers writes `"head_dim": null`)."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data, self.source = data, source

    def fail(self, key: str, message: str) -> NoReturn:
        raise ArtifactError(f"{self.source}: field {key!r} {message}")

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                self.fail(key, f"missing; not a complete {self.data.get('model_type')} config.json")
            return default
        return value

    def integer(self, key: str, default: Any = _MISSING, positive: bool = True) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or (positive and value <= 0):
            self.fail(key, f"must be a {'positive ' if positive else ''}integer, got {value!r}")
        return value

    def number(self, key: str, default: Any = _MISSING, positive: bool = False) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
            self.fail(key, f"must be a {'positive ' if positive else ''}number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is not default and not isinstance(value, str):
            self.fail(key, f"must be a string, got {value!r}")
        return value

    def obj(self, key: str) -> HFConfig | None:
        value = self._get(key, None)
        if value is None:
            return None
        if not isinstance(value, dict):
            self.fail(key, f"must be a JSON object, got {value!r}")
        return HFConfig(value, f"{self.source}: {key}")

    def require(self, key: str, value: Any, allowed: tuple[Any, ...], why: str) -> None:
        """Refuse a setting Tessera's model does not implement (never ignore it)."""
        if value not in allowed:
            self.fail(key, f"= {value!r} is not supported ({why})")


class HFArchitecture:
    """One transformers architecture. Subclasses set the three names and implement the mappings."""

    model_type: str  # config.json "model_type"
    hf_class: str  # config.json "architectures"[0], the transformers class
    arch: str  # ModelConfig.arch

    # ---- config.json <-> ModelConfig ----------------------------------------------------------
    def model_config(self, data: dict[str, Any], source: str, config_class: type[BaseModel]) -> Any:
        """The kind's `config_class` built from `config_fields`; a value it refuses is an
        ArtifactError naming `source` and the field."""
        fields = self.config_fields(HFConfig(data, source))
        try:
            return config_class(arch=self.arch, **fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(map(str, err["loc"]))
            # Name the config.json field too (its name differs from Tessera's: num_hidden_layers, n_layer).
            keys = [k for k, v in data.items() if type(v) is type(err.get("input")) and v == err.get("input")]
            field = f"field {keys[0]!r} = {data[keys[0]]!r}: " if len(keys) == 1 and where else ""
            raise ArtifactError(f"{source}: {field}{'model ' + where + ': ' if where else ''}{err['msg']}") from None

    def config_fields(self, c: HFConfig) -> dict[str, Any]:
        """ModelConfig fields from config.json; refuses (c.fail / c.require) what the model lacks."""
        raise NotImplementedError

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        """This architecture's config.json fields (the shared ones are added by `hf_config`)."""
        raise NotImplementedError

    def check_exportable(self, cfg: ModelConfig) -> None:
        """Raise a UserError if `cfg` has no exact equivalent in this architecture."""
        raise NotImplementedError

    # ---- tensors ------------------------------------------------------------------------------
    def export_rules(self, cfg: ModelConfig) -> list[Rule]:
        """Tessera names -> transformers names, one rule per transformers tensor."""
        raise NotImplementedError

    def import_rules(self, cfg: ModelConfig, hf_names: set[str]) -> list[Rule]:
        """transformers names -> Tessera names, one rule per Tessera parameter (`hf_names`: the
        tensors present, for optional name prefixes)."""
        raise NotImplementedError

    # ---- shared helpers -----------------------------------------------------------------------
    def _refuse_fields(self, cfg: ModelConfig, wanted: dict[str, Any], why: str) -> None:
        wrong = {k: getattr(cfg, k) for k, v in wanted.items() if getattr(cfg, k) != v}
        if wrong:
            raise UserError(f"model config: arch={cfg.arch} with {wrong} has no {self.hf_class} equivalent ({why})")


def prefix_of(hf_names: set[str], prefix: str) -> str:
    """`prefix` when the tensors carry it (a *ForCausalLM save), else "" (a bare base-model save)."""
    return prefix if any(n.startswith(prefix) for n in hf_names) else ""
