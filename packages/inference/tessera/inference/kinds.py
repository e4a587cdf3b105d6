"""What tessera-serve runs for each model kind: its model runner and cache under the hook names the
kind registry gives (tessera.common.models.registry). `serving_kind` refuses a kind it has no
code for in one line; the loader asks it before any weight is read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.common.models.registry import stage_hook
from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.state_manager import StateBlockManager
from tessera.inference.worker.model_runner import ModelRunner
from tessera.inference.worker.state.runner import HybridRunner

STAGE = "tessera-serve"


@dataclass(frozen=True)
class ServingKind:
    runner: type[ModelRunner]  # executes a scheduled step over the model and its cache
    cache: type[BlockManager]  # hands out the cache's blocks to sequences


RUNNERS: dict[str, type[ModelRunner]] = {"decoder": ModelRunner}  # paged attention over the decoder stack
RUNNERS["hybrid"] = HybridRunner  # paged attention + Mamba layers over a per-sequence state pool
CACHES: dict[str, type[BlockManager]] = {"paged_kv": BlockManager}  # paged key/value blocks, prefix caching
CACHES["paged_kv_and_state"] = StateBlockManager  # paged K/V of attention layers + one state slot per sequence


def serving_kind(model: Any) -> ServingKind:
    """The server's code for `model`'s kind (a config)."""
    return ServingKind(runner=stage_hook(model, "serve_runner", RUNNERS, STAGE),
                       cache=stage_hook(model, "serve_cache", CACHES, STAGE))
