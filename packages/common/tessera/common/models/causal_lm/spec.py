"""The causal LM's entry in the kind registry (tessera.common.models.registry).

Imports only the config: the model, its Hugging Face adapter and its parallel plan load when a
stage asks for them, so validating a config stays light.
"""

from __future__ import annotations

from typing import Any

from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.kind import HFAdapter, ModelKind, ParallelPlan, StageHooks


def build(cfg: ModelConfig, **kwargs: Any) -> Any:
    """The single-device model (`build_model`: device, dtype, seed)."""
    from tessera.common.models.causal_lm.model import build_model

    return build_model(cfg, **kwargs)


def hf() -> HFAdapter:
    from tessera.common.models.causal_lm.hf import adapter

    return adapter  # type: ignore[return-value]  # a module with the protocol's functions


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from tessera.common.models.causal_lm.model import model_tensor_shapes

    return model_tensor_shapes(cfg)


def parallel() -> ParallelPlan:
    from tessera.common.models.causal_lm.parallelize import PLAN

    return PLAN


CAUSAL_LM = ModelKind(
    name="causal_lm",
    description="decoder-only transformer trained on next-token prediction (GPT-2, Llama, Mistral, Qwen2/3, "
                "Mixtral, Qwen3-MoE)",
    config=ModelConfig,
    build=build,
    hf=hf,
    parallel=parallel,
    flops_per_token=ModelConfig.flops_per_token,
    hooks=StageHooks(train_batch="next_token", train_loss="next_token", serve_runner="decoder",
                     serve_cache="paged_kv", convert="decoder", plan_memory="decoder"),
    tensor_shapes=tensor_shapes,
)
