"""Adversarial QA of tessera-train's input checks: each was a traceback (exit 1) or was accepted."""

from __future__ import annotations

from test_bad_input import run_expect_usage_error


def test_config_that_is_not_utf8(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(b"run_dir: x\n\xff\xfe\x00garbage")
    err = run_expect_usage_error(["--config", str(cfg)], capsys)
    assert str(cfg) in err and "UTF-8" in err


def test_infinite_learning_rate_is_refused(make_config, capsys):
    err = run_expect_usage_error(["--config", str(make_config()), "optim.lr=inf"], capsys)
    assert "optim.lr" in err and "finite" in err


def test_run_dir_that_cannot_be_created(make_config, capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    err = run_expect_usage_error(["--config", str(make_config()), f"run_dir={blocker}"], capsys)
    assert "run_dir" in err and "cannot create the output folder" in err
    err = run_expect_usage_error(["--config", str(make_config()), f"checkpoint.dir={blocker}/ckpt"], capsys)
    assert "checkpoint.dir" in err and "cannot create the output folder" in err
    assert blocker.read_text() == "x"


def test_more_threads_than_the_process_may_use_is_refused_before_any_work(make_config, capsys, tmp_path):
    """training.threads=100000 made torch start 10^5 threads: 'can't start new thread', then a
    segfault (exit 139). One more than the CPUs shows the same refusal without risking that."""
    import os

    import torch

    cpus = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        err = run_expect_usage_error(["--config", str(make_config()), f"training.threads={cpus + 1}"], capsys)
    finally:
        torch.set_num_threads(before)  # the run, were the check missing, would change this process's setting
    assert f"training.threads ({cpus + 1}) is more than the {cpus} CPUs this process may use" in err, err
    assert not (tmp_path / "run").exists()
