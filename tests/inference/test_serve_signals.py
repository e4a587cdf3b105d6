"""`tessera-serve` stopped by SIGTERM (a scheduler, systemd, docker stop) or SIGINT (Ctrl-C), as a
real process: it drains, stops its engine process and tensor-parallel workers, and exits 0, with no
traceback and no process left behind (docs/cli/tessera-serve.md, "Shutdown")."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from inference_helpers import wait_for_health
from test_tensor_parallel_serving import _alive, _descendants

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("tp, sig, extra", [
    (1, signal.SIGTERM, []),
    (1, signal.SIGINT, []),
    (2, signal.SIGTERM, []),
    (2, signal.SIGINT, ["--no-engine-process"]),
], ids=["tp1-sigterm", "tp1-sigint", "tp2-sigterm", "tp2-thread-engine-sigint"])
def test_a_signal_drains_stops_every_process_below_and_exits_0(tiny_ckpt, tp, sig, extra):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "from tessera.inference.entrypoints.serve_cli import entry; entry()"
    proc = subprocess.Popen([sys.executable, "-c", code, "--checkpoint", str(tiny_ckpt), "--port", str(port),
                             "--quiet", "--num-kv-blocks", "64", "--torch-threads", "1",
                             "--tensor-parallel", str(tp), *extra],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(proc, url, 180)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        below = _descendants(proc.pid)
        assert len(below) >= (tp if extra else 1 + (tp if tp > 1 else 0)), below
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert "Traceback" not in err and "interrupted" not in err, err[-3000:]
        deadline = time.time() + 10
        while any(_alive(p) for p in below) and time.time() < deadline:
            time.sleep(0.1)
        assert not [p for p in below if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
