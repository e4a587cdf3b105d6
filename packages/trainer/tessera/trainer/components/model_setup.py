"""From config to a trainable module: build, parallelize, recompute, compile — each a function.

The order matters and mirrors torchtitan: the plain model is built (on the meta device, then
materialised and initialised by tessera.common.models.causal_lm.model.build_model); a parallelize step transforms
it for the layout (identity in one process; tessera.trainer.parallel replaces it); activation
recompute wraps blocks or attention cores; torch.compile (optional here: the trainer's step
compiles instead, per block or forward and loss together) compiles the whole forward. None of these change
parameter names, so checkpoints stay layout-invariant.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import Transformer
from tessera.common.models.registry import kind_of

CompileScope = Literal["model", "blocks"]


def build_train_model(cfg: ModelConfig, device: torch.device, seed: int) -> Transformer:
    """fp32 master weights on `device`, initialised from `seed`."""
    return kind_of(cfg).build(cfg, device=device, dtype=torch.float32, seed=seed)


def parallelize(model: Transformer) -> Transformer:
    """Single process: the model as it is. Parallel layouts substitute their own transform."""
    return model


def _checkpointed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return wrapper


def apply_recompute(model: Transformer, mode: str) -> None:
    """Recompute activations in backward instead of storing them.

    selective: only the attention core (scores/softmax/weighted sum: the largest activations per
    FLOP; in a hybrid model, its attention layers'); full: each whole block (a hybrid model's
    layer), keeping only block inputs. Implemented by wrapping the bound `forward`/`core` of each
    module instance, so no wrapper module changes parameter names.
    """
    if mode == "none":
        return
    for block in model.layers.values():
        if mode == "full":
            block.forward = _checkpointed(block.forward)
        elif mode == "selective":
            if hasattr(block, "self_attn"):  # an encoder-decoder block: its self- and cross-attention
                attns = [block.self_attn, block.cross_attn]
            else:
                attns = [block.attn if hasattr(block, "attn") else block.mixer if block.symbol == "*" else None]
            for attn in attns:
                if attn is not None:
                    attn.core = _checkpointed(attn.core)
        else:
            raise ValueError(f"unknown recompute mode {mode!r}")


def apply_compile(model: Transformer) -> None:
    """torch.compile the whole model forward in place (nn.Module.compile keeps parameter names).

    One graph from embedding through final norm and head. The trainer's step compiles instead, per
    block or forward + loss together (tessera.trainer.objectives.step.TrainStep); this is for callers
    that only run the model.
    """
    model.compile()


def compile_blocks(model: nn.Module) -> None:
    """Regional compilation: torch.compile every transformer block's forward in place (the stack
    the kind's parallel plan names). The bound forward (recompute's wrapper when recompute is on)
    is replaced by its compiled version, so module names, hooks (sequence-parallel gathers on norms,
    FSDP's per-block all-gathers) and state dicts are as without compile.

    Dynamo caches by code object and, inlining nn modules, takes parameters as graph inputs: blocks
    of one kind share one compiled graph, so compile time does not grow with depth. Each kind of
    block (sliding window or not, MoE or dense, Mamba or attention) adds a cache entry to that one
    code object, as do evaluation (no grad) and new shapes; past recompile_limit (8 by default) Dynamo would
    run the rest eagerly with only a log line, so the limit is raised to cover every block.
    """
    path = kind_of(model.cfg).parallel().layers
    try:
        stack = model.get_submodule(path)
    except AttributeError:  # a one-process encoder-decoder: its two stacks' blocks, by name (T5Model.layers)
        stack = model.layers
    blocks = list(stack.values() if isinstance(stack, (nn.ModuleDict, dict)) else stack)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(blocks) + 8)
    for block in blocks:
        block.forward = torch.compile(block.forward)


def apply_freeze(model: nn.Module, parts: list[str] | tuple[str, ...]) -> None:
    """training.freeze: the named top-level parts stop requiring gradients. Done before the optimizer
    is built, which takes only parameters that require them (optimizer/optim.py), so frozen weights
    get no gradients and no optimizer state and stay bit-identical."""
    for part in parts:
        for param in getattr(model, part).parameters():
            param.requires_grad_(False)


def prepare_model(cfg: ModelConfig, device: torch.device, seed: int, recompute: str = "none",
                  compile: bool = False, freeze: list[str] | tuple[str, ...] = (), objective=None) -> nn.Module:
    """`objective`: the kind's (tessera.trainer.objectives.registry.parallel_objective), whose
    `prepare_model` the parallel runtime applies before the stage cut (parallel/objective.py):
    applied here too, so both train and count the same weights."""
    model = build_train_model(cfg, device, seed)
    apply_freeze(model, freeze)
    objective_prepare = getattr(objective, "prepare_model", None)
    if objective_prepare is not None:
        model = objective_prepare(model)
    model = parallelize(model)
    apply_recompute(model, recompute)
    if compile:
        apply_compile(model)
    model.train()
    return model
