"""Servers for tests on port 0: the server binds a port the OS chooses and the test reads which. A
port picked by binding 0, closing and handing the number on can be taken by another process (CI
runs many) before the server binds it. (tests/parallel/test_multinode.py hosts torch's rendezvous
store on port 0 the same way.)"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

# tessera-serve as this Python runs it (the venv's, without relying on its console script).
SERVE = [sys.executable, "-c", "from tessera.inference.entrypoints.serve_cli import entry; entry()"]


def start_serve(command: list, *args, timeout: float = 180.0, must_start: bool = True, wait: bool = True,
                **popen) -> tuple[subprocess.Popen, str | None, list[str]]:
    """Start `command` (tessera-serve) with `args` and `--port 0`, wait for its startup line, and
    return the process, its URL (the port it bound, from that line) and its stderr lines so far; the
    rest of stderr is left in `proc.stderr`. A server that exits first is a failure, or under
    `must_start=False` a URL of None. `wait=False`: return at once (URL None), for a test of its start."""
    popen = {"stderr": subprocess.PIPE, "text": True, **popen}
    proc = subprocess.Popen([str(a) for a in (*command, *args, "--port", "0")], **popen)
    if not wait:
        return proc, None, []
    out = proc.stderr if popen["stderr"] is subprocess.PIPE else proc.stdout
    lines: list[str] = []
    url: list[str] = []

    def read() -> None:
        for line in out:
            lines.append(line)
            if m := re.search(r"listening on (http://\S+:\d+)\s*$", line):
                url.append(m.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        proc.kill()
        proc.wait()
        raise AssertionError(f"tessera-serve did not start within {timeout} s:\n" + "".join(lines)[-3000:])
    if not url and must_start:
        raise AssertionError(f"tessera-serve exited (code {proc.wait()}) before listening:\n" + "".join(lines)[-3000:])
    return proc, (url[0] if url else None), lines


def start_uvicorn(app, timeout: float = 30.0):
    """Run `app` under uvicorn on 127.0.0.1 port 0 in a daemon thread; return the server, its thread
    and its URL, with the port it bound read from its socket."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"
