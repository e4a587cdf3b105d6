"""TrainStep (the one-process step) against the textbook PyTorch loop, and the host-memory setting."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from tessera.common.models.causal_lm.config import preset
from tessera.trainer.components.model_setup import prepare_model
from tessera.trainer.components.observability.host_memory import retain_freed_memory
from tessera.trainer.components.optimizer.optim import build_optimizer
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.config import OptimConfig
from tessera.trainer.objectives.loss import chunked_cross_entropy, cross_entropy_loss, logsumexp_cross_entropy
from tessera.trainer.objectives.step import TrainStep

CPU = torch.device("cpu")


def batches(cfg, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def textbook_step(model, optimizer, micro_batches, grad_clip: float) -> float:
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for inputs, labels in micro_batches:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), grad_clip, foreach=True)
    optimizer.step()
    return float(total)


def test_train_step_is_the_textbook_step_bit_for_bit():
    """Accumulation over 2 micro-batches, clipping active (max norm 0.1), 3 steps: identical weights."""
    cfg = preset("tiny")
    optim_cfg = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.1)
    ours, ref = prepare_model(cfg, CPU, seed=0), prepare_model(cfg, CPU, seed=0)
    step = TrainStep(ours, build_optimizer(ours, optim_cfg), Precision("fp32", CPU), optim_cfg.grad_clip)
    ref_opt = build_optimizer(ref, optim_cfg)
    for i in range(3):
        micro = batches(cfg, 2, seed=i)
        loss, norm, stepped = step(micro, 2, CPU)
        assert stepped and float(norm) > optim_cfg.grad_clip  # clipping did something
        assert float(loss) == textbook_step(ref, ref_opt, micro, optim_cfg.grad_clip)
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_fp16_overflow_skips_the_step():
    cfg = preset("tiny")
    model = prepare_model(cfg, CPU, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    precision = Precision("fp16", CPU, initial_scale=2.0**16)
    step = TrainStep(model, build_optimizer(model, OptimConfig(grad_clip=1.0)), precision, 1.0)
    with torch.no_grad():
        model.layers["0"].mlp.down_proj.weight.mul_(1e30)  # gradients overflow fp16
    before["layers.0.mlp.down_proj.weight"].mul_(1e30)
    _, norm, stepped = step(batches(cfg, 1, seed=0), 1, CPU)
    assert not stepped and not torch.isfinite(norm)
    assert precision.loss_scale == 2.0**15
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_retain_freed_memory_on_glibc():
    took = retain_freed_memory()
    assert took == (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
    assert retain_freed_memory() == took  # idempotent
    x = torch.ones(16 * 2**20)  # 64 MiB, served from the heap now; still an ordinary tensor
    assert float(x.sum()) == 16 * 2**20


def test_logsumexp_cross_entropy_matches_f_cross_entropy():
    """The compiled step's loss form: same value and gradient as F.cross_entropy, ignore_index included."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 9, 37, generator=gen) * 3).requires_grad_()
    labels = torch.randint(0, 37, (2, 9), generator=gen)
    labels[0, :3] = -100
    for lab in (labels, labels.clamp(min=0)):
        ref = cross_entropy_loss(logits, lab)
        (g_ref,) = torch.autograd.grad(ref, logits)
        got = logsumexp_cross_entropy(logits, lab)
        (g_got,) = torch.autograd.grad(got, logits)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-7)
    assert torch.isnan(logsumexp_cross_entropy(logits, torch.full_like(labels, -100)))  # as F.cross_entropy



@pytest.mark.parametrize("chunk", [5, 16, 64])  # 18 tokens: uneven chunks, one chunk, exact multiple not needed
def test_chunked_cross_entropy_matches_linear_then_cross_entropy(chunk):
    """Gradients computed chunk by chunk in forward equal autograd's through F.linear + F.cross_entropy,
    ignored labels included, and the backward scales them by the incoming gradient (loss * 3)."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 12, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(37, 12, generator=gen, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, 37, (2, 9), generator=gen)
    labels[1, 4:] = -100
    ref = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten())  # fp64 throughout
    ref_grads = torch.autograd.grad(ref * 3, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, labels, chunk)
    got_grads = torch.autograd.grad(got * 3, (hidden, weight))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(got_grads, ref_grads):
        assert g.dtype == r.dtype and g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_chunked_cross_entropy_edge_cases():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 6, 8, generator=gen).requires_grad_()
    weight = torch.randn(11, 8, generator=gen).requires_grad_()
    # Every label ignored: zero loss and zero gradients (the mean over no positions), not nan.
    loss = chunked_cross_entropy(hidden, weight, torch.full((1, 6), -100), 4)
    loss.backward()
    assert float(loss.detach()) == 0.0 and not hidden.grad.any() and not weight.grad.any()
    # A frozen head: no weight gradient is produced, the hidden-state gradient still is.
    frozen = weight.detach()
    hidden.grad = None
    chunked_cross_entropy(hidden, frozen, torch.randint(0, 11, (1, 6), generator=gen), 4).backward()
    assert hidden.grad.abs().sum() > 0 and frozen.grad is None
    # Under bf16 autocast: matmuls in bf16, softmax in fp32, like F.linear under autocast + fp32 loss.
    labels = torch.randint(0, 11, (1, 6), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = cross_entropy_loss(F.linear(hidden, weight), labels)
        got = chunked_cross_entropy(hidden, weight, labels, 4)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    got_grads = torch.autograd.grad(got, (hidden, weight))
    for g, r in zip(got_grads, ref_grads):
        assert g.dtype == r.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=5e-2, atol=5e-3)
