"""The model-kind registry: every stage looks a model's kind up here (torchtitan's `TrainSpec`
registry, for the whole pipeline).

A kind is recorded in its config (`kind`, absent in configs and checkpoints older than the field:
causal_lm) and, for a Hugging Face directory, derived from config.json's `architectures`. An
unregistered kind, or a registered one a stage has no code for, is refused in one line naming it
before the stage does any work. To add a kind: a folder `common/models/<kind>/` with its config,
model, HF adapter and parallel plan, a `ModelKind` for it, listed in `KINDS`; then, in each stage
that handles it, its code under the hook names the entry gives (see `StageHooks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from tessera.common.errors import ArtifactError, UserError
from tessera.common.models.causal_lm.spec import CAUSAL_LM
from tessera.common.models.encoder.spec import ENCODER
from tessera.common.models.encoder_decoder.spec import ENCODER_DECODER
from tessera.common.models.hybrid.spec import HYBRID
from tessera.common.models.kind import HFAdapter, ModelKind
from tessera.common.models.vision_language.spec import VISION_LANGUAGE

__all__ = ["DEFAULT_KIND", "KINDS", "ModelKind", "hf_adapter", "kind_for_hf", "kind_of", "model_config",
           "model_config_from_hf", "model_kind", "stage_hook"]

KINDS: dict[str, ModelKind] = {k.name: k for k in (CAUSAL_LM, HYBRID, ENCODER, VISION_LANGUAGE, ENCODER_DECODER)}
DEFAULT_KIND = CAUSAL_LM.name  # what a config without `kind` is
T = TypeVar("T")

_HOOK_LABELS = {"train_batch": "batch builder", "train_loss": "loss", "serve_runner": "model runner",
                "serve_cache": "cache", "convert": "converter", "plan_memory": "memory count"}


def model_kind(name: Any, where: str = "model.kind", error: type[UserError] = UserError) -> ModelKind:
    """The registered kind called `name`, or `error` in one line naming `where`."""
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise error(f"{where}: model kind {name!r} is not one Tessera has (registered: {', '.join(KINDS)})")
    return kind


def kind_of(cfg: Any) -> ModelKind:
    """The kind of a model config: any kind's config, or its fields as a mapping (`kind` absent:
    causal_lm)."""
    if isinstance(cfg, Mapping):
        return model_kind(cfg.get("kind", DEFAULT_KIND))
    return model_kind(getattr(cfg, "kind", DEFAULT_KIND))


def model_config(data: Mapping[str, Any], where: str = "model") -> Any:
    """`data` validated as its kind's config (`kind` absent: causal_lm). The kind is checked first,
    so an unregistered one is refused by name, not by the config class's first complaint."""
    if not isinstance(data, Mapping):
        raise UserError(f"{where}: expected a mapping of model config fields, got {type(data).__name__}")
    kind = model_kind(data.get("kind", DEFAULT_KIND), f"{where}.kind")
    return kind.config.model_validate(dict(data))


def stage_hook(cfg_or_kind: Any, hook: str, table: Mapping[str, T], stage: str) -> T:
    """A stage's code for a kind: `table[hook name the kind's entry gives]`, or a one-line UserError
    saying the stage does not handle the kind and which kinds it does."""
    kind = cfg_or_kind if isinstance(cfg_or_kind, ModelKind) else kind_of(cfg_or_kind)
    name = getattr(kind.hooks, hook)
    if name is None or name not in table:
        handled = [k.name for k in KINDS.values() if getattr(k.hooks, hook) in table]
        raise UserError(f"model kind {kind.name!r}: {stage} has no {_HOOK_LABELS[hook]} for it "
                        f"({stage} handles {', '.join(handled) or 'no kind'})")
    return table[name]


# ---- Hugging Face: which kind a config.json is, and its adapter ---------------------------------

def hf_adapter(cfg_or_kind: Any) -> HFAdapter:
    kind = cfg_or_kind if isinstance(cfg_or_kind, ModelKind) else kind_of(cfg_or_kind)
    return kind.hf()


def kind_for_hf(data: Any, source: str) -> ModelKind:
    """The kind whose adapter claims this config.json (by `architectures`, else `model_type`).
    The causal LM's adapter claims every transformers causal-LM head (to refuse the families it
    lacks by name), so it is asked last: a kind that claims the class itself wins."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: expected a JSON object")
    for kind in sorted(KINDS.values(), key=lambda k: k is CAUSAL_LM):
        if kind.hf().claims(data):
            return kind
    archs = data.get("architectures") or []
    named = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "no architectures"
    reads = "; ".join(f"{k.name}: {k.hf().supported()}" for k in KINDS.values())
    raise ArtifactError(f"{source}: unsupported architecture {data.get('model_type')!r} ({named}), of no model kind "
                        f"Tessera has; Tessera reads {reads}")


def model_config_from_hf(data: Any, source: str) -> Any:
    """The config (of the kind config.json describes) equivalent to an HF config.json; whatever the
    kind's model cannot express exactly is an ArtifactError naming `source`."""
    return kind_for_hf(data, source).hf().model_config_from_hf(data, source)
