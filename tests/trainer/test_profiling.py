"""profiling.*: a window of steps traced with torch.profiler, written whole, without changing training."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from test_bad_input import run_expect_usage_error
from test_loop import make_trainer, weights

from tessera.trainer.cli import main
from tessera.trainer.components.observability.profiling import StepProfiler
from tessera.trainer.config import ProfilingConfig


def read_trace(path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def test_profiled_window_writes_a_trace_and_op_table_and_trains_identically(make_config, tmp_path, capsys):
    path = make_config()
    assert main(["--config", str(path), "--quiet", "profiling.start_step=3", "profiling.num_steps=2"]) == 0
    folder = tmp_path / "run" / "profile" / "steps_0000003-0000004"
    trace = read_trace(folder / "rank00000.trace.json.gz")
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"aten::mm", "aten::scaled_dot_product_attention"} <= names
    ops = (folder / "rank00000.ops.txt").read_text()
    assert "aten::mm" in ops and "Self CPU" in ops
    assert sorted(p.name for p in (tmp_path / "run" / "profile").iterdir()) == ["steps_0000003-0000004"]
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary files left
    out = capsys.readouterr().out
    assert "profiled steps 3-4 on rank 0" in out and "ms/step" in out

    # The profiler only observes: the same run without it ends with the same loss in metrics.jsonl.
    plain = make_config("plain")
    assert main(["--config", str(plain), "--quiet"]) == 0
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "train"] for run in ("run", "plain")]
    assert losses[0] == losses[1]


def test_window_cut_short_by_the_end_of_training_writes_what_ran(make_config, tmp_path):
    path = make_config()  # 6 steps
    assert main(["--config", str(path), "--quiet", "profiling.start_step=5", "profiling.num_steps=10"]) == 0
    assert (tmp_path / "run" / "profile" / "steps_0000005-0000006" / "rank00000.trace.json.gz").is_file()


def test_no_profiling_by_default_and_rank_filter(make_config, tmp_path):
    path = make_config()
    trainer = make_trainer(path)
    assert trainer.cfg.profiling.start_step is None
    trainer.train()
    assert not (tmp_path / "run" / "profile").exists()
    # Rank filter: a rank not listed does not profile (under torchrun; one process has only rank 0).
    cfg = ProfilingConfig(start_step=1, ranks=[1])
    assert not StepProfiler(cfg, tmp_path, 0, torch.device("cpu"), print).enabled
    assert StepProfiler(cfg, tmp_path, 1, torch.device("cpu"), print).enabled


@pytest.mark.parametrize("override, message", [
    ("profiling.start_step=7", "profiling.start_step (7) is after the last step"),
    ("profiling.start_step=0", "profiling.start_step"),
    ("profiling.num_steps=0", "profiling.num_steps"),
    ("profiling.ranks=[-1]", "profiling.ranks"),
    ("profiling.ranks=[0,3]", "profiling.ranks [3] are not ranks of this run (world size 1)"),
])
def test_bad_profiling_settings_are_one_line_errors(make_config, capsys, tmp_path, override, message):
    argv = ["--config", str(make_config()), "profiling.start_step=1", override]  # the override wins
    assert message in run_expect_usage_error(argv, capsys)
    assert not (tmp_path / "run").exists()


def test_profiling_does_not_touch_weights(make_config):
    ref, prof = make_trainer(make_config("ref")), make_trainer(make_config("prof"), "profiling.start_step=1")
    torch.manual_seed(0)
    ref.train()
    torch.manual_seed(0)
    prof.train()
    for (name, a), b in zip(weights(ref).items(), weights(prof).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_memory_snapshot_on_cpu_is_a_note_not_a_file(make_config, tmp_path, capsys):
    path = make_config()
    assert main(["--config", str(path), "--quiet", "profiling.start_step=2", "profiling.num_steps=1",
                 "profiling.memory_snapshot=true"]) == 0
    assert "this run is on CPU, so none is written" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "run" / "profile" / "steps_0000002-0000002").iterdir()] != []
    assert not list((tmp_path / "run" / "profile").rglob("*.pickle"))


@pytest.mark.gpu
def test_cuda_trace_and_memory_snapshot(make_config, tmp_path):
    path = make_config()
    assert main(["--config", str(path), "--quiet", "training.device=cuda", "profiling.start_step=2",
                 "profiling.memory_snapshot=true"]) == 0
    folder = tmp_path / "run" / "profile" / "steps_0000002-0000003"
    assert (folder / "rank00000.memory_snapshot.pickle").stat().st_size > 0
    assert "CUDA" in (folder / "rank00000.ops.txt").read_text()  # device-time columns
