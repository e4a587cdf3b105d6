"""The checkpointed pieces of a run, each a small stateful component (torchtitan's shape).

A component names its own tensors with full checkpoint keys (`model.<param>`,
`optimizer.state.<param>.<key>`, `scaler.scale`, `rng.torch_cpu`, `train_state.step`; the
contract is in tessera.trainer.components.checkpoint.storage) and answers three questions:

    state_dict()            what to save (tensors or global DTensors; may be a collective)
    load_template(stored)   what to read, given the keys the checkpoint holds: tensors of the
                            right shapes and placements for DCP to fill ({}: nothing to restore)
    load_state_dict(state)  take the filled template

The execution engine supplies the model, optimizer, loss scaler and RNG components for its
layout (tessera.trainer.engine, tessera.trainer.parallel.engine); the checkpoint manager adds the
data position (TrainState) and reads and writes them all the same way. The LR schedule is a pure
function of train_state.step, so it needs no component of its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from tessera.trainer.components.optimizer.optim import named_parameters_of


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_template(self, stored: set[str]) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """Where the run is: the loop's counters (the data position is consumed_samples)."""

    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in vars(self).items()}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> TrainState:
        return cls(**{k: int(v) for k, v in t.items()})


def seed_everything(seed: int) -> None:
    """Seed every RNG a run may draw from (dropout uses torch's; python's and numpy's for user code)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---- RNG states as tensors ---------------------------------------------------------------------


def rng_state_tensors() -> dict[str, torch.Tensor]:
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if py_gauss is None else py_gauss], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_pos": torch.tensor([np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state_tensors(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    gauss = float(state["python_gauss"][0])
    random.setstate((3, tuple(int(x) for x in state["python_state"].tolist()), None if gauss != gauss else gauss))
    pos, has_gauss = (int(x) for x in state["numpy_pos"].tolist())
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state["numpy_gauss"][0])))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


class RNGState:
    """Every RNG the run draws from, under `prefix` (`rng.` in one process; `rng.rank<R>.` per rank
    in a parallel run, whose dropout streams differ across pipeline stages and tensor ranks), plus
    the tensor-parallel stream of a parallel run (`extra`). A resume on another device restores the
    states both sides have (a CPU-saved run on a GPU: all but torch_cuda)."""

    def __init__(self, prefix: str = "rng.", extra: Any = None):
        self.prefix, self.extra = prefix, extra

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {**rng_state_tensors(), **(self.extra.state_dict() if self.extra is not None else {})}

    def state_dict(self) -> dict[str, Any]:
        return {self.prefix + k: v for k, v in self._tensors().items()}

    def load_template(self, stored: set[str]) -> dict[str, Any]:
        return {k: v for k, v in self.state_dict().items() if k in stored}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng = {k.removeprefix(self.prefix): v for k, v in state.items()}
        if "torch_cpu" not in rng:
            return
        set_rng_state_tensors(rng)
        if self.extra is not None:
            self.extra.load_state_dict(rng)


class ScalerState:
    """The fp16 loss scaler (Precision's GradScaler or the parallel runtime's DynamicLossScale: the
    same keys, so fp16 runs resume across layouts). A checkpoint without one (saved in fp32/bf16)
    leaves the fresh scale."""

    def __init__(self, scaler: Any):
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return {f"scaler.{k}": v for k, v in self.scaler.state_tensors().items()}

    def load_template(self, stored: set[str]) -> dict[str, Any]:
        if "scaler.scale" not in stored:
            return {}
        return {"scaler.scale": torch.zeros((), dtype=torch.float64),
                "scaler.growth_tracker": torch.zeros((), dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_tensors({k.removeprefix("scaler."): v for k, v in state.items()})


# ---- one process: the model and torch's AdamW ---------------------------------------------------


class ModuleState:
    """A plain module's tensors under `model.`; they are views of its parameters, so DCP loads in place."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in self.model.state_dict().items()}

    def load_template(self, stored: set[str]) -> dict[str, Any]:
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # filled in place


class OptimizerState:
    """torch AdamW state keyed by parameter name (`optimizer.state.<name>.<key>`), not position."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for name, p in named_parameters_of(self.optimizer):
            for k, v in (self.optimizer.state.get(p) or {}).items():
                if torch.is_tensor(v):
                    out[f"optimizer.state.{name}.{k}"] = v
        return out

    def load_template(self, stored: set[str]) -> dict[str, Any]:
        """Empty AdamW state of the right shapes to load into (a fresh optimizer has none yet), for
        the parameters the checkpoint has state for (none, e.g., when every fp16 step so far was skipped)."""
        step_device = None if self.optimizer.defaults.get("fused") else "cpu"
        out = {}
        for name, p in named_parameters_of(self.optimizer):
            key = f"optimizer.state.{name}."
            if key + "exp_avg" not in stored:
                continue
            out[key + "step"] = torch.zeros((), dtype=torch.float32, device=step_device or p.device)
            out[key + "exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out[key + "exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sd = self.optimizer.state_dict()
        names = [n for n, _ in named_parameters_of(self.optimizer)]
        by_param = {}
        for i, name in enumerate(names):
            key = f"optimizer.state.{name}."
            if key + "exp_avg" in state:
                by_param[i] = {k: state[key + k] for k in ("step", "exp_avg", "exp_avg_sq")}
        sd["state"] = by_param
        self.optimizer.load_state_dict(sd)
