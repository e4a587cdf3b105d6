"""The hybrid kind's Hugging Face adapter: the architectures it maps to transformers, and the
mapping entry points the kind registry hands to import, export and serving (`ModelKind.hf`).
Same protocol as the causal LM's (tessera.common.models.kind.HFAdapter)."""

from __future__ import annotations

from typing import Any

import torch

from tessera.common.errors import ArtifactError
from tessera.common.hf.architecture import HEAD, HF_DTYPE_NAMES, HFArchitecture, HFConfig
from tessera.common.hf.rules import Rule
from tessera.common.models.hybrid.config import HybridConfig
from tessera.common.models.hybrid.hf.mamba2 import Mamba2
from tessera.common.models.hybrid.hf.nemotron_h import NemotronH

ARCHITECTURES: tuple[HFArchitecture, ...] = (NemotronH(), Mamba2())


def supported() -> str:
    return ", ".join(f"{a.model_type} ({a.hf_class})" for a in ARCHITECTURES)


def claims(data: dict[str, Any]) -> bool:
    """Whether config.json is one of ours: its `architectures` class or its model_type (a bare
    base-model save, e.g. NemotronHModel, names no head)."""
    archs = data.get("architectures")
    named = isinstance(archs, list) and bool(archs) and archs[0] in {a.hf_class for a in ARCHITECTURES}
    return named or data.get("model_type") in {a.model_type for a in ARCHITECTURES}


def architecture_of(data: dict[str, Any], source: str) -> HFArchitecture:
    model_type = HFConfig(data, source).text("model_type")
    for a in ARCHITECTURES:
        if a.model_type == model_type:
            return a
    raise ArtifactError(f"{source}: model_type {model_type!r} does not match its architectures "
                        f"{data.get('architectures')}; Tessera's hybrid kind reads {supported()}")


def architecture_for(cfg: HybridConfig) -> HFArchitecture:
    return next(a for a in ARCHITECTURES if a.arch == cfg.arch)


def model_config_from_hf(data: dict[str, Any], source: str) -> HybridConfig:
    """The HybridConfig equivalent to an HF config.json; what the model cannot express exactly is
    an ArtifactError naming `source` and the field."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: expected a JSON object")
    return architecture_of(data, source).model_config(data, source, HybridConfig)


def hf_config(cfg: HybridConfig, dtype: torch.dtype, bos_id: int | None, eos_id: int | None,
              pad_id: int | None = None) -> dict[str, Any]:
    """config.json for `cfg`, every field transformers writes for the architecture."""
    arch = architecture_for(cfg)
    arch.check_exportable(cfg)
    return {"architectures": [arch.hf_class], "model_type": arch.model_type, **arch.hf_fields(cfg),
            "vocab_size": cfg.vocab_size, "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": bos_id, "eos_token_id": eos_id,
            "pad_token_id": pad_id, "dtype": HF_DTYPE_NAMES[dtype], "use_cache": True}


def check_exportable(cfg: HybridConfig) -> None:
    """Raise a UserError if `cfg` has no exact Hugging Face equivalent."""
    architecture_for(cfg).check_exportable(cfg)


def export_rules(cfg: HybridConfig) -> list[Rule]:
    """Tessera parameter names -> transformers tensors, one rule per transformers tensor."""
    arch = architecture_for(cfg)
    arch.check_exportable(cfg)
    return arch.export_rules(cfg)


def import_rules(cfg: HybridConfig, hf_names: set[str]) -> tuple[list[Rule], frozenset[str]]:
    """(rules producing every Tessera parameter, names that may be present unread: a tied model's
    lm_head)."""
    optional = frozenset({HEAD}) if cfg.tie_embeddings else frozenset()
    return architecture_for(cfg).import_rules(cfg, hf_names), optional
