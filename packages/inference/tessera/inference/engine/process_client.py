"""The HTTP process's side of an engine running in its own process (core_process.py).

`ProcessEngine.launch` starts the child, sends it the checkpoint and engine config, and waits
until the model is loaded: a bad checkpoint comes back as the child's one-line UserError (the
CLI prints it and exits 2). After that, requests and aborts go down the pipe as they are
submitted, and a reader thread turns each step's outputs into stream deliveries and metrics.
The tokenizer is loaded here too (prompts are tokenized, chat templates rendered and logprob
tokens spelled in the HTTP process); the child detokenizes the output it generates.

Under `tessera-serve --api-server-count N` (entrypoints/api_servers.py) a launcher starts the engine
process with N pipes (`start_engine_process`) and hands one to each HTTP process, which wraps it with
`ProcessEngine.connect`: the engine process is then the launcher's child, not this process's.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from tessera.common.errors import UserError
from tessera.common.tokenizer import load_tokenizer
from tessera.inference.config import EngineConfig
from tessera.inference.core.generation_defaults import GenerationDefaults
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.frontend import EngineDead, EngineFrontend
from tessera.inference.engine.wire import decode, encode, output_from_wire, stats_from_wire
from tessera.inference.worker.cpu_threads import ThreadPlan
from tessera.inference.worker.pooling.spec import PoolingSpec

log = logging.getLogger("tessera.inference")


class EngineProcessError(EngineDead):
    """The engine process failed or exited; requests in flight fail with HTTP 500."""


def start_engine_process(checkpoint: str, cfg: EngineConfig, threads: ThreadPlan | None = None,
                         pipes: int = 1) -> tuple[subprocess.Popen, list[Connection], dict]:
    """Start the engine process with `pipes` pipes to it and wait until its model is loaded (or raise
    its error); returns the process, this side of each pipe and the model facts of its ready message.
    `threads`: its torch threads and CPUs (worker/cpu_threads.py; None: torch's default)."""
    pairs = [socket.socketpair() for _ in range(pipes)]
    try:
        fds = [theirs.fileno() for _, theirs in pairs]
        proc = subprocess.Popen([sys.executable, "-m", "tessera.inference.engine.core_process", *map(str, fds)],
                                pass_fds=fds)
    finally:
        for _, theirs in pairs:
            theirs.close()
    conns = [Connection(ours.detach()) for ours, _ in pairs]

    def close_all() -> None:
        for c in conns:
            c.close()

    conn = conns[0]  # the init and ready messages go over the first pipe
    try:
        conn.send_bytes(encode({"t": "init", "checkpoint": os.fspath(checkpoint), "engine": cfg.model_dump(),
                                "threads": None if threads is None else threads.to_wire()}))
        msg = decode(conn.recv_bytes())
    except (EOFError, OSError):
        code = proc.wait()
        close_all()
        raise EngineProcessError(f"the engine process exited (code {code}) before loading the model") from None
    if msg["t"] != "ready":
        proc.wait()
        close_all()
        if msg["t"] == "error" and msg.get("user"):
            raise UserError(msg["message"])
        raise EngineProcessError(f"the engine process failed to start: {msg.get('message')}")
    return proc, conns, msg


class ProcessEngine(EngineFrontend):
    def __init__(self, proc: subprocess.Popen | None, conn: Connection, info: dict, max_waiting: int):
        """`proc`: the engine process when it is this process's child; None when another process (the
        api_servers launcher) started it and waits for it."""
        super().__init__(load_tokenizer(info["tokenizer_dir"]), int(info["max_model_len"]), int(info["vocab_size"]),
                         info["eos_ids"], max_waiting)
        self.info = info
        self.pooling = None if info.get("pooling") is None else PoolingSpec.from_wire(info["pooling"])
        self.generates = bool(info.get("generates", True))
        self.vision = info.get("vision")
        self.scores_prompts = bool(info.get("scores_prompts", True))
        self.generation_defaults = GenerationDefaults.from_wire(info.get("generation_defaults"))
        self._proc = proc
        self._conn = conn
        self._adds_sent = 0
        self._adds_seen = 0
        self._engine_waiting = 0
        self._stopping = False
        self._send_lock = threading.Lock()
        self._error: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="tessera-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def launch(cls, checkpoint: str, cfg: EngineConfig, threads: ThreadPlan | None = None) -> ProcessEngine:
        """Start the engine process and wait until its model is loaded (or raise its error);
        `threads`: its torch threads and CPUs (worker/cpu_threads.py; None: torch's default)."""
        proc, conns, info = start_engine_process(checkpoint, cfg, threads)
        return cls(proc, conns[0], info, cfg.max_waiting)

    @classmethod
    def connect(cls, conn: Connection, info: dict, max_waiting: int) -> ProcessEngine:
        """One pipe of an engine process another process started (its ready message's facts: `info`)."""
        return cls(None, conn, info, max_waiting)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to do: the process runs from launch (the app's lifespan calls this)."""

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let running requests finish (up to `timeout` s), then stop the engine process (when one
        of several pipes: stop this pipe; the engine ends when every pipe has stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.num_active() and self.healthy:
            time.sleep(0.05)
        self._stopping = True
        try:
            self._send({"t": "stop"})
        except EngineProcessError:
            pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout=5)
        self._conn.close()

    @property
    def healthy(self) -> bool:
        # Another process's child: its death reaches this one as the pipe's end (the reader's error).
        return self._error is None and not self._stopping and (self._proc is None or self._proc.poll() is None)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # ---- backend hooks ---------------------------------------------------------------------
    def _send(self, msg: dict) -> None:
        # A lock of its own, not self._cv: a send can block while the pipe is full, and the
        # reader thread must still be able to deliver (and so drain the other direction).
        try:
            with self._send_lock:
                self._conn.send_bytes(encode(msg))
        except OSError as exc:
            raise EngineProcessError(f"the engine process is gone: {exc}") from None

    def _send_add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        with self._cv:
            self._adds_sent += 1
        self._send({"t": "add", "id": request_id, "prompt": prompt_ids, "params": params.model_dump(mode="json")})

    def _send_abort(self, request_id: str) -> None:
        try:
            self._send({"t": "abort", "ids": [request_id]})
        except EngineProcessError:
            pass  # nothing left to abort

    def _num_waiting(self) -> int:
        # Requests sent but not yet seen by the engine, plus those its scheduler has waiting.
        return self._adds_sent - self._adds_seen + self._engine_waiting

    # ---- the reader thread -----------------------------------------------------------------
    def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                msg = decode(self._conn.recv_bytes())
                now = time.monotonic()
                if msg["t"] == "failed":
                    raise EngineProcessError(f"the engine failed: {msg['message']}")
                if msg["t"] != "step":
                    continue
                stats = stats_from_wire(msg["stats"])
                with self._cv:
                    self._adds_seen = int(msg["adds_seen"])
                    self._engine_waiting = stats.num_waiting
                items: list = [(o[0], output_from_wire(o, now)) for o in msg["outs"]]
                items += [(rid, EngineProcessError(message)) for rid, message in msg["failed"]]
                if items:
                    self._deliver(items, now)
                if self.metrics is not None:
                    self.metrics.update_engine(stats)
        except (EOFError, OSError):
            if not self._stopping:
                code = "" if self._proc is None else f" (code {self._proc.poll()})"
                error = EngineProcessError(f"the engine process exited unexpectedly{code}")
        except BaseException as exc:
            error = exc
        if error is not None:
            log.error("%s", error)
            self._error = error
            self._fail_all(error)
