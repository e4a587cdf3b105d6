"""Mixed precision: autocast over fp32 master weights, and dynamic loss scaling for fp16.

Choice (documented in docs/cli/tessera-train.md): parameters, gradients and optimizer state stay
fp32 in every mode; bf16/fp16 runs wrap the forward in torch.autocast, which computes matmuls and
attention in the low precision from fp32 weights. That gives "fp32 master weights and fp32
grads" without keeping a second copy of the model. fp16 adds torch.amp.GradScaler: the loss is
multiplied by the scale before backward, gradients are unscaled before clipping, and a step whose
gradients hold inf/nan is skipped and the scale halved (the loop logs it). fp8 is bf16 autocast;
with training.fp8_backend=te the forward also enters Transformer Engine's FP8 autocast with the
recipe (`fp8_context`, from tessera.trainer.components.precision.te_float8.apply_te), inside torch's: the one place a
forward enters either. Backward runs outside both, as TE's and torch's autocast expect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

# fp8 autocasts to bf16; its Linear layers are torchao Float8Linear (tessera.trainer.components.precision.torchao_float8) or
# Transformer Engine Linear (tessera.trainer.components.precision.te_float8).
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class Precision:
    def __init__(self, mode: str, device: torch.device, initial_scale: float = 2.0**16, growth_interval: int = 1000,
                 fp8_context: Callable[[], contextlib.AbstractContextManager] | None = None):
        if fp8_context is not None and mode != "fp8":
            raise ValueError(f"an FP8 context is for precision fp8, not {mode}")
        self.mode = mode
        self.device = device
        self.fp8_context = fp8_context
        self.scaler: torch.amp.GradScaler | None = None
        if mode == "fp16":
            self.scaler = torch.amp.GradScaler(device.type, init_scale=initial_scale, growth_interval=growth_interval)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mode == "fp32":
            return contextlib.nullcontext()
        if self.fp8_context is None:
            return torch.autocast(self.device.type, dtype=_DTYPES[self.mode])
        return self._both_autocasts()

    @contextlib.contextmanager
    def _both_autocasts(self):
        with torch.autocast(self.device.type, dtype=_DTYPES[self.mode]), self.fp8_context():
            yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take the optimizer step unless fp16 gradients overflowed; True when the step was taken."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # GradScaler halves the scale exactly when it skipped the step for inf/nan gradients.
        return self.scaler.get_scale() >= before

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler is not None else None

    # Checkpointed as tensors only (no pickled objects in checkpoints).
    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.scaler is None:
            return {}
        sd = self.scaler.state_dict()
        return {"scale": torch.tensor(float(sd["scale"]), dtype=torch.float64),
                "growth_tracker": torch.tensor(int(sd["_growth_tracker"]), dtype=torch.int64)}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        if self.scaler is None or not state:
            return
        sd = self.scaler.state_dict()
        sd["scale"] = float(state["scale"])
        sd["_growth_tracker"] = int(state["growth_tracker"])
        self.scaler.load_state_dict(sd)


def _float32(x: float) -> float:
    """GradScaler keeps its scale in a float32 tensor: round the same way for identical scales."""
    return float(torch.tensor(x, dtype=torch.float32))


class DynamicLossScale:
    """torch.amp.GradScaler's policy, for a runtime that unscales and checks gradients itself.

    The parallel runtime keeps gradients in flat buffers sharded over data-parallel ranks, and
    its global gradient norm already tells every rank whether any gradient overflowed; what it
    needs from the caller is only the scale to multiply the loss by, and the policy: halve it
    on overflow (the step is skipped), double it after `growth_interval` clean steps. Same
    defaults, same checkpoint keys (`scaler.scale`, `scaler.growth_tracker`) as `Precision`, so
    fp16 runs resume across the one-process and parallel paths.
    """

    def __init__(self, initial_scale: float = 2.0**16, growth_interval: int = 1000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.scale = _float32(initial_scale)
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_tracker = 0

    @property
    def loss_scale(self) -> float:
        return self.scale

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale = _float32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale = _float32(self.scale * self.growth_factor)
            self.growth_tracker = 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"scale": torch.tensor(self.scale, dtype=torch.float64),
                "growth_tracker": torch.tensor(self.growth_tracker, dtype=torch.int64)}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            self.scale = float(state["scale"])
            self.growth_tracker = int(state["growth_tracker"])
