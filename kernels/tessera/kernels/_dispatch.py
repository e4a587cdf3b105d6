"""When to use a Triton kernel rather than its PyTorch reference."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Triton on CUDA tensors; on CPU only when forced (tests under TRITON_INTERPRET=1)."""
    if not triton_available():
        return False
    if os.environ.get("TESSERA_DISABLE_TRITON") == "1":
        return False
    if tensor.is_cuda:
        return True
    return interpret_mode() and os.environ.get("TESSERA_FORCE_TRITON") == "1"
