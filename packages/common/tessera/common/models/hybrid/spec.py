"""The hybrid kind's entry in the kind registry (tessera.common.models.registry).

Imports only the config: the model and its adapter load when a stage asks for them. A stage
whose hook is empty has no code for the kind and refuses it in one line.
"""

from __future__ import annotations

from typing import Any

from tessera.common.models.hybrid.config import HybridConfig
from tessera.common.models.kind import HFAdapter, ModelKind, ParallelPlan, StageHooks


def build(cfg: HybridConfig, **kwargs: Any) -> Any:
    """The single-device model (`build_model`: device, dtype, seed)."""
    from tessera.common.models.hybrid.model import build_model

    return build_model(cfg, **kwargs)


def hf() -> HFAdapter:
    from tessera.common.models.hybrid.hf import adapter

    return adapter  # type: ignore[return-value]  # a module with the protocol's functions


def tensor_shapes(cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
    from tessera.common.models.hybrid.model import model_tensor_shapes

    return model_tensor_shapes(cfg)


def parallel() -> ParallelPlan:
    from tessera.common.models.hybrid.parallelize import PLAN

    return PLAN


HYBRID = ModelKind(
    name="hybrid",
    description="Mamba-2 layers beside attention, MLP and MoE in Megatron's hybrid pattern, trained on next-token "
                "prediction (Nemotron-H, Mamba2)",
    config=HybridConfig,
    build=build,
    hf=hf,
    parallel=parallel,
    flops_per_token=HybridConfig.flops_per_token,
    hooks=StageHooks(train_batch="next_token", train_loss="next_token", plan_memory="decoder", convert="hybrid",
                     serve_runner="hybrid", serve_cache="paged_kv_and_state"),
    tensor_shapes=tensor_shapes,
)
