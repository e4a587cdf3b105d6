"""The encoder-decoder's entry in the kind registry (tessera.common.models.registry).

Imports only the config: the model, its Hugging Face adapter and its parallel plan load when a
stage asks for them. Hooks: tessera-ckpt's "encoder_decoder" conversions, the trainer's "span"
batch and loss (span corruption, tessera.trainer.objectives.span); the server's runner and cache are added
by the serving work under their own names.
"""

from __future__ import annotations

from typing import Any

from tessera.common.models.encoder_decoder.config import T5Config
from tessera.common.models.kind import HFAdapter, ModelKind, ParallelPlan, StageHooks


def build(cfg: T5Config, **kwargs: Any) -> Any:
    from tessera.common.models.encoder_decoder.model import build_model

    return build_model(cfg, **kwargs)


def hf() -> HFAdapter:
    from tessera.common.models.encoder_decoder.hf import adapter

    return adapter  # type: ignore[return-value]  # a module with the protocol's functions


def tensor_shapes(cfg: T5Config) -> dict[str, tuple[int, ...]]:
    from tessera.common.models.encoder_decoder.model import model_tensor_shapes

    return model_tensor_shapes(cfg)


def parallel() -> ParallelPlan:
    from tessera.common.models.encoder_decoder.parallelize import PLAN

    return PLAN


ENCODER_DECODER = ModelKind(
    name="encoder_decoder",
    description="T5 encoder-decoder (relative position buckets, cross-attention) trained on span "
                "corruption, served as completions",
    config=T5Config,
    build=build,
    hf=hf,
    parallel=parallel,
    flops_per_token=T5Config.flops_per_token,
    hooks=StageHooks(train_batch="span", train_loss="span", convert="encoder_decoder", serve_runner="encoder_decoder",
                     serve_cache="paged_kv_cross"),
    tensor_shapes=tensor_shapes,
    vocab_params=("shared.weight", "lm_head.weight"),
)
