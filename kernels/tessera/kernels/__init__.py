"""Triton kernels, each beside a plain PyTorch reference and a dispatcher.

Dispatchers choose the Triton kernel when the tensors are on CUDA and Triton is importable (or
when TESSERA_FORCE_TRITON=1, which with TRITON_INTERPRET=1 runs the kernel on CPU for tests),
and the reference otherwise. Callers import only the dispatchers below.
"""

from tessera.kernels.paged_attention import paged_attention, paged_attention_reference
from tessera.kernels.rmsnorm import rms_norm, rms_norm_reference

__all__ = ["rms_norm", "rms_norm_reference", "paged_attention", "paged_attention_reference"]
