"""When to use a Triton kernel rather than its PyTorch reference."""

from __future__ import annotations

import importlib.util
import os

import torch

# Whether Triton is installed, found without importing it (importing it fixes its interpreter
# mode for the process; see docs/kernels.md). A broken install then fails loudly at first use.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_INSTALLED


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
