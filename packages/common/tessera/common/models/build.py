"""Every kind's `build_model`: the module made on the meta device, materialised once on the
target device (no memory allocated twice), initialised in place from the seed."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.common.layers.rope import reset_rotary_tables


def build_on_meta(make: Callable[[], nn.Module], device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32, seed: int | None = 0) -> nn.Module:
    """`make()` on the meta device, materialised on `device` and initialised by the model's
    `init_weights(generator)` from `seed`; seed=None leaves the weights for a checkpoint to fill
    (the rotary tables, computed rather than stored, are still computed)."""
    with torch.device("meta"):
        model = make()
    model.to_empty(device=device)
    if seed is not None:
        model.init_weights(torch.Generator(device=device).manual_seed(seed))
    else:
        reset_rotary_tables(model)
    return model.to(dtype=dtype) if dtype != torch.float32 else model
