"""The encoder's entry in the kind registry (tessera.common.models.registry).

Imports only the config: the model, its Hugging Face adapter and its parallel plan load when a
stage asks for them. The stage hooks name the code each stage has for the kind: "encoder"
conversions in tessera-ckpt; the trainer's masked-LM batch and loss and the server's embeddings
runner are added under their names by the stages that build them.
"""

from __future__ import annotations

from typing import Any

from tessera.common.models.encoder.config import EncoderConfig
from tessera.common.models.kind import HFAdapter, ModelKind, ParallelPlan, StageHooks


def build(cfg: EncoderConfig, **kwargs: Any) -> Any:
    """The single-device model (`build_model`: device, dtype, seed)."""
    from tessera.common.models.encoder.model import build_model

    return build_model(cfg, **kwargs)


def hf() -> HFAdapter:
    from tessera.common.models.encoder.hf import adapter

    return adapter  # type: ignore[return-value]  # a module with the protocol's functions


def tensor_shapes(cfg: EncoderConfig) -> dict[str, tuple[int, ...]]:
    from tessera.common.models.encoder.model import model_tensor_shapes

    return model_tensor_shapes(cfg)


def parallel() -> ParallelPlan:
    from tessera.common.models.encoder.parallelize import PLAN

    return PLAN


ENCODER = ModelKind(
    name="encoder",
    description="bidirectional transformer encoder trained on masked tokens (+ an optional next-sentence / "
                "sentence-order head), served as embeddings (BERT)",
    config=EncoderConfig,
    build=build,
    hf=hf,
    parallel=parallel,
    flops_per_token=EncoderConfig.flops_per_token,
    hooks=StageHooks(train_batch="mlm", train_loss="mlm", convert="encoder", serve_runner="pooling", serve_cache="none"),
    tensor_shapes=tensor_shapes,
)
