"""What the parity tests of a kind's own objective share (the encoder's masked LM, T5's span
corruption; the causal LM's next token has parallel_harness.py): the torchrun launch of a test file
that is also its worker, the measure of a split's error, the one-process reference training and the
same steps under the parallel runtime in a given layout.

The measure: a split may reorder fp32 sums, so its error against an fp64 run of the whole model is
taken relative to the one process's own fp32 error against that run (plus a floor of 1e-7 of the
scale, for exactly-computed entries); a parity test holds it under a small factor.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from parallel_harness import OPTIM, deferred_param_gathers, reference_optimizer


def launch(worker: str, out: Path, *args: str, timeout: int = 280) -> dict:
    """`torchrun` of two gloo processes on the test file `worker` (its `__main__` writes `out`; `args`
    follow it on the command line): the JSON it wrote, after a zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", worker, str(out),
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def over(errors: dict[str, dict[str, float]], tol: float) -> dict[str, float]:
    """The entries of {layout: {what: error}} above `tol` (empty when all hold)."""
    return {f"{layout}: {k}": v for layout, e in errors.items() for k, v in e.items() if not v <= tol}


def relative_error(got: torch.Tensor, fp32: torch.Tensor, fp64: torch.Tensor) -> float:
    scale = fp64.abs().max().item() + 1e-12
    return (got.double() - fp64).abs().max().item() / ((fp32.double() - fp64).abs().max().item() + 1e-7 * scale)


def worst_over_ranks(errors: dict[str, float]) -> dict[str, float]:
    """Each error's maximum over the ranks (every rank calls it)."""
    import torch.distributed as dist

    worst = torch.tensor(list(errors.values()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(errors, worst.tolist()))


def randomize_vectors(model: torch.nn.Module, mean: float) -> None:
    """Biases and norms at random too (normal around `mean`), so a dropped slice shows."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(mean, 0.3, generator=g)


def check_grads(errors: dict[str, float], part, whole, exact, groups, untouched: Callable[[str], bool] = lambda n: False):
    """The error of every parameter gradient of the split model `part` against the rank's slice of
    the whole model's (fp32 `whole`, fp64 `exact`); a sequence-parallel partial gradient summed over
    the tensor group first, as the trainer's gradient code sums them. Parameters `untouched` names
    must have no gradient in either model."""
    import torch.distributed as dist

    from tessera.common.parallel.layers import shard_dim_of

    named, named64 = dict(whole.named_parameters()), dict(exact.named_parameters())
    rank, world = groups.tp_rank, groups.tp
    for name, p in part.named_parameters():
        if untouched(name):
            assert p.grad is None and named[name].grad is None, name
            continue
        grad = p.grad.clone()
        dim = shard_dim_of(p)
        if getattr(p, "sequence_parallel_partial", False):
            dist.all_reduce(grad, group=groups.tp_group)
        want, want64 = named[name].grad, named64[name].grad
        if dim is not None:
            want, want64 = want.chunk(world, dim=dim)[rank], want64.chunk(world, dim=dim)[rank]
        errors[f"{name} grad"] = relative_error(grad, want, want64)


def reference_training(model: torch.nn.Module, batch: Callable[[int], tuple[Any, torch.Tensor]],
                       loss: Callable[[torch.nn.Module, Any, torch.Tensor], torch.Tensor],
                       train: dict[str, int], norms: list[float] | None = None,
                       ) -> tuple[list[float], dict[str, torch.nn.Parameter]]:
    """One process: the plain model, torch's AdamW (no decay on vectors), clipping; each step's
    loss the mean of its micro-batches' `loss(model, rows, labels)`, as the kind's step takes it.
    Returns the per-step losses and the parameters after the steps; appends each step's pre-clip
    gradient norm (over the parameters that have a gradient) to `norms` when given."""
    opt = reference_optimizer(model)
    mb, n = train["micro_batch"], train["global_batch"] // train["micro_batch"]
    losses = []
    for step in range(train["steps"]):
        inputs, labels = batch(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(n):
            rows = slice(i * mb, (i + 1) * mb)
            part = loss(model, inputs[rows], labels[rows]) / n
            part.backward()
            total += part.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"])  # over the grads there are
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        losses.append(total)
    return losses, dict(model.named_parameters())


def train_parity(name: str, layout_kw: dict, cfg, reference, batch: Callable[[int], tuple[Any, torch.Tensor]],
                 train: dict[str, int], build_peaks: dict[str, float] | None = None) -> dict[str, float]:
    """The reference's steps under the parallel runtime in layout `layout_kw` (sequence parallel
    when `name` is "tp2_sp", parallel.overlap_param_gather when "dp2_overlap"), the model built on the meta device as tessera-train builds it (each
    rank allocates and initialises only its shards, sharded_init), the kind's own objective, each
    data rank on its rows: each step's
    loss relative to the reference's, and the parameters after the steps normwise (each rank's
    shards against the reference's), worst over the ranks. `build_peaks[name]`, when given: the most
    bytes any rank held while the runtime was built, over the whole model's fp32 weights."""
    from torch.distributed.tensor import DTensor

    from tessera.common.layout import ParallelLayout
    from tessera.common.models import registry
    from tessera.common.parallel.layers import shard_dim_of
    from tessera.common.parallel.state import build_groups, set_groups
    from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig
    from tessera.trainer.objectives.registry import parallel_objective
    from tessera.trainer.parallel.runtime import ParallelRuntime

    layout = ParallelLayout(**layout_kw)
    groups = build_groups(layout)
    set_groups(groups)
    training = TrainingConfig(seq_length=train["seq"], global_batch_size=train["global_batch"],
                              micro_batch_size=train["micro_batch"], seed=0)  # the reference's init seed
    parallel = ParallelConfig(**layout.model_dump(exclude={"data"}), sequence_parallel=name == "tp2_sp",
                              overlap_param_gather=name == "dp2_overlap")
    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from plan_worker import PeakBytes

    with PeakBytes() as held:
        rt = ParallelRuntime.build(cfg, groups, training, parallel, OptimConfig(**OPTIM),
                                   build_model=lambda: registry.kind_of(cfg).build(cfg, device="meta", seed=None),
                                   objective=parallel_objective(cfg))
    if build_peaks is not None:
        build_peaks[name] = worst_over_ranks({"peak": held.peak / (4 * cfg.num_params())})["peak"]
    ref_losses, ref_params = reference
    rows = train["global_batch"] // groups.dp_ep
    mine = slice(groups.dp_ep_rank * rows, (groups.dp_ep_rank + 1) * rows)
    errors = {}
    # overlap_param_gather: gathers deferred to their waits, NaN before (a read before its wait shows).
    with deferred_param_gathers() if parallel.overlap_param_gather else contextlib.nullcontext():
        for step in range(train["steps"]):
            inputs, labels = batch(step)
            loss = rt.train_step(inputs[mine], labels[mine]).loss
            errors[f"step {step} loss"] = abs(loss - ref_losses[step]) / abs(ref_losses[step])
    diff = torch.zeros((), dtype=torch.float64)
    norm = torch.zeros((), dtype=torch.float64)
    for pname, p in rt.named_global_params().items():
        got = p.data.full_tensor() if isinstance(p.data, DTensor) else p.data
        want = ref_params[pname].detach()
        dim = shard_dim_of(p)
        if groups.tp > 1 and dim is not None:
            want = want.chunk(groups.tp, dim=dim)[groups.tp_rank]
        diff += (got.double() - want.double()).pow(2).sum()
        norm += want.double().pow(2).sum()
    errors["params after steps (normwise)"] = float((diff / norm).sqrt())
    return worst_over_ranks(errors)
