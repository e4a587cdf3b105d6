"""The chunk step of the chunked loss (Triton) against cross_entropy_with_grad_reference, and the
trainer's chunked_cross_entropy with the kernel against plain F.cross_entropy on full logits.

CPU runs use Triton's interpreter (fixture `triton_cpu`); `@pytest.mark.gpu` repeats them compiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels import cross_entropy_with_grad, cross_entropy_with_grad_reference

IGNORE = -100
CASES = [
    # (rows, vocab, dtype): 5000 spans two 4096-wide tiles, the second mostly masked
    (6, 100, torch.float32),
    (4, 5000, torch.float32),
    (5, 777, torch.bfloat16),
]


def _inputs(rows, vocab, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(device, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    labels[1] = IGNORE
    scale = torch.tensor(1.0 / (rows - 1), device=device)
    return logits, labels, scale


def _check(device, rows, vocab, dtype):
    logits, labels, scale = _inputs(rows, vocab, dtype, device)
    loss, grad = cross_entropy_with_grad(logits.clone(), labels, scale, IGNORE)
    loss_ref, grad_ref = cross_entropy_with_grad_reference(logits.clone(), labels, scale, IGNORE)
    assert grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss.float(), loss_ref.float(), atol=1e-5, rtol=1e-5)
    atol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: one rounding of values <= 1/(rows-1)
    torch.testing.assert_close(grad.float(), grad_ref.float(), atol=atol, rtol=1e-2 if dtype != torch.float32 else 1e-5)
    assert not grad[1].any(), "an ignored row has zero gradient"
    # Independent of the reference: the loss is F.cross_entropy's over the valid rows.
    expected = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(loss.float(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows,vocab,dtype", CASES)
def test_cross_entropy_kernel_matches_reference_on_cpu(triton_cpu, spy_triton, rows, vocab, dtype):
    _check(triton_cpu, rows, vocab, dtype)
    assert spy_triton.get("cross_entropy_with_grad_triton") == 1, "dispatcher did not run the Triton kernel"


def test_kernel_writes_the_gradient_over_the_logits(triton_cpu):
    """No [n, V] buffer besides the logits: the gradient returned is the logits' own storage."""
    logits, labels, scale = _inputs(3, 50, torch.float32, triton_cpu)
    _, grad = cross_entropy_with_grad(logits, labels, scale, IGNORE)
    assert grad.data_ptr() == logits.data_ptr()
    torch.library.opcheck(torch.ops.tessera.cross_entropy_grad_, _inputs(3, 50, torch.float32, triton_cpu) + (IGNORE,))


@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_loss_with_kernel_matches_full_logits(triton_cpu, spy_triton, autocast):
    """tessera.trainer.objectives.loss.chunked_cross_entropy, each chunk through the kernel, gives the loss and
    gradients of F.cross_entropy over the full logits (fp32, and bf16 matmuls under autocast)."""
    from tessera.trainer.objectives.loss import chunked_cross_entropy, cross_entropy_loss

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, 16, generator=gen)
    weight = torch.randn(300, 16, generator=gen) * 0.3
    labels = torch.randint(0, 300, (2, 7), generator=gen)
    labels[0, 2] = IGNORE

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(h, w)
        loss.backward()
        return loss.detach().float(), h.grad, w.grad

    got = run(lambda h, w: chunked_cross_entropy(h, w, labels, chunk_tokens=4))
    assert spy_triton.get("cross_entropy_with_grad_triton") == 4  # 14 tokens in chunks of 4
    want = run(lambda h, w: cross_entropy_loss(F.linear(h, w), labels))
    tol = 2e-2 if autocast else 1e-5
    for a, b in zip(got, want):
        assert (a.float() - b.float()).norm() / b.float().norm() < tol


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab,dtype", CASES + [(256, 128256, torch.bfloat16)])
def test_cross_entropy_kernel_matches_reference_on_cuda(triton_cuda, spy_triton, rows, vocab, dtype):
    _check(triton_cuda, rows, vocab, dtype)
    assert spy_triton.get("cross_entropy_with_grad_triton") == 1
