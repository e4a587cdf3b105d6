"""Cross-entropy and its gradient for a chunk of logits, in one Triton kernel, in place.

Semantics are those of `cross_entropy_with_grad_reference`. One program per row (token):
    pass 1: online max m and sum of exp(x - m) over the vocabulary in BLOCK_V tiles, fp32, and
            the label's logit; lse = m + log(sum)
    pass 2: grad = (exp(x - lse) - [col == label]) * scale * valid, written over the logits
The loss of each row, (lse - x[label]) * valid, goes to an fp32 vector summed by torch.
Registered as the torch custom op tessera::cross_entropy_grad_ (mutates `logits`). No autograd
rule: it is the gradient computation itself, called inside the chunked loss's forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cross_entropy_grad_kernel(
    logits_ptr, labels_ptr, scale_ptr, loss_ptr,
    stride_row, n_cols, ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    target = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # Lanes that have seen only -inf padding keep acc = 0 (no exp(-inf - -inf) = nan).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - m_ref) + tl.exp(x - m_ref)
        m = m_new
        target += tl.where(idx == label, x, 0.0)
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(acc * tl.exp(m - m_row), axis=0))
    valid = label != ignore_index
    tl.store(loss_ptr + row, tl.where(valid, lse - tl.sum(target, axis=0), 0.0))
    row_scale = tl.where(valid, tl.load(scale_ptr).to(tl.float32), 0.0)
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        mask = idx < n_cols
        x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(idx == label, 1.0, 0.0)) * row_scale
        tl.store(base + idx, g.to(logits_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("tessera::cross_entropy_grad_", mutates_args=("logits",))
def _cross_entropy_grad_(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                         ignore_index: int) -> torch.Tensor:
    """Per-row loss (fp32 [n]); `logits` [n, V] (unit stride along V) is overwritten by the gradient."""
    n_rows, n_cols = logits.shape
    loss = torch.empty((n_rows,), dtype=torch.float32, device=logits.device)
    if n_rows > 0:
        block_v = min(triton.next_power_of_2(n_cols), 4096)
        _cross_entropy_grad_kernel[(n_rows,)](
            logits, labels.contiguous(), scale.reshape(1), loss,
            logits.stride(0), n_cols, ignore_index,
            BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
        )
    return loss


@_cross_entropy_grad_.register_fake
def _(logits, labels, scale, ignore_index):
    return logits.new_empty((logits.shape[0],), dtype=torch.float32)


def cross_entropy_with_grad_triton(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                                   ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum fp32, grad) for logits [n, V] (fp32/bf16/fp16); grad is `logits`, overwritten."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} must be [n, V] with labels [n], "
                         f"got labels {tuple(labels.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    loss = torch.ops.tessera.cross_entropy_grad_(logits, labels, scale, ignore_index)
    return loss.sum(), logits
