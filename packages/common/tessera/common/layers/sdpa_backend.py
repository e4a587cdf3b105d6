"""Which fused kernel `F.scaled_dot_product_attention` runs (Megatron's `--attention-backend`).

SDPA chooses among FlashAttention-2, cuDNN's fused attention, the memory-efficient kernel and the
unfused math path by a fixed priority order and by what each supports for the call. That order is
not the fastest on every GPU (on Hopper cuDNN's kernel is the candidate the step breakdown of issue
#34 asks about), so a run can name one: only that backend is enabled, for the duration of a
training step or an evaluation, forward and backward (and a recompute inside backward), under
every parallel layout. Under torch.compile the kernel is picked when the step is traced, which
happens inside the same setting (the first step); on CPU inductor replaces SDPA with its own
kernels whatever the setting. Nothing falls back silently to a slower kernel: a call the chosen
backend cannot run stops with a one-line error naming the setting.

Not affected: FlexAttention (packed documents and sliding windows on CUDA,
`tessera.common.layers.attention`) and the serving engine's paged attention, which are their own
kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tessera.common.errors import UserError

AttentionBackend = Literal["auto", "flash", "cudnn", "efficient", "math"]

_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
_CPU_BACKENDS = ("flash", "math")  # what SDPA implements on CPU (flash = its CPU flash kernel)

# PyTorch's messages when no enabled backend can take a call (torch 2.11-2.13).
_NO_KERNEL = ("No available kernel", "No viable backend for scaled_dot_product_attention")


def sdpa_backend_problem(name: AttentionBackend, device: torch.device, field: str) -> str | None:
    """Why `name` cannot run on `device` at all (checked before any work), or None."""
    if name == "auto":
        return None
    if device.type != "cuda":
        if name not in _CPU_BACKENDS:
            return (f"{field}={name} needs a CUDA device (on {device.type} SDPA has "
                    f"{' and '.join(_CPU_BACKENDS)}); use auto, flash or math")
        return None
    if name == "cudnn" and not torch.backends.cudnn.is_available():
        return f"{field}=cudnn but this torch has no cuDNN; use auto, flash or efficient"
    if name == "flash" and torch.cuda.get_device_capability(device) < (8, 0):
        return f"{field}=flash needs compute capability 8.0+ (this GPU is {torch.cuda.get_device_capability(device)}); use auto"
    return None


@contextmanager
def sdpa_backend(name: AttentionBackend, field: str = "training.attention_backend") -> Iterator[None]:
    """Run the block with only `name`'s SDPA kernel enabled ("auto": PyTorch's own choice, untouched).

    A call that kernel cannot take (e.g. FlashAttention with an arbitrary mask on CUDA, or with
    attention dropout on CPU) raises UserError naming `field`, instead of PyTorch's RuntimeError.
    """
    if name == "auto":
        yield
        return
    try:
        with sdpa_kernel(_BACKENDS[name]):
            yield
    except RuntimeError as exc:
        if not any(marker in str(exc) for marker in _NO_KERNEL):
            raise
        raise UserError(f"{field}={name} cannot run this model's attention (PyTorch's SDPA refused the call: "
                        f"see its warnings above for why); use auto") from exc
