"""Long jobs survive rank failures: torchrun restarts resume from the last checkpoint; a hung rank
is named by the watchdog; repeated signals end a stop cleanly; log lines carry time.

Faults are injected with tessera.common.faults (TESSERA_FAULT, TESSERA_FAULT_RANK): a SIGKILL or
an endless sleep on one rank at one step, only in the job's first attempt.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_parallel_cli import ENV, records, write

from tessera.common.checkpoint import iter_dir_name, load_model_tensors, read_pointer

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
BIN = Path(sys.executable).parent
STEPS = 4


def _torchrun(config: Path, *args: str, env: dict, restarts: int = 0, timeout: int = 300):
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", f"--max-restarts={restarts}",
           "-m", "tessera.trainer", "--config", str(config), "--quiet", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**ENV, **env})


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoints = run_dir / "checkpoints"
    assert read_pointer(checkpoints) == STEPS
    return load_model_tensors(checkpoints / iter_dir_name(STEPS))


def test_a_rank_killed_mid_run_restarts_and_finishes_like_an_uninterrupted_run(data_dir):
    reference = _torchrun(write(data_dir, "dp2_ref", save_interval=1), env={})
    assert reference.returncode == 0, reference.stderr[-3000:]
    # Rank 1 is SIGKILLed as it starts step 3 (after step 2's checkpoint); torchrun restarts both ranks once.
    # The watchdog turns a hang of the restarted attempt into every rank's stack (seen once under a
    # full suite's load: the restarted job did not finish in 300 s; not reproduced since).
    faulty = _torchrun(write(data_dir, "dp2_killed", save_interval=1, step_timeout_minutes=1.5), restarts=1,
                       env={"TESSERA_FAULT": "train.step@3", "TESSERA_FAULT_RANK": "1"})
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    assert "torchrun restart 1: resuming from" in faulty.stdout + faulty.stderr
    want, got = _final(data_dir / "dp2_ref"), _final(data_dir / "dp2_killed")
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert records(data_dir / "dp2_killed", "train")[STEPS]["loss"] == records(data_dir / "dp2_ref", "train")[STEPS]["loss"]


_RESTARTED_JOIN = """
import datetime, os, sys, time
import torch.distributed as dist
from tessera.common.parallel.state import join_torchrun_job
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(2)  # rank 0 of the new attempt reaches the store first, where attempt 0's keys still are
# A connect to a dead address can also hang: end it. The plain case only shows the race, and its hang
# went through several timeouts (154 s of one full suite at 30 s each): 10 s there.
timeout = datetime.timedelta(seconds=10 if sys.argv[1] == "plain" else 30)
if sys.argv[1] == "plain":
    dist.init_process_group("gloo", timeout=timeout)
else:
    join_torchrun_job("gloo", timeout)
store = dist.distributed_c10d._get_default_store()  # the namespace every group's set-up keys live in
if attempt == 0:
    if rank == 0:
        store.set("attempt_0_was_here", "1")
    dist.barrier()
    if rank == 1:
        os._exit(1)  # dies after its group was made: its keys stay in the job's store
    dist.barrier()
print(f"attempt {attempt} rank {rank} joined; sees attempt 0's key: {store.check(['attempt_0_was_here'])}",
      flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("init", ["join_torchrun_job", "plain"])
def test_a_restarted_attempt_joins_its_own_ranks_not_the_dead_ones(init, tmp_path):
    """The cause of the restart test's intermittent failures: torchrun's agent keeps one store for
    the whole job, and the keys that set groups up carry no attempt number. Under plain
    `init_process_group` a restarted attempt finds the dead attempt's keys in its group's namespace
    (a marker key set by attempt 0 is visible), and when its rank 0 reads the dead rank 1's
    address from there before the new rank 1 has written its own, gloo fails to connect or hangs
    (a race: 2 of 3 runs in the session that found it; the 30 s timeout ends a hang). Under `join_torchrun_job` each attempt has its own
    namespace: nothing of attempt 0 is visible and the new ranks join."""
    script = tmp_path / "join.py"
    script.write_text(_RESTARTED_JOIN)
    # Its own session, so a hang that outlives the timeout is ended with every worker, not just torchrun.
    job = subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=1",
                            str(script), init], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
    proc = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    # The two ranks' lines can interleave in torchrun's stdout: find them, not whole lines.
    seen = dict(re.findall(r"attempt 1 rank (\d) joined; sees attempt 0's key: (True|False)", proc.stdout))
    if init == "plain":  # either outcome of the race shows attempt 0's state in attempt 1's namespace
        if proc.returncode == 0:
            assert seen == {"0": "True", "1": "True"}, proc.stdout[-2000:]
        else:  # gloo could not connect: refused by the dead address, or no answer within the timeout
            assert re.search(r"connectFullMesh failed|[Tt]imed out|[Tt]imeout", proc.stderr), proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert seen == {"0": "False", "1": "False"}, proc.stdout[-2000:]


def test_a_hung_rank_makes_every_rank_dump_its_stack_within_the_timeout(data_dir):
    config = write(data_dir, "hang", step_timeout_minutes=0.1)  # 6 s
    start = time.monotonic()
    proc = _torchrun(config, env={"TESSERA_FAULT": "train.step@3:hang", "TESSERA_FAULT_RANK": "1"}, timeout=240)
    took = time.monotonic() - start
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: no progress for \d+s \(training.step_timeout_minutes=0.1\) while in step 3",
                         out), out[-4000:]
    assert out.count("Most recent call first") + out.count("most recent call first") >= 2  # both ranks' stacks
    assert "fault_point" in out  # the stuck rank's own frame
    assert took < 200  # not the process group's 10-minute timeout


def _start_one_process(config: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "tessera-train"), "--config", str(config), "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})})


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and f'"step": {step},' in (run_dir / "metrics.jsonl").read_text():
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not logged in {limit}s")


def test_a_second_sigterm_during_the_stop_still_exits_0_with_the_checkpoint(data_dir):
    config = write(data_dir, "term2", steps=200)
    proc = _start_one_process(config)
    _wait_for_step(proc, data_dir / "term2", 2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    for _ in range(5):  # a scheduler repeating its SIGTERM while the save runs
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert read_pointer(data_dir / "term2" / "checkpoints") is not None


def test_a_second_ctrl_c_exits_130_with_one_line_or_0_after_the_stops_save(data_dir):
    # save_interval=1 keeps the run inside DCP writes much of the time: the second SIGINT lands in one.
    config = write(data_dir, "int2", steps=400, save_interval=1)
    proc = _start_one_process(config)
    _wait_for_step(proc, data_dir / "int2", 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.15)  # two signals sent back to back reach the Python handler as one
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # Mid-step or mid-save: interrupted at once (130). After the stop's save: the run is already
    # exiting 0 and ignores it. Never a traceback, never a death by SIGINT (-2).
    assert proc.returncode in (0, 130), err[-2000:]
    assert "Traceback" not in err
    if proc.returncode == 130:
        assert err.strip().splitlines()[-1] == "tessera-train: interrupted", err[-2000:]
    for d in (data_dir / "int2" / "checkpoints").glob("iter_*"):
        assert (d / "tessera_checkpoint.json").is_file()


def test_training_log_lines_carry_time_elapsed_eta_and_a_bounded_cpu_mfu(data_dir):
    run_dir = data_dir / "clock"
    with open(data_dir / "clock.log", "w") as log:
        proc = subprocess.run([str(BIN / "tessera-train"), "--config", str(write(data_dir, "clock"))],
                              stdout=log, stderr=subprocess.STDOUT, env=ENV, timeout=300)
    assert proc.returncode == 0
    lines = [line for line in (data_dir / "clock.log").read_text().splitlines() if re.search(r"step +\d+/", line)]
    assert len(lines) == STEPS
    for line in lines:
        assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step", line), line
        assert re.search(r"\| elapsed \d+s \| ETA \d+s$", line), line
        assert "MFU~ " in line
    assert "\r" not in (data_dir / "clock.log").read_text()
    for rec in records(run_dir, "train").values():
        assert rec["time"] and rec["elapsed_s"] >= 0 and rec["eta_s"] >= 0
        assert 0 < rec["mfu"] <= 1.0 and rec["mfu_estimate"] is True
