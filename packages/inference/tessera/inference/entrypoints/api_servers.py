"""`tessera-serve --api-server-count N` (vLLM's flag): N HTTP processes on one port in front of one
engine process.

One HTTP process spends about a core on tokenizing, JSON and streaming; on a GPU whose decode step
takes less than that per token, it bounds TPOT. So the launcher (the `tessera-serve` process)
binds the listening socket once, starts the engine process with N pipes (core_process.py routes
each request's outputs to the pipe that added it), waits until the model is loaded (a bad
checkpoint: its one line, exit 2, as with one process), then starts N HTTP processes (this
api_server_process.py), each serving the inherited socket with its own `ProcessEngine` over its
own pipe, its own tokenizer and its own share of the metrics (engine/metrics.py, multiprocess
mode). The kernel hands each accepted connection to one of them.

The launcher serves nothing itself: it only watches. Every HTTP process is then alike, and the
launcher, running no event loop and no request, notices at once when any process ends. As vLLM:
when one HTTP process or the engine dies, the whole server stops (the others are sent SIGTERM) and
exits 1; SIGTERM or SIGINT to the launcher drains every HTTP process (each stops its own pipe),
then the engine ends, and the exit is 0. A second SIGINT interrupts the drain, as with one process.
The HTTP processes run in a process group of their own, so a terminal's Ctrl-C reaches only the
launcher, which passes it on once (uvicorn takes a second signal as "stop at once"). Every process
below the launcher dies with it (PR_SET_PDEATHSIG): nothing is left if it is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from tessera.common.errors import UserError

LISTEN_BACKLOG = 2048  # uvicorn's default


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket all HTTP processes share, bound as asyncio binds uvicorn's."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise UserError(f"--host {host}: cannot listen there ({exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
    return sock


class _Child:
    """One HTTP process, as the launcher sees it."""

    def __init__(self, index: int, proc: subprocess.Popen, control: Connection):
        self.index = index
        self.proc = proc
        self.control = control  # init message out; "listening" back
        self.pidfd = os.pidfd_open(proc.pid)  # readable once it has exited
        self.listening = False

    def send(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def run_api_servers(args: argparse.Namespace, argv: list[str], cfg, plan, dtype, device,
                    startup_line: Callable[..., str]) -> int:
    """The launcher: engine process, N HTTP processes, and then wait for them (see the module doc).
    `startup_line`: serve_cli's (passed in: serve_cli imports this module, not the other way)."""
    from tessera.inference.core.generation_defaults import GenerationDefaults
    from tessera.inference.engine.process_client import start_engine_process
    from tessera.inference.worker.pooling.spec import PoolingSpec

    n = args.api_server_count
    sock = _listen(args.host, args.port)  # before the model loads: a taken port costs no load
    port = sock.getsockname()[1]
    children: list[_Child] = []
    engine = metrics_dir = None
    try:
        engine, conns, info = start_engine_process(args.checkpoint, cfg, plan, pipes=n)
        engine_fd = os.pidfd_open(engine.pid)
        metrics_dir = tempfile.mkdtemp(prefix="tessera-metrics-")
        stop = _Stopper(children)
        found = {sig: signal.signal(sig, stop.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for i, conn in enumerate(conns):
                children.append(_spawn(i, sock, conn, argv, info, metrics_dir))
                conn.close()  # the child's now: its death must reach the engine as this pipe's end
            sock.close()  # the children's now: once they all stop listening, connections are refused
            if stop.stopping:  # a signal came while they started: those started after it must stop too
                stop.begin()
            name = args.served_model_name or info["name"]
            pids = ", ".join(str(c.proc.pid) for c in children)
            facts = {**info, "where": f"engine process {engine.pid}, {n} API server processes {pids}"}
            pooling = None if info.get("pooling") is None else PoolingSpec.from_wire(info["pooling"])
            line = startup_line(args, cfg, name, dtype, device, facts, plan, int(info["max_model_len"]), pooling,
                                bool(info.get("generates", True)))
            if info.get("generates", True):  # the request defaults, as one HTTP process prints them
                defaults = GenerationDefaults.from_wire(info.get("generation_defaults"))
                if defaults.applies:
                    print(f"tessera-serve: {defaults.describe()}", file=sys.stderr, flush=True)
            failure = _supervise(children, engine, engine_fd, stop, f"{line}:{port}",
                                 2 * args.drain_timeout + 30)
        finally:
            for sig, handler in found.items():
                signal.signal(sig, handler)
    finally:
        sock.close()
        for child in children:  # only after a failure of the launcher itself is any left
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
        if engine is not None and engine.poll() is None:
            engine.kill()
            engine.wait()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    if failure:
        print(f"tessera-serve: error: {failure}; the server stopped", file=sys.stderr, flush=True)
        return 1
    return 0


def _spawn(index: int, sock: socket.socket, conn: Connection, argv: list[str], info: dict,
           metrics_dir: str) -> _Child:
    ours, theirs = socket.socketpair()
    fds = [sock.fileno(), conn.fileno(), theirs.fileno()]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}  # read when prometheus_client is imported
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tessera.inference.entrypoints.api_server_process", *map(str, fds)],
                                pass_fds=fds, env=env, process_group=0)
    finally:
        theirs.close()
    control = Connection(ours.detach())
    # The flags travel over the pipe, not the command line, where --api-key would show in `ps`.
    control.send_bytes(json.dumps({"argv": argv, "info": info, "index": index,
                                   "launcher": os.getpid()}).encode())
    return _Child(index, proc, control)


class _Stopper:
    """The launcher's SIGTERM/SIGINT handler: the first passes a SIGTERM on to every HTTP process
    (each drains); later SIGTERMs are ignored; a later SIGINT is passed on (uvicorn then stops at once).
    An HTTP process still starting gets its SIGTERM once it listens (`_supervise`): before uvicorn's
    handlers are in place SIGTERM would kill it, its pipe would end without "stop", and the engine
    would exit under the requests the other processes are draining."""

    def __init__(self, children: list[_Child]):
        self.children = children
        self.stopping = False

    def handle(self, signum: int, frame: object) -> None:
        if not self.stopping:
            self.begin()
        elif signum == signal.SIGINT:
            for child in self.children:
                child.send(signal.SIGINT)

    def begin(self) -> None:
        self.stopping = True
        for child in self.children:
            if child.listening:
                child.send(signal.SIGTERM)


def _supervise(children: list[_Child], engine: subprocess.Popen, engine_fd: int, stop: _Stopper, line: str,
               grace: float) -> str | None:
    """Wait until every HTTP process and the engine have ended; print `line` once all listen.
    Returns what failed (None: a clean stop). `grace`: seconds a stop may take before the rest is killed."""
    failure: str | None = None
    alive = {c.pidfd: c for c in children}
    controls = {c.control: c for c in children}
    engine_alive = True
    printed = killed = False
    deadline: float | None = None
    try:
        while alive or engine_alive:
            if stop.stopping and deadline is None:
                deadline = time.monotonic() + grace
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            watched = [*alive, *controls] + ([engine_fd] if engine_alive else [])
            ready = wait(watched, timeout)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                if killed:  # SIGKILL ends any process: not reached unless the kernel is stuck
                    break
                failure = failure or f"the stop outlasted {grace:.0f} s: killed what was left"
                for c in alive.values():
                    c.proc.kill()
                if engine_alive:
                    engine.kill()
                killed, deadline = True, time.monotonic() + 30
            for r in ready:
                if r in controls:
                    child = controls.pop(r)  # type: ignore[index]
                    try:
                        child.control.recv_bytes()  # "listening"
                        child.listening = True
                        if stop.stopping:  # the stop came while it started: it drains now
                            child.send(signal.SIGTERM)
                    except (EOFError, OSError):
                        pass  # it died: its pidfd says so
                    if not printed and all(c.listening for c in children):
                        print(line, file=sys.stderr, flush=True)
                        printed = True
                elif r == engine_fd:
                    engine_alive = False
                    code = engine.wait()
                    # It ends by itself once every HTTP process has stopped its pipe (or died).
                    if (not stop.stopping or code != 0) and failure is None:
                        failure = f"the engine process (pid {engine.pid}) exited (code {code})"
                    stop.begin()
                else:
                    child = alive.pop(r)  # type: ignore[arg-type]
                    code = child.proc.wait()
                    clean = code == 0 or (stop.stopping and code == -signal.SIGTERM)  # stopped before it served
                    if (not stop.stopping or not clean) and failure is None:
                        failure = f"API server process {child.index} (pid {child.proc.pid}) exited (code {code})"
                    if not stop.stopping:
                        stop.begin()
    finally:
        for c in children:
            os.close(c.pidfd)
            c.control.close()
        os.close(engine_fd)
    return failure
