"""Triton kernels, each beside a plain PyTorch reference and a dispatcher.

Dispatchers choose the Triton kernel when the tensors are on CUDA and Triton is importable (or
when TESSERA_FORCE_TRITON=1, which with TRITON_INTERPRET=1 runs the kernel on CPU for tests),
and the reference otherwise. Callers import only the dispatchers below; an op with no Triton
kernel yet (Mamba-2's gated norm) is imported as its reference.
"""

from tessera.kernels.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_reference,
    causal_conv1d_step_reference,
    causal_conv1d_update,
    causal_conv1d_update_reference,
)
from tessera.kernels.cross_entropy import cross_entropy_with_grad, cross_entropy_with_grad_reference
from tessera.kernels.paged_attention import paged_attention, paged_attention_reference
from tessera.kernels.rmsnorm import (
    add_rms_norm,
    add_rms_norm_reference,
    gated_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from tessera.kernels.rope import apply_rope, rope_qk, rope_qk_reference
from tessera.kernels.ssd import (
    discretize_dt,
    ssd_chunk_scan,
    ssd_chunk_scan_reference,
    ssd_recurrence_reference,
    ssd_state_update,
    ssd_state_update_reference,
    ssd_step_reference,
)
from tessera.kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "rms_norm", "rms_norm_reference", "add_rms_norm", "add_rms_norm_reference",
    "rope_qk", "rope_qk_reference", "apply_rope",
    "swiglu", "swiglu_reference",
    "cross_entropy_with_grad", "cross_entropy_with_grad_reference",
    "paged_attention", "paged_attention_reference",
    # Mamba-2: the scan and the convolution (forward and backward), their decoding steps in place in
    # slot-indexed state pools; the gated norm is a reference only.
    "ssd_chunk_scan", "ssd_chunk_scan_reference", "ssd_recurrence_reference", "ssd_step_reference",
    "ssd_state_update", "ssd_state_update_reference", "discretize_dt",
    "causal_conv1d", "causal_conv1d_reference", "causal_conv1d_step_reference",
    "causal_conv1d_update", "causal_conv1d_update_reference", "gated_rms_norm_reference",
]
