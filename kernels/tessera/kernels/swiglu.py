"""SwiGLU's elementwise part: h = silu(gate) * up, the Llama MLP between its projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.kernels._dispatch import use_triton


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; one Triton kernel each way on CUDA (eager), the reference otherwise.

    The kernel's backward recomputes silu(gate) from gate, so autograd keeps gate and up (which
    it keeps anyway) but not the reference's extra [tokens, ffn] silu(gate) activation; and one
    pass replaces silu, mul and, backward, four elementwise kernels. Under torch.compile
    inductor fuses the reference itself.
    """
    if use_triton(gate) and not torch.compiler.is_compiling():
        from tessera.kernels.swiglu_triton import swiglu_triton

        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)
