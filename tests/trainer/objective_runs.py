"""What the `tessera-train` tests of a kind's own objective share (BERT's masked LM, T5's span
corruption): the run config, the logged losses, resume bit-exact, and a torchrun TP2 run resumed
under DP2 that logs the one-process losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint
from tessera.trainer.cli import main


def write_run_config(root: Path, data: dict[str, Path], model: dict, seq_length: int, optim: dict | None = None,
                     training: dict | None = None, **sections) -> Path:
    """root/config.yaml: a 6-step run of `model` on `data` (8 samples of `seq_length` a step, micro-batches
    of 4, one thread, a log line a step); `training` and `sections` (e.g. span) added or overriding."""
    cfg = {
        "run_dir": str(root / "run"),
        "model": model,
        "data": {"mixture": str(data["mixture"]), "tokenizer": str(data["tokenizer"])},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, **(optim or {})},
        "schedule": {"kind": "cosine", "warmup_steps": 2},
        "training": {"global_batch_size": 8, "micro_batch_size": 4, "seq_length": seq_length, "steps": 6,
                     "log_interval": 1, "threads": 1, **(training or {})},
        "logging": {"tensorboard": False},
        **sections,
    }
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(run: Path, kind: str = "train") -> dict[int, float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    key = {"train": "loss", "eval": "valid_loss"}[kind]
    return {r["step"]: r[key] for r in records if r["kind"] == kind}


def assert_resume_is_bit_identical(config: Callable[[Path], Path], root: Path) -> None:
    """A run stopped after 3 steps and resumed ends with the weights and losses of the run never stopped."""
    assert main(["--config", str(config(root / "straight")), "--quiet"]) == 0
    split = config(root / "split")
    assert main(["--config", str(split), "--quiet", "training.exit_after_steps=3"]) == 0
    assert main(["--config", str(split), "--quiet", "--resume"]) == 0
    a = load_model_tensors(resolve_checkpoint(root / "straight/run/checkpoints"))
    b = load_model_tensors(resolve_checkpoint(root / "split/run/checkpoints"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(root / "straight/run") == losses(root / "split/run")


def assert_tp2_then_dp2_resume_logs_one_process_losses(config: Callable[[Path], Path], root: Path,
                                                       exact: list[str]) -> None:
    """TP2 under torchrun for steps 1-3 through the CLI, then a resume under DP2 for 4-6: every
    step's loss and the final evaluation equal the uninterrupted one-process run's (`exact`: the
    overrides that make them comparable, an evaluation at step 6 among them)."""
    assert main(["--config", str(config(root / "one")), "--quiet", *exact]) == 0
    two = config(root / "two")

    def torchrun(*args: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "tessera.trainer", "--config", str(two), "--quiet", *exact, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    torchrun("parallel.tensor=2", "training.exit_after_steps=3")
    torchrun("--resume")
    want, got = losses(root / "one/run"), losses(root / "two/run")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (got, want)
    assert losses(root / "two/run", "eval") == pytest.approx(losses(root / "one/run", "eval"), rel=1e-5)


def assert_compile_scopes_train_like_eager(step_cls, build: Callable[[], torch.nn.Module], batch, block_forward,
                                          block_graphs: int, scopes=(False, "blocks", "model")) -> None:
    """Two AdamW steps of `step_cls` on one batch (inputs, labels) eager, with regional compilation
    (`compile_scope` blocks: `block_graphs` graphs of the blocks' `block_forward`, one per kind of
    block whatever the depth) and as one graph (model): the losses and the weights after agree.

    Compiled with Dynamo's aot_eager backend (capture, autograd, no code generation): what is under
    test is where the graphs are cut and that the cut model trains like eager; inductor's own code
    is tested on the decoder (test_regional_compile.py), and a cold inductor compile of an
    encoder-decoder's graphs takes 40-80 s here (benchmarks/RESULTS.md)."""
    import functools
    from unittest import mock

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from trainer_fixtures import assert_weights_close

    from tessera.trainer.components.optimizer.optim import build_optimizer
    from tessera.trainer.components.precision.mixed import Precision
    from tessera.trainer.config import OptimConfig

    cpu, runs = torch.device("cpu"), {}
    for scope in scopes:
        torch._dynamo.reset()  # the blocks' code object keeps its graphs across models
        model = build()
        optim_cfg = OptimConfig(lr=1e-3, grad_clip=1.0)
        with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend="aot_eager")):
            step = step_cls(model, build_optimizer(model, optim_cfg), Precision("fp32", cpu), optim_cfg.grad_clip,
                            compile=scope)
            got = [float(step([batch], 1, cpu)[0]) for _ in range(2)]
        # A key bias adds one constant to each query's scores, which softmax removes: its gradient
        # is zero up to rounding, and AdamW turns that rounding into full-size steps of either sign.
        runs[scope] = got, {name: p.detach().clone() for name, p in model.named_parameters()
                            if not name.endswith("k_proj.bias")}
        graphs = len(_debug_get_cache_entry_list(block_forward.__code__))
        assert graphs == (block_graphs if scope == "blocks" else 0), (scope, graphs)
    for scope in scopes[1:]:
        torch.testing.assert_close(runs[scope][0], runs[False][0], rtol=1e-5, atol=0)
        assert_weights_close(runs[scope][1], runs[False][1], f"compile_scope {scope} vs eager")
