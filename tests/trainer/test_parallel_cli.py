"""`tessera-train` under torchrun with parallel layouts: parity with one process, cross-layout resume.

The method is parity. One module-scoped single-process run (`tessera-train`, fp32, real mixture
from `tessera-data prep` + `blend`) is the reference; each layout runs the same config and seed
through torchrun (TP=2, PP=2 1F1B with an uneven split, interleaved PP=2x2, DP=2 with ZeRO-1)
and must log the same per-step losses (1e-5 relative). A checkpoint saved at
TP=2 x PP=2 (4 processes, stopped by training.exit_after_steps) resumes in one plain process and
under DP=2 and continues with the reference's losses. torchrun launches are the expensive part
on a 2-core machine (several seconds each), so each layout is one launch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from trainer_fixtures import run_tool

from tessera.common.checkpoint import (
    read_pointer,
    read_sidecar,
    resolve_checkpoint,
    verify_checksums,
    write_pointer,
)
from tessera.common.config import load_config
from tessera.common.errors import UserError
from tessera.trainer.cli import main
from tessera.trainer.config import TrainConfig
from tessera.trainer.inputs import check_inputs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BIN = Path(sys.executable).parent
STEPS = 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def write(root: Path, name: str, **training) -> Path:
    """4 steps of 8 sequences (micro-batch 2) on a 4-layer tiny Llama at d=32, clipping active, eval at the end."""
    cfg = {
        "run_dir": str(root / name),
        "model": {"preset": "tiny", "hidden_size": 32, "ffn_hidden_size": 64, "max_seq_len": 64, "vocab_size": 512,
                  "num_layers": 4},
        "data": {"mixture": str(root / "mix"), "tokenizer": str(root / "tok")},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "grad_clip": 0.5},
        "schedule": {"warmup_steps": 2},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32, "steps": STEPS,
                     "log_interval": 1, "eval_interval": STEPS, "eval_iters": 2, "threads": 1, **training},
        "logging": {"tensorboard": False, "params_norm": True},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def records(run_dir: Path, kind: str) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == kind}


def torchrun(nproc: int, config: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_tool([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "tessera.trainer",
                     "--config", str(config), "--quiet", *args], cwd, timeout=300, env=ENV)


def assert_losses_match(got: dict[int, dict], want: dict[int, dict], steps: range) -> None:
    assert sorted(got) == list(steps), got.keys()
    for s in steps:
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5), (s, got[s]["loss"], want[s]["loss"])


@pytest.fixture(scope="module")
def reference(data_dir) -> Path:
    """The single-process run every layout must reproduce."""
    assert main(["--config", str(write(data_dir, "ref1")), "--quiet"]) == 0
    return data_dir / "ref1"


@pytest.mark.parametrize("name, nproc, flags, layout", [
    ("tp2", 2, ["--tensor-parallel", "2"], {"tensor": 2}),
    ("pp2", 2, ["--pipeline-parallel", "2", "--pipeline-layers", "3,1"], {"pipeline": 2}),  # 1F1B, uneven
    ("pp2x2", 2, ["--pipeline-parallel", "2", "--virtual-stages", "2"], {"pipeline": 2, "virtual_stages": 2}),
    ("dp2", 2, [], {"data": 2}),  # data parallel implied by the world size; ZeRO-1 by default
])
def test_layout_matches_one_process(data_dir, reference, name, nproc, flags, layout):
    # The pipeline run is also profiled on every rank (steps 2-3): traces per rank, same losses.
    profiled = ["profiling.start_step=2", "profiling.ranks=null"] if name == "pp2" else []
    # The tensor-parallel run saves step 2 in the background (its own gloo group, DTensor state).
    async_save = ["checkpoint.async_save=true", "training.save_interval=2"] if name == "tp2" else []
    torchrun(nproc, write(data_dir, name), *flags, *profiled, *async_save, cwd=data_dir)
    run = data_dir / name
    if async_save:
        background = run / "checkpoints" / "iter_0000002"
        verify_checksums(background)
        assert read_sidecar(background).step == 2
        # Resumed in one process, the background-saved step 2 continues exactly like the reference.
        copy = data_dir / f"{name}_step2" / "checkpoints"
        shutil.copytree(background, copy / background.name)
        write_pointer(copy, 2)
        config = write(data_dir, f"{name}_step2")
        assert main(["--config", str(config), "--quiet", "--resume", f"checkpoint.dir={copy}"]) == 0
        assert_losses_match({s: r for s, r in records(data_dir / f"{name}_step2", "train").items()},
                            records(reference, "train"), range(3, STEPS + 1))
    if profiled:
        traces = sorted(p.name for p in (run / "profile" / "steps_0000002-0000003").glob("*.trace.json.gz"))
        assert traces == ["rank00000.trace.json.gz", "rank00001.trace.json.gz"]
    assert_losses_match(records(run, "train"), records(reference, "train"), range(1, STEPS + 1))
    got_norms = [r["grad_norm"] for r in records(run, "train").values()]
    want_norms = [r["grad_norm"] for r in records(reference, "train").values()]
    assert got_norms == pytest.approx(want_norms, rel=1e-4)
    # logging.params_norm: each parameter element counted once across tensor/pipeline/data ranks.
    got_params = [r["params_norm"] for r in records(run, "train").values()]
    want_params = [r["params_norm"] for r in records(reference, "train").values()]
    assert got_params == pytest.approx(want_params, rel=1e-6)
    # The same validation samples as one process in every layout (eval_iters global batches, the
    # data-parallel ranks taking their rows of each): under DP=2 the old definition (eval_iters
    # micro-batches per data rank, rounded up to global batches) evaluated twice the samples.
    assert records(run, "eval")[STEPS]["valid_loss"] == pytest.approx(
        records(reference, "eval")[STEPS]["valid_loss"], rel=1e-5)
    sidecar = read_sidecar(resolve_checkpoint(run / "checkpoints"))
    assert sidecar.layout.model_dump(include=set(layout)) == layout and sidecar.step == STEPS
    assert (resolve_checkpoint(run / "checkpoints") / "tokenizer" / "tokenizer.json").is_file()


def test_checkpoint_from_tp2_pp2_resumes_in_one_process_and_under_dp2(data_dir, reference):
    config = write(data_dir, "tp2pp2")
    torchrun(4, config, "--tensor-parallel", "2", "--pipeline-parallel", "2", "training.exit_after_steps=2",
             cwd=data_dir)
    saved = data_dir / "tp2pp2"
    assert read_pointer(saved / "checkpoints") == 2
    sidecar = read_sidecar(resolve_checkpoint(saved / "checkpoints"))
    assert (sidecar.layout.tensor, sidecar.layout.pipeline, sidecar.layout.data) == (2, 2, 1)
    assert_losses_match(records(saved, "train"), records(reference, "train"), range(1, 3))

    for name in ("resume1", "resume_dp2"):
        shutil.copytree(saved, data_dir / name)
    # One plain process (the single-process Trainer reading the layout-free checkpoint).
    assert main(["--config", str(config), "--quiet", "--resume", f"run_dir={data_dir / 'resume1'}"]) == 0
    assert_losses_match({s: r for s, r in records(data_dir / "resume1", "train").items() if s > 2},
                        records(reference, "train"), range(3, STEPS + 1))
    # DP=2 with the distributed optimizer (moments re-sliced into ZeRO shards).
    torchrun(2, config, "--resume", f"run_dir={data_dir / 'resume_dp2'}", cwd=data_dir)
    assert_losses_match({s: r for s, r in records(data_dir / "resume_dp2", "train").items() if s > 2},
                        records(reference, "train"), range(3, STEPS + 1))


def test_sigterm_to_torchrun_saves_and_workers_exit_cleanly(data_dir):
    """torchrun forwards SIGTERM to its workers: they finish the step, agree, save and exit 0
    (torchrun itself then reports the signal with a non-zero status: torch elastic's behaviour)."""
    run = data_dir / "sigterm"
    proc = subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "tessera.trainer",
                             "--config", str(write(data_dir, "sigterm", steps=100_000)), "--quiet"],
                            cwd=data_dir, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size):
            assert proc.poll() is None and time.monotonic() < deadline, "run did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    step = read_pointer(run / "checkpoints")
    assert step is not None and step >= 1, out[-3000:]
    assert f"received SIGTERM: saved at step {step}, exiting" in out
    # No worker failed: torchrun's failure summary lists each failed worker as `exitcode  : N (pid: P)`.
    # (The bare word can appear in a traceback of torchrun's own signal handling, whose source line
    # reads `exitcode = handler.proc.poll()`: that says nothing about the workers.)
    assert not re.search(r"exitcode\s+:\s+-?\d", out), out[-3000:]
    assert max(records(run, "train")) == step


@pytest.mark.parametrize("overrides, world, expected", [
    (["parallel.tensor=2"], 1, "parallel.tensor (2) x parallel.context (1) x parallel.expert (1) x parallel.pipeline (1) "
                               "= 2 does not divide "
                               "the 1 launched"),
    (["parallel.tensor=3"], 3, "must divide num_heads (4)"),
    (["parallel.pipeline=2", "parallel.virtual_stages=4"], 2, "8 pipeline stages"),
    (["parallel.context=3"], 3, "--context-parallel 3: seq_len (32) must be divisible by 2 x 3 = 6"),
    (["parallel.pipeline=2", "training.global_batch_size=2"], 2, "1F1B needs at least as many micro-batches"),
    (["training.global_batch_size=6", "training.micro_batch_size=2"], 2, "data-parallel size (2)"),
])
def test_bad_layouts_are_refused_before_any_work(data_dir, overrides, world, expected):
    with pytest.raises(UserError) as exc:  # a layer split the model cannot take is refused as the config loads
        check_inputs(load_config(TrainConfig, write(data_dir, "bad"), overrides), world_size=world)
    assert expected in str(exc.value) and "\n" not in str(exc.value)
    assert not (data_dir / "bad").exists()


@pytest.mark.parametrize("nproc, flags, expected", [
    (2, ["--context-parallel", "2", "training.seq_length=30"],
     "--context-parallel 2: seq_len (30) must be divisible by 2 x 2 = 4"),
    (2, ["--data-shard", "4"], "--data-shard 4 must divide the data-parallel size (2"),
    (1, ["--data-shard", "2"], "--data-shard 2 must divide the data-parallel size (1"),
])
def test_a_layout_that_cannot_work_is_refused_by_the_cli_in_one_line_before_any_work(data_dir, nproc, flags,
                                                                                       expected):
    """`tessera-train` (under torchrun for 2 ranks): context parallel whose 2C chunks do not divide
    the sequence, and FSDP data_shard not dividing the data ranks (one process included, where
    the flag would otherwise be ignored): a rank exits 2 with the one line, no traceback of ours
    (torchrun adds its own report), no run folder."""
    name = f"refused{nproc}_{flags[0].strip('-')}"
    cmd = ([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "tessera.trainer"]
           if nproc > 1 else [str(BIN / "tessera-train")])
    proc = subprocess.run([*cmd, "--config", str(write(data_dir, name)), "--quiet", *flags], cwd=data_dir,
                          capture_output=True, text=True, timeout=300, env=ENV)
    lines = [line for line in proc.stderr.splitlines() if expected in line]
    # One line per rank that got to print it (torchrun stops the others once the first exits).
    assert proc.returncode != 0 and 1 <= len(lines) <= nproc, proc.stderr[-3000:]
    assert "/tessera/" not in proc.stderr, proc.stderr[-3000:]  # no worker traceback (torchrun prints its own)
    if nproc == 1:
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    else:
        assert "exitcode: 2" in proc.stderr, proc.stderr[-3000:]
    assert not (data_dir / name).exists()


def test_a_rank_refuses_a_bad_layout_before_it_joins_the_group_so_it_never_waits_for_its_peers(data_dir):
    """Rank 0 of a 2-rank job alone (torchrun's environment, no peer will come): it checks the config
    before it joins the process group, so it exits 2 with its one line at once. Joining first, it would
    wait for rank 1 until the group's timeout; under torchrun a peer still connecting failed with
    gloo's traceback when the first rank to check exited (seen under the parallel suite)."""
    import socket

    with socket.socket() as s:  # a port for the store rank 0 would host (never reached when it checks first)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    proc = subprocess.run([str(BIN / "tessera-train"), "--config", str(write(data_dir, "lone")), "--quiet",
                           "--data-shard", "4"], cwd=data_dir, capture_output=True, text=True, timeout=120, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "--data-shard 4 must divide the data-parallel size (2" in lines[0]
    assert not (data_dir / "lone").exists()


def test_flags_override_the_parallel_section(data_dir, capsys):
    """`--tensor-parallel 2` in one process is refused with the layout line (exit 2), naming the flag's value."""
    from tessera.common.errors import run_cli

    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", str(write(data_dir, "flags")), "--tensor-parallel", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parallel.tensor (2)" in err, err
    with pytest.raises(SystemExit) as exc:  # --pipeline-layers is checked against the flags' layout
        run_cli(main, ["--config", str(write(data_dir, "flags")), "--pipeline-parallel", "2", "--pipeline-layers", "4"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "--pipeline-layers: 1 values given but the layout has 2 stages" in err, err


def test_one_process_checkpoint_resumes_under_tp2(data_dir, reference):
    """The other direction: a plain `tessera-train` checkpoint continued by TP=2 (+SP) under torchrun."""
    config = write(data_dir, "one_then_tp2")
    assert main(["--config", str(config), "--quiet", "training.exit_after_steps=2"]) == 0
    proc = torchrun(2, config, "--resume", "--tensor-parallel", "2", cwd=data_dir)
    assert "RNG streams re-seeded" in proc.stdout  # saved under another layout: said, not hidden
    run = data_dir / "one_then_tp2"
    assert_losses_match({s: r for s, r in records(run, "train").items() if s > 2},
                        records(reference, "train"), range(3, STEPS + 1))
    assert read_sidecar(resolve_checkpoint(run / "checkpoints")).layout.tensor == 2


def test_init_from_a_one_process_checkpoint_under_tp2_pp2(data_dir, reference):
    """checkpoint.init_from under torchrun (TP=2 x PP=2): a new run from the reference's weights
    trains exactly like the same new run in one process."""
    source = f"checkpoint.init_from={reference}"
    assert main(["--config", str(write(data_dir, "init_one")), "--quiet", source]) == 0
    proc = torchrun(4, write(data_dir, "init_tp2pp2"), source, "--tensor-parallel", "2", "--pipeline-parallel", "2",
                    cwd=data_dir)
    assert "initialized the model from" in proc.stdout
    assert_losses_match(records(data_dir / "init_tp2pp2", "train"), records(data_dir / "init_one", "train"),
                        range(1, STEPS + 1))
    # Starting from trained weights, not from init: the first loss is the reference's last, not its first.
    first = records(data_dir / "init_one", "train")[1]["loss"]
    assert first < records(reference, "train")[1]["loss"] - 0.1


@pytest.mark.parametrize("name, flags, fp16", [
    # Clean steps: the loss scale doubles every 2 steps (1024 -> 4096 by step 4) exactly as GradScaler's does.
    ("fp16_tp2", ["--tensor-parallel", "2"], {"fp16_initial_scale": 1024.0, "fp16_growth_interval": 2}),
    # Every step overflows: skipped (weights untouched, data consumed), scale halved each time.
    ("fp16_pp2_overflow", ["--pipeline-parallel", "2"], {"fp16_initial_scale": 1e38, "steps": 2}),
])
def test_fp16_dynamic_loss_scaling_matches_one_process(data_dir, name, flags, fp16):
    assert main(["--config", str(write(data_dir, name + "_ref", precision="fp16", **fp16)), "--quiet"]) == 0
    torchrun(2, write(data_dir, name, precision="fp16", **fp16), *flags, cwd=data_dir)
    got, want = records(data_dir / name, "train"), records(data_dir / (name + "_ref"), "train")
    assert sorted(got) == sorted(want)
    for s in want:
        assert (got[s]["step_skipped"], got[s]["loss_scale"]) == (want[s]["step_skipped"], want[s]["loss_scale"]), s
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-4), s
    if "overflow" in name:
        assert all(r["step_skipped"] for r in got.values()) and got[2]["loss_scale"] == pytest.approx(2.5e37)
    else:
        assert not any(r["step_skipped"] for r in got.values()) and got[STEPS]["loss_scale"] == 4096.0
