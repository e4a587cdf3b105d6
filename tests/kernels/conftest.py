"""Fixtures that run the Triton kernels on CPU through Triton's interpreter, or on CUDA for real.

Triton fixes its mode when it is imported: with TRITON_INTERPRET=1 every `triton.jit` function,
its own library (tl.sum, ...) included, becomes an interpreted function, and one process cannot
mix the two modes. `make test` exports TRITON_INTERPRET=1 for the whole run. When this file is
imported before Triton (true for a plain `pytest tests/kernels`), it picks the mode itself:
compiled on a machine with CUDA (the GPU tests then run the real kernels and the interpreter
tests skip), interpreted otherwise.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if "triton" not in sys.modules:
    if torch.cuda.is_available():
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")

KERNEL_MODULES = (
    "tessera.kernels.rmsnorm_triton",
    "tessera.kernels.paged_attention_triton",
    "tessera.kernels.rope_triton",
    "tessera.kernels.swiglu_triton",
    "tessera.kernels.cross_entropy_triton",
)


def _triton_interpreting() -> bool:
    import triton.language.standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.sum, InterpretedFunction)


def _assert_kernel_mode(interpret: bool) -> None:
    """Every kernel in our modules is in the expected mode (so a test cannot pass on the wrong path)."""
    from triton.runtime.interpreter import InterpretedFunction

    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        kernels = [v for k, v in vars(module).items() if k.startswith("_") and k.endswith("_kernel")]
        assert kernels, f"{name} defines no kernels"
        assert all(isinstance(k, InterpretedFunction) == interpret for k in kernels), name


@pytest.fixture
def triton_cpu(monkeypatch):
    """Dispatchers send CPU tensors to the Triton kernels, run by Triton's interpreter."""
    pytest.importorskip("triton")
    if not _triton_interpreting():
        pytest.skip("Triton was imported without TRITON_INTERPRET=1 (CUDA machine: the gpu tests cover this)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TESSERA_FORCE_TRITON", "1")
    monkeypatch.delenv("TESSERA_DISABLE_TRITON", raising=False)
    _assert_kernel_mode(interpret=True)
    return torch.device("cpu")


@pytest.fixture
def triton_cuda(monkeypatch):
    """Compiled kernels on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    if _triton_interpreting():
        pytest.skip("Triton was imported with TRITON_INTERPRET=1; run `pytest tests/kernels` without it")
    monkeypatch.delenv("TESSERA_DISABLE_TRITON", raising=False)
    _assert_kernel_mode(interpret=False)
    return torch.device("cuda")


@pytest.fixture
def spy_triton(monkeypatch):
    """Counts calls into the Triton entry points, to prove a dispatcher really took that path."""
    calls: dict[str, int] = {}

    def wrap(module_name: str, attr: str) -> None:
        module = importlib.import_module(module_name)
        original = getattr(module, attr)

        def counted(*args, **kwargs):
            calls[attr] = calls.get(attr, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, attr, counted)

    pytest.importorskip("triton")
    wrap("tessera.kernels.rmsnorm_triton", "rms_norm_triton")
    wrap("tessera.kernels.rmsnorm_triton", "add_rms_norm_triton")
    wrap("tessera.kernels.rope_triton", "rope_qk_triton")
    wrap("tessera.kernels.swiglu_triton", "swiglu_triton")
    wrap("tessera.kernels.cross_entropy_triton", "cross_entropy_with_grad_triton")
    wrap("tessera.kernels.paged_attention_triton", "paged_attention_triton")
    return calls
