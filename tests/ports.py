"""TCP ports for tests, with no race for them. A server binds port 0 and says which port the OS gave
it; a port picked by binding 0 and closing can be taken by another process (CI runs many) before
the server binds it, so that is kept for what cannot bind 0 (torch.distributed's MASTER_PORT)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading

# tessera-serve as this Python runs it (the venv's, without relying on its console script).
SERVE = [sys.executable, "-c", "from tessera.inference.entrypoints.serve_cli import entry; entry()"]


def start_serve(command: list, *args, timeout: float = 180.0, must_start: bool = True,
                **popen) -> tuple[subprocess.Popen, str | None, list[str]]:
    """Start `command` (tessera-serve) with `args` and `--port 0`, wait for its startup line, and
    return the process, its URL (the port it bound, from that line) and its stderr lines so far; the
    rest of stderr is left in `proc.stderr`. A server that exits first is a failure, or under
    `must_start=False` a URL of None."""
    popen = {"stderr": subprocess.PIPE, "text": True, **popen}
    proc = subprocess.Popen([str(a) for a in (*command, *args, "--port", "0")], **popen)
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


def free_port() -> int:
    """A port free now, for a process that cannot bind 0 and report it; it can be taken before that
    process binds it, so a caller retries once with a new one on "address already in use"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
