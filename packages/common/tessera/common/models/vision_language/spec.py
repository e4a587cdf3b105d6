"""The vision-language kind's entry in the kind registry (tessera.common.models.registry).

Imports only the config: the model and its Hugging Face adapter load when a stage asks for them.
"vision_language" conversions in tessera-ckpt (Hugging Face import / export, reshard), one-process
training in tessera-train (tessera.trainer.objectives.multimodal: image-text batches, the answer loss) and the
parallel plan (parallelize.py: tensor parallel for the tower, projector and language model, the
tower on the first pipeline stage), and tessera-serve (tessera.inference.worker.multimodal: one
process or tensor parallel). A stage without code for the kind (the parallel runtime's stages)
refuses it by name.
"""

from __future__ import annotations

from typing import Any

from tessera.common.models.kind import HFAdapter, ModelKind, ParallelPlan, StageHooks
from tessera.common.models.vision_language.config import VisionLanguageConfig


def build(cfg: VisionLanguageConfig, **kwargs: Any) -> Any:
    """The single-device model (`build_model`: device, dtype, seed)."""
    from tessera.common.models.vision_language.model import build_model

    return build_model(cfg, **kwargs)


def hf() -> HFAdapter:
    from tessera.common.models.vision_language.hf import adapter

    return adapter  # type: ignore[return-value]  # a module with the protocol's functions


def tensor_shapes(cfg: VisionLanguageConfig) -> dict[str, tuple[int, ...]]:
    from tessera.common.models.vision_language.model import model_tensor_shapes

    return model_tensor_shapes(cfg)


def parallel() -> ParallelPlan:
    from tessera.common.models.vision_language.parallelize import PLAN

    return PLAN


VISION_LANGUAGE = ModelKind(
    name="vision_language",
    description="LLaVA: a ViT vision tower (CLIP or SigLIP) and projector whose image features replace the image "
                "tokens of a causal LM",
    config=VisionLanguageConfig,
    build=build,
    hf=hf,
    parallel=parallel,
    flops_per_token=VisionLanguageConfig.flops_per_token,
    hooks=StageHooks(train_batch="vision_language", train_loss="vision_language", convert="vision_language",
                     serve_runner="vision_language", serve_cache="paged_kv"),
    tensor_shapes=tensor_shapes,
    vocab_params=("language_model.embed_tokens.weight", "language_model.lm_head.weight"),
)
