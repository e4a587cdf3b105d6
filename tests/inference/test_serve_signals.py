"""`tessera-serve` stopped by SIGTERM (a scheduler, systemd, docker stop) or SIGINT (Ctrl-C), as a
real process: it drains, stops its engine process and tensor-parallel workers, and exits 0, with no
traceback and no process left behind (docs/cli/tessera-serve.md, "Shutdown"). Also stopped while
its workers still load, and a start that fails after spawning them: nothing is left either way.
Processes are found by pid (tests/process_tree.py), never by timing. (A TP2 encoder's stop is
checked by test_embeddings_encoder, through LiveServer.stop.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest
from inference_helpers import make_engine, wait_for_health
from ports import SERVE, start_serve
from process_tree import assert_gone, descendants

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

def _serve(checkpoint, tp: int, *extra: str, wait: bool = True) -> tuple[subprocess.Popen, str | None]:
    proc, url, _ = start_serve(SERVE, "--checkpoint", checkpoint, "--quiet", "--num-kv-blocks", "64",
                               "--torch-threads", "1", "--tensor-parallel", tp, *extra, wait=wait)
    return proc, url


@pytest.mark.parametrize("tp, sig, extra", [
    (1, signal.SIGTERM, []),
    (1, signal.SIGINT, []),
    (2, signal.SIGTERM, []),
    (2, signal.SIGINT, ["--no-engine-process"]),
], ids=["tp1-sigterm", "tp1-sigint", "tp2-sigterm", "tp2-thread-engine-sigint"])
def test_a_signal_drains_stops_every_process_below_and_exits_0(tiny_ckpt, tp, sig, extra):
    proc, url = _serve(tiny_ckpt, tp, *extra)
    try:
        wait_for_health(proc, url, 180)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        below = descendants(proc.pid)
        assert len(below) >= (tp if extra else 1 + (tp if tp > 1 else 0)), below
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert "Traceback" not in err and "interrupted" not in err, err[-3000:]
        assert_gone(below, f"tessera-serve stopped by {signal.Signals(sig).name}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _spawned_workers(pid: int, n: int, timeout: float = 120) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = [p for p in descendants(pid) if "spawn_main" in " ".join(p.cmdline())]
        if len(workers) == n:
            return workers
        time.sleep(0.05)
    raise AssertionError(f"{n} tensor-parallel workers did not start within {timeout:.0f} s")


def test_a_server_killed_while_its_tensor_parallel_workers_load_leaves_no_process(tiny_ckpt):
    """SIGTERM before the model is loaded (no handler yet: the HTTP process dies at once). One worker
    is held (SIGSTOP), so its peer waits for it at the rendezvous and the engine process for both,
    as under a slow load: the engine process must die with the HTTP process, not wait up to
    READY_TIMEOUT_S; the held worker, let go, is killed or exits on finding its driver gone."""
    proc, _ = _serve(tiny_ckpt, 2, wait=False)
    try:
        held, free = _spawned_workers(proc.pid, 2)
        engine = [p for p in descendants(proc.pid) if "core_process" in " ".join(p.cmdline())]
        assert len(engine) == 1, engine
        os.kill(held.pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        try:
            assert_gone(engine, "tessera-serve killed while loading (its engine process)")
        finally:
            os.kill(held.pid, signal.SIGCONT)
        assert_gone([free, held], "tessera-serve killed while loading (its workers)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_whose_start_fails_after_spawning_its_workers_leaves_none(tiny_ckpt, monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("a failure after the workers started")

    monkeypatch.setattr("tessera.inference.engine.llm_engine.embedding_spec", fails)
    before = {p.pid for p in descendants()}
    # The error is kept (as a log or an error reply holds it): the workers must not depend on the
    # half-built engine being garbage-collected, which would close their pipes.
    with pytest.raises(RuntimeError, match="after the workers started") as failed:
        make_engine(tiny_ckpt, tensor_parallel=2, num_kv_blocks=64)
    assert_gone([p for p in descendants() if p.pid not in before], "a failed engine start")
    assert failed.value.__traceback__ is not None
