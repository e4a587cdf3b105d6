"""Tensor-parallel serving (`--tensor-parallel N`): N worker processes, one per tensor rank, each
holding its weight shard and its share of the KV heads in its own paged KV cache.

```
driver (LLMEngine: scheduler, sampler, output processor)        workers (rank 0..N-1, spawned)
  TensorParallelRunner.execute(plan)                              ModelRunner over the rank's shard
    forward: plan -> [BatchSeq] + logits rows ══ pipe, JSON ══▶  every rank: forward (all-reduces
                                                                 over gloo / NCCL between ranks)
    logits [R, vocab] ◀═ shared buffer, header on the pipe ═ rank 0  gather of the vocabulary slices
    (+ pooled rows [E, d] of the step's embed requests, pooling/runner.py)
    sample / verify / pool exactly as on one device
```

vLLM's shape (an executor driving workers, the scheduler on the driver), with the split at the
logits: the driver keeps the sampler and every sequence's generator, so greedy and seeded sampling
pick tokens exactly as one device does from the same logits (tensor parallel changes only the
summation order inside the all-reduces). The workers are spawned by the engine, not torchrun, and
form their own process group (gloo on CPU, NCCL on GPU: worker r on cuda:r); the driver is not in
it and talks to each worker over its own pipe, in JSON (never pickle) one way and raw tensor bytes
the other; the logits rows themselves land in a buffer the driver shares with rank 0
(logits_mailbox.py: shared memory on CPU, CUDA IPC on a GPU), which spares each step copying tens of MB
through the pipe. A vision-language model's step carries the pixels of the images whose tokens its
prefill chunks hold (batch.images_to_wire); every rank runs the vision tower over them. With MTP
drafts (spec_decode/mtp.py) each rank also keeps the step's hidden rows and runs the MTP's forwards
(`mtp` commands, logits gathered as the target's).

Failure: a worker that dies (or raises, then exits) makes the next step raise `WorkerDied`, which
ends the engine (the server's /health then fails and requests get errors) instead of hanging. A
worker exits when told (`shutdown`: up to 10 s, then killed), when its pipe to the driver closes,
and on Linux when the driver process dies (PR_SET_PDEATHSIG, also before the worker got to set
it), so stopping or killing the server, or a failed start, leaves no worker behind. Whoever drives
the engine closes it when done: the engine process, or the server's engine thread (frontend.py).

The worker's side: worker.py; the driver's model runner: runner.py.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import select
import tempfile
import threading
import time
from dataclasses import asdict
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from tessera.common.errors import UserError
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.inference.worker.batch import (
    BatchSeq,
    DecodeUpdate,
    images_to_wire,
)
from tessera.inference.worker.cpu_threads import Binding
from tessera.inference.worker.cuda_graphs import GraphSpec
from tessera.inference.worker.prepare import ServingPrep
from tessera.inference.worker.tensor_parallel.logits_mailbox import (
    LogitsMailbox,
    receive_rows,
)
from tessera.inference.worker.tensor_parallel.worker import READY_TIMEOUT_S, _worker_main

log = logging.getLogger("tessera.inference")


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited or failed: the engine cannot go on."""


class TensorParallelExecutor:
    """Spawns the workers, waits until each holds its shard, sends them each step, and returns
    rank 0's logits. Any worker's death is noticed at the next wait (`WorkerDied`)."""

    def __init__(self, path: Path, hf: bool, cfg: ModelConfig, tp: int, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, kv_dtype_name: str = "auto",
                 graphs: GraphSpec | None = None, prep: ServingPrep | None = None,
                 bindings: tuple[Binding, ...] | None = None, pooling: bool = False, expert_parallel: bool = False,
                 logits_rows: int = 0):
        """`logits_rows`: the most logits rows a step returns through the shared buffer
        (logits_mailbox.py; 0: none, every step's rows go over the pipe)."""
        self.tp = tp
        self.block_size = block_size
        # Each worker's threads and CPUs; by default the driver's thread count, unbound.
        bindings = bindings or (Binding(torch.get_num_threads()),) * tp
        ctx = mp.get_context("spawn")  # fork would copy the driver's threads and CUDA state
        self._store_dir = tempfile.TemporaryDirectory(prefix="tessera-tp-")
        store = str(Path(self._store_dir.name) / "store")
        init = {"path": str(path), "hf": hf, "model": cfg.model_dump(mode="json"), "num_blocks": num_blocks,
                "block_size": block_size, "device": device.type, "dtype": str(dtype).removeprefix("torch."),
                "threads": [asdict(b) for b in bindings],
                "kv_cache_dtype": kv_dtype_name,  # --kv-cache-dtype, resolved on each worker
                "graphs": None if graphs is None else asdict(graphs),  # decode graphs, each worker its own
                "prep": asdict(prep or ServingPrep()),  # how each worker prepares its shard
                "pooling": pooling,  # an encoder: the workers pool embed requests (`pool`), no KV cache
                "expert_parallel": expert_parallel,  # each worker holds E / tp of every MoE layer's experts
                "driver": os.getpid()}
        self.mailbox = None
        if logits_rows and not pooling:
            self.mailbox = LogitsMailbox.make(logits_rows, getattr(cfg, "vocab_rows", cfg.vocab_size), device)
            init["mailbox"] = None if self.mailbox is None else self.mailbox.spec()
        self.unread = False  # a step's logits rows are on their way and not read yet (`_send`)
        self._closing = threading.Lock()  # the engine thread and the CLI's cleanup may both shut down
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        try:
            for rank in range(tp):
                ours, theirs = ctx.Pipe(duplex=True)
                shared = self.mailbox.tensor if self.mailbox is not None and rank == 0 else None  # CUDA IPC
                proc = ctx.Process(target=_worker_main, args=(rank, tp, store, init, theirs, shared), daemon=True,
                                   name=f"tessera-tp-worker-{rank}")
                proc.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(proc)
            self.shard_numel: list[int] = []  # parameter elements each worker holds
            self.kv_bytes: list[int] = []  # bytes of each worker's KV pool
            self.packed_linears: list[int] = []  # oneDNN-packed Linear layers of each worker (prepare.py)
            self.bindings: list[Binding] = []  # each worker's torch threads and CPUs, as it reports them
            self.state: str | None = None  # rank 0's per-sequence state pool (hybrid models), in words
            self.pools = False  # the workers' runner pools embed requests in a step (pooling/runner.py)
            # The workers' runner keeps a persistent decode batch (batch.DecodeBatch): steady decode
            # steps are sent as the update to it (`forward_decode`).
            self.decode_batch = False
            for rank in range(tp):
                msg = self._recv(rank, READY_TIMEOUT_S)
                if msg.get("t") != "ready":
                    raise WorkerDied(f"tensor-parallel worker {rank}: unexpected message {msg.get('t')!r}")
                self.shard_numel.append(int(msg["numel"]))
                self.kv_bytes.append(int(msg["kv_bytes"]))
                self.packed_linears.append(int(msg["packed"]))
                self.bindings.append(Binding(int(msg["threads"]), tuple(msg["cpus"])))
                if rank == 0 and msg.get("state"):
                    self.state = f"{msg['state']} on each of {tp} ranks"
                self.pools = bool(msg.get("pools")) if rank == 0 else self.pools
                self.decode_batch = bool(msg.get("decode_batch")) if rank == 0 else self.decode_batch
                if rank == 0 and self.mailbox is not None:
                    self.mailbox.release()  # mapped by both now (or never by rank 0)
                    if msg.get("unmapped"):
                        log.warning("tensor parallel: rank 0 cannot map the shared buffer of logits rows (%s); "
                                    "they go over the pipe", msg["unmapped"])
                        self.mailbox = None
        except BaseException:
            self.shutdown(timeout=0)  # a worker still loading never reads `stop`: killed at once
            raise

    def _recv(self, rank: int, timeout: float | None = None) -> dict:
        """The next JSON message from `rank`, or WorkerDied if any worker exits or reports an error."""
        conn = self.conns[rank]
        ready = wait([conn, *(p.sentinel for p in self.procs)], timeout)
        if conn not in ready:
            if not ready:
                raise WorkerDied(f"tensor-parallel worker {rank} did not answer within {timeout:.0f} s")
            dead = [r for r, p in enumerate(self.procs) if p.sentinel in ready]
            for r in dead:  # a worker that failed says why before it exits (a killed one cannot)
                try:
                    msg = json.loads(self.conns[r].recv_bytes()) if self.conns[r].poll() else None
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg.get("t") == "error":
                    self._raise_error(r, msg)
            self.procs[dead[0]].join(1)
            raise WorkerDied(f"tensor-parallel worker {dead[0]} exited (code {self.procs[dead[0]].exitcode})")
        try:
            msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            raise WorkerDied(f"tensor-parallel worker {rank} closed its pipe") from None
        if msg.get("t") == "error":
            self._raise_error(rank, msg)
        return msg

    @staticmethod
    def _raise_error(rank: int, msg: dict):
        if msg.get("user"):
            raise UserError(msg["message"])
        raise WorkerDied(f"tensor-parallel worker {rank} failed: {msg.get('message')}")

    def send_all(self, msg: dict) -> None:
        """One command to every worker (the MTP's: spec_decode/mtp.py)."""
        self._send(json.dumps(msg).encode())

    def recv_ready(self) -> None:
        """Every worker's `ready` to the last command (or WorkerDied / its UserError)."""
        for rank in range(self.tp):
            self._recv(rank)

    def _send(self, frame: bytes, reply: bool = False) -> None:
        """`frame` to every worker; `reply`: a command whose rows `recv_logits` reads. Under async
        scheduling a step is sent before the one before it is read: any command sent while rows are
        unread would take them for its own answer, so it is refused."""
        if self.unread:
            raise RuntimeError("tensor parallel: a command sent before the last step's logits rows were read")
        self.unread = reply
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(frame)
            except OSError:
                raise WorkerDied(f"tensor-parallel worker {rank} is gone") from None

    def pool(self, inputs: list[tuple[str, list[int]]], mode: str) -> dict[str, list[float]]:
        """Pooled vectors of (request id, token ids) inputs, computed by the workers (an encoder)."""
        self._send(json.dumps({"t": "pool", "inputs": inputs, "mode": mode}).encode())
        return self._recv(0)["vectors"]

    def forward_pooled(self, batch: list[BatchSeq], rows: list[int], device: torch.device,
                       pooling: tuple[str, list[tuple[int, int]]] | None = None, hidden: list[str] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits rows and, with `pooling` (mode, each embed request's (first row, rows)),
        its pooled rows [E, d] fp32 (on the CPU). `hidden`: the sequences' request ids, whose
        hidden rows the workers keep for the MTP (spec_decode/mtp.py)."""
        self.send_step(batch, rows, pooling, hidden)
        return self.recv_logits(device, pooling is not None)

    def send_step(self, batch: list[BatchSeq], rows: list[int],
                  pooling: tuple[str, list[tuple[int, int]]] | None = None, hidden: list[str] | None = None) -> None:
        """`forward_pooled` without waiting for the rows (async scheduling: `recv_logits` later)."""
        self._send(json.dumps({"t": "step", "seqs": [[s.tokens, s.start, s.block_table, s.num_q, s.state_slot,
                                                      s.prompt_len] for s in batch],
                               "rows": rows, "pooling": pooling, "images": images_to_wire(batch),
                               "hidden": hidden}).encode(), reply=True)

    def forward_decode(self, update: DecodeUpdate, device: torch.device) -> torch.Tensor:
        """A steady decode step's logits rows, the workers sent only its update to their batches."""
        self.send_decode(update)
        return self.recv_logits(device)[0]

    def send_decode(self, update: DecodeUpdate) -> None:
        """`forward_decode` without waiting for the rows (async scheduling: `recv_logits` later)."""
        self._send(json.dumps({"t": "decode", "u": update.to_wire()}).encode(), reply=True)

    def recv_logits(self, device: torch.device, pooling: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rank 0's logits rows of the last command (and pooled rows, with `pooling`)."""
        self.unread = False
        head = self._recv(0)
        try:
            return receive_rows(head, self.conns[0], self.mailbox, device, pooling)
        except (EOFError, OSError):  # rank 0 died between the header and its data frames
            raise WorkerDied("tensor-parallel worker 0 closed its pipe in the middle of a reply") from None

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker: asked, then those still running after `timeout` s in all (one blocked
        in a collective with a dead peer never reads `stop`) killed, and each waited for. Safe to
        call twice, and from two threads at once."""
        with self._closing:
            for conn in self.conns:
                try:
                    if select.select([], [conn], [], 0)[1]:  # a full pipe (a worker not reading) would block
                        conn.send_bytes(json.dumps({"t": "stop"}).encode())
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + timeout
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            for proc in self.procs:
                if proc.is_alive():
                    if timeout:
                        log.warning("tensor-parallel worker %s (pid %s) did not stop within %.0f s: killed",
                                    proc.name, proc.pid, timeout)
                    proc.kill()
                proc.join(10)  # SIGKILL cannot be ignored: bounded only against a kernel stuck in I/O
            for conn in self.conns:
                conn.close()
            self.conns, self.procs = [], []
            if self.mailbox is not None:
                self.mailbox.release()
            self._store_dir.cleanup()
