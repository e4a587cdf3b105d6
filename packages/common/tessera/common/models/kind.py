"""What a model kind gives the stages: `ModelKind`, the typed entry of the kind registry.

Modelled on torchtitan's `TrainSpec` (one record per model: its class, config, parallelize and
pipelining functions, loss, state-dict adapter), widened to every stage of the pipeline. Things
common can hold (config class, builder, Hugging Face adapter, parallel plan, FLOP count) are held
directly; the heavy ones are loaded only when asked for, so a stage that merely validates a config
imports no torch module. What lives in a stage (batches, losses, runners, caches, converters,
memory counts) is named here, and each stage maps the names to its own code: a stage must never be
imported by common, and two kinds that train alike share a name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel

if TYPE_CHECKING:
    import torch
    from torch import nn


class HFAdapter(Protocol):
    """A kind's Hugging Face mapping (config.json and tensor names, both directions). A module
    with these functions qualifies (the causal LM's is `causal_lm.hf.adapter`)."""

    def claims(self, data: dict[str, Any]) -> bool: ...
    def supported(self) -> str: ...
    def model_config_from_hf(self, data: dict[str, Any], source: str) -> Any: ...
    def hf_config(self, cfg: Any, dtype: torch.dtype, bos_id: int | None, eos_id: int | None,
                  pad_id: int | None = None) -> dict[str, Any]: ...
    def check_exportable(self, cfg: Any) -> None: ...
    def export_rules(self, cfg: Any) -> list: ...
    def import_rules(self, cfg: Any, hf_names: set[str]) -> tuple[list, frozenset[str]]: ...


@dataclass(frozen=True)
class ParallelPlan:
    """Where parallelism may cut the kind's model, by module name.

    `column` / `row`: the Linear layers tensor parallel splits by output rows / input columns;
    `vocab`: those split by vocabulary rows; everything else is replicated. `layers`: the
    ModuleDict of blocks keyed by global layer number, between whose entries pipeline stages cut;
    `first_stage` / `last_stage`: modules only the first / last stage keeps. `tensor` applies the
    tensor-parallel plan to a model in place (model, groups, sequence_parallel, rng)."""

    column: tuple[str, ...]
    row: tuple[str, ...]
    vocab: tuple[str, ...]
    layers: str
    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    tensor: Callable[..., nn.Module]


@dataclass(frozen=True)
class StageHooks:
    """Names each stage maps to its own code for this kind (None: the stage does not handle it).

    train_batch / train_loss: tessera-train's batch builder and loss; serve_runner / serve_cache:
    tessera-serve's model runner and cache; convert: tessera-ckpt's mappings beyond the HF adapter
    (TensorRT-LLM, Megatron); plan_memory: tessera-plan's memory count (its FLOPs are the kind's)."""

    train_batch: str | None = None
    train_loss: str | None = None
    serve_runner: str | None = None
    serve_cache: str | None = None
    convert: str | None = None
    plan_memory: str | None = None


@dataclass(frozen=True)
class ModelKind:
    """One model kind: what every stage needs to know about it, in one place."""

    name: str  # the `kind` field of its config, checkpoint sidecars included
    description: str
    # Its config class; its methods check_layout / check_tensor_parallel, where given, are the kind's part of
    # validate_layout (tessera.common.layout, which the registry's imports would put in an import cycle).
    config: type[BaseModel]
    build: Callable[..., nn.Module]  # build(cfg, device, dtype, seed): the single-device model
    hf: Callable[[], HFAdapter]  # its Hugging Face adapter (loaded when asked for)
    parallel: Callable[[], ParallelPlan]  # its parallel plan (loaded when asked for)
    flops_per_token: Callable[[Any, int], float]  # training FLOPs per token at a sequence length
    hooks: StageHooks
    # Name -> shape of every tensor its checkpoints store under `model.` (the state dict), without
    # building the model: what every checkpoint reader checks the DCP index against before it
    # allocates anything. None only for a kind no stage reads yet (each stage refuses it by name);
    # tests/ckpt_convert/test_hostile_model_files.py holds every other kind to having one.
    tensor_shapes: Callable[[Any], dict[str, tuple[int, ...]]] | None = None
    # Stored tensors with one row per vocabulary entry (split by vocabulary rows under tensor
    # parallel), for kinds whose names are not the causal LM's `embed_tokens` / `lm_head`.
    vocab_params: tuple[str, ...] = ()
