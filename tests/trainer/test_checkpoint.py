"""Checkpoints: exact resume, layout-invariant contents, keep-last, crash safety, graceful stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tessera.common.checkpoint import (
    MODEL_PREFIX,
    SIDECAR,
    load_model_tensors,
    model_tensor_specs,
    read_pointer,
    read_sidecar,
    resolve_checkpoint,
    verify_checksums,
)
from tessera.common.models.causal_lm.model import build_model
from tessera.common.tokenizer import tokenizer_fingerprint
from tessera.trainer.cli import main


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_model_tensors(resolve_checkpoint(run / "checkpoints"))


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_is_bit_identical(make_config, tmp_path, precision):
    """2N steps straight == N steps, stop, resume N steps: same weights bit for bit (CPU fp32 master)."""
    sections = dict(training={"steps": 6, "precision": precision, "fp16_initial_scale": 256.0,
                              "fp16_growth_interval": 2}, model={"preset": "tiny", "hidden_size": 32,
                              "ffn_hidden_size": 64, "max_seq_len": 64, "dropout": 0.1})
    straight = make_config("straight", **sections)
    assert main(["--config", str(straight), "--quiet"]) == 0
    split = make_config("split", **sections)
    assert main(["--config", str(split), "--quiet", "training.exit_after_steps=3"]) == 0
    assert read_pointer(tmp_path / "split" / "checkpoints") == 3
    assert main(["--config", str(split), "--quiet", "--resume"]) == 0
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")


def test_checkpoint_contents_are_layout_invariant_and_complete(make_config, tmp_path, artifacts):
    path = make_config(training={"steps": 4, "save_interval": 1}, checkpoint={"keep_last": 2})
    assert main(["--config", str(path), "--quiet"]) == 0
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt"]
    ckpt = resolve_checkpoint(root)
    sidecar = read_sidecar(ckpt)
    verify_checksums(ckpt, sidecar)
    assert sidecar.step == 4 and sidecar.consumed_samples == 16 and sidecar.consumed_tokens == 16 * 32
    assert sidecar.tokenizer_fingerprint == tokenizer_fingerprint(artifacts["tokenizer"])
    assert tokenizer_fingerprint(ckpt / "tokenizer") == sidecar.tokenizer_fingerprint
    assert {"model", "optimizer", "rng", "train_state"} <= set(sidecar.contents)
    # Model tensors: exactly the plain model's parameter names and global shapes.
    reference = build_model(sidecar.model, device="meta", seed=None)
    specs = model_tensor_specs(ckpt)
    assert {n: tuple(s) for n, (s, _) in specs.items()} == {n: tuple(p.shape) for n, p in reference.named_parameters()}
    # Optimizer state is keyed by parameter name, not position.
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert "optimizer.state.layers.1.mlp.down_proj.weight.exp_avg_sq" in keys
    assert all(k.startswith((MODEL_PREFIX, "optimizer.state.", "rng.", "train_state.")) for k in keys)


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code), *args]


@pytest.mark.slow
def test_killed_save_never_damages_the_last_good_checkpoint(make_config, tmp_path):
    """SIGKILL the process after the DCP files of the second save are written, before its sidecar."""
    path = make_config(training={"steps": 6, "save_interval": 2})
    killer = """
        import os, signal, sys
        import tessera.trainer.components.checkpoint.storage as ck
        real, calls = ck.finalize_checkpoint, []
        def finalize(directory, sidecar):
            calls.append(directory)
            if len(calls) == 2:  # second save: payload on disk, sidecar not yet
                os.kill(os.getpid(), signal.SIGKILL)
            real(directory, sidecar)
        ck.finalize_checkpoint = finalize
        from tessera.trainer.cli import main
        main(sys.argv[1:])
    """
    proc = subprocess.run(_python(killer, "--config", str(path), "--quiet"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    root = tmp_path / "run" / "checkpoints"
    assert read_pointer(root) == 2
    partial = root / ".iter_0000004.partial"
    assert partial.is_dir() and any(partial.glob("*.distcp")) and not (partial / SIDECAR).exists()
    good = resolve_checkpoint(root)
    assert good.name == "iter_0000002"
    verify_checksums(good)
    # Resume from the last good checkpoint; the leftover is cleaned up and the run completes
    # exactly as an uninterrupted one.
    assert main(["--config", str(path), "--quiet", "--resume"]) == 0
    assert not partial.exists() and read_pointer(root) == 6
    straight = make_config("straight", training={"steps": 6, "save_interval": 2})
    assert main(["--config", str(straight), "--quiet"]) == 0
    a, b = final_weights(tmp_path / "run"), final_weights(tmp_path / "straight")
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("name", [".iter_0000002.partial", "iter_0000002"])
@pytest.mark.parametrize("when", ["before the run", "during the run"])
def test_a_symlink_where_a_save_writes_is_replaced_and_never_followed(make_config, tmp_path, monkeypatch, name, when):
    """Issue 35.7: a link planted under the save's temporary (or final) name ended training with a
    FileExistsError traceback; the save must write a directory of its own and leave the target alone."""
    from tessera.trainer.components.checkpoint import storage

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the trainer's")
    root = tmp_path / "run" / "checkpoints"

    def plant() -> None:
        root.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(outside, target_is_directory=True)

    if when == "before the run":
        plant()
    else:  # after the first save, before the second
        prune = storage.prune_checkpoints

        def prune_then_plant(directory: Path, keep_last: int) -> None:
            prune(directory, keep_last)
            if read_pointer(root) == 1:
                plant()
        monkeypatch.setattr(storage, "prune_checkpoints", prune_then_plant)
    config = make_config(training={"steps": 2, "save_interval": 1})
    assert main(["--config", str(config), "--quiet"]) == 0
    assert [p.name for p in outside.iterdir()] == ["keep.txt"]  # nothing written through the link
    saved = root / "iter_0000002"
    assert saved.is_dir() and not saved.is_symlink() and (saved / SIDECAR).is_file()
    assert read_pointer(root) == 2 and not (root / ".iter_0000002.partial").exists()


def test_stop_request_catches_sigint_and_sigterm():
    from tessera.trainer.components.observability.signals import StopRequest

    # Compare with what was installed before, not with Python's default: a process started in
    # the background by a non-interactive shell inherits SIGINT ignored.
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in (signal.SIGINT, signal.SIGTERM):
        stop = StopRequest().install()
        try:
            assert signal.getsignal(sig) is not before[sig]
            os.kill(os.getpid(), sig)
            assert stop.requested and stop.signal_name == sig.name
        finally:
            stop.restore()
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_second_sigint_interrupts_at_once():
    from tessera.trainer.components.observability.signals import StopRequest

    before = signal.getsignal(signal.SIGINT)
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        stop.restore()


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_zero(make_config, tmp_path):
    sig = signal.SIGTERM
    path = make_config(training={"steps": 100000, "log_interval": 1})
    proc = subprocess.Popen([sys.executable, "-m", "tessera.trainer.cli", "--config", str(path), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:  # log lines: "<date> <time> step      3/100000 | loss …"
        if (m := re.search(r"\bstep +(\d+)/100000", line)) and int(m.group(1)) >= 3:
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"received {sig.name}" in out
    root = tmp_path / "run" / "checkpoints"
    step = read_pointer(root)
    assert step is not None and 3 <= step < 100000
    assert f"saved at step {step}" in out
    assert read_sidecar(resolve_checkpoint(root)).step == step


def test_resume_after_only_skipped_fp16_steps(make_config, tmp_path, capsys):
    """A checkpoint taken before any update (all fp16 steps overflowed) has no optimizer state; it still resumes."""
    path = make_config(training={"steps": 2, "precision": "fp16", "fp16_initial_scale": 1e38})
    assert main(["--config", str(path), "--quiet", "training.exit_after_steps=1"]) == 0
    assert "step 1: fp16 gradients overflowed; step skipped, loss scale lowered to 5e+37" in capsys.readouterr().out
    assert main(["--config", str(path), "--quiet", "--resume"]) == 0
    assert read_pointer(tmp_path / "run" / "checkpoints") == 2
