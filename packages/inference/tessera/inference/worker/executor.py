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

Loading goes straight into the shards (`load_shard`): the model is built on the meta device,
tensor-parallel layers are swapped in (the kind's parallel plan, `tessera.common.models.registry`), and only then
are the rank's tensors allocated and read: from a Tessera checkpoint of any layout with DCP and the
layout-free sharded state dict (each rank reads only its slices), from an HF directory one
memory-mapped tensor at a time, of which the rank keeps its slice.

Tensor parallel splits query heads, key/value heads (those of the same query groups go together)
and the vocabulary over the ranks, so N must divide the query heads and the vocabulary, and either
divide the key/value heads or be a multiple of them. With N > key/value heads (Megatron's and
vLLM's rule) each key/value head is replicated on N / kv_heads ranks, and each rank holds one:
the worker builds the model with N key/value heads (head j a copy of head j // (N / kv_heads),
which is exactly the head its query heads use) and reads into its k/v projections only the rows
of that one head, from a DCP checkpoint as a DTensor on a (kv_heads, N / kv_heads) mesh sharded
over the first dimension and replicated over the second, from an HF directory as that head's
slice. Nothing on disk changes: checkpoints stay layout-free. Checked on the driver before any
weight is read (`loader.check_tensor_parallel`).

Failure: a worker that dies (or raises, then exits) makes the next step raise `WorkerDied`, which
ends the engine (the server's /health then fails and requests get errors) instead of hanging. A
worker exits when told (`shutdown`: up to 10 s, then killed), when its pipe to the driver closes,
and on Linux when the driver process dies (PR_SET_PDEATHSIG, also before the worker got to set
it), so stopping or killing the server, or a failed start, leaves no worker behind. Whoever drives
the engine closes it when done: the engine process, or the server's engine thread (frontend.py).
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing as mp
import os
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from tessera.common.errors import UserError
from tessera.common.layers.rope import reset_rotary_tables
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.inference.core.scheduler import SchedulerOutput
from tessera.inference.sample.sampler import Sampler
from tessera.inference.worker.batch import (
    BatchSeq,
    DecodeUpdate,
    ModelRunnerOutput,
    batch_seqs,
    images_to_wire,
    with_wire_images,
)
from tessera.inference.worker.cpu_linear import PackedLinear
from tessera.inference.worker.cpu_threads import Binding, apply_binding
from tessera.inference.worker.cuda_graphs import GraphSpec
from tessera.inference.worker.kv_cache import kv_cache_dtype
from tessera.inference.worker.latent.mtp import worker_drafter, worker_mtp
from tessera.inference.worker.loader import DTYPES
from tessera.inference.worker.logits_mailbox import (
    LogitsMailbox,
    open_mailbox,
    receive_rows,
    send_gathered,
    send_rows,
)
from tessera.inference.worker.model_runner import ModelRunner
from tessera.inference.worker.pooling.encoder import encoder_runner
from tessera.inference.worker.pooling.runner import PoolingSteps
from tessera.inference.worker.prepare import ServingPrep, serving_runner

log = logging.getLogger("tessera.inference")

READY_TIMEOUT_S = 600.0  # loading a large shard from slow storage


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited or failed: the engine cannot go on."""


# ---- the worker ------------------------------------------------------------------------------

def replicated_kv_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model a rank builds: `cfg` itself, or with tp > kv_heads one with tp key/value heads,
    head j a replica of cfg's head j // (tp / kv_heads). Query head h uses replica h // (H / tp),
    which is cfg's head h // (H / kv_heads): the same attention, one key/value head per rank."""
    return cfg if cfg.kv_heads >= tp else cfg.model_copy(update={"num_kv_heads": tp})


def load_shard(path: Path, hf: bool, cfg: ModelConfig, groups, device: torch.device, dtype: torch.dtype,
               expert_parallel: bool = False):
    """This rank's shard of the model, read straight into it (never the whole model at once);
    `expert_parallel`: with its slice of each MoE layer's experts (else every expert)."""
    from tessera.common.models.causal_lm.model import Transformer
    from tessera.common.models.registry import kind_of
    from tessera.common.parallel.expert_parallel import shard_experts_over_tensor_ranks
    from tessera.common.parallel.layers import allocate

    kind = kind_of(cfg)
    if isinstance(cfg, ModelConfig):
        with torch.device("meta"):
            model = Transformer(replicated_kv_config(cfg, groups.tp))
            stored = {n: p.shape for n, p in Transformer(cfg).named_parameters()}  # global shapes on disk
    else:  # another kind (hybrid): its own model, key/value heads never replicated (loader checks)
        model = kind.build(cfg, device="meta", seed=None)
        stored = kind.tensor_shapes(cfg)
    model = kind.parallel().tensor(model, groups)
    if expert_parallel:
        shard_experts_over_tensor_ranks(model, groups.tp_group, groups.tp, groups.tp_rank)
    allocate(model, device)  # only this rank's shard is ever allocated
    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.state_dict().items() if n not in params}
    if hf:
        _load_hf_shard(path, cfg, params, buffers, groups.tp_rank, groups.tp)
    else:
        # (A vision-language config has no kv_heads of its own: its key/value heads are never replicated.)
        _load_dcp_shard(path, params, buffers, groups, stored, getattr(cfg, "kv_heads", groups.tp))
    reset_rotary_tables(model)  # computed, not stored: to_empty left them uninitialised
    return model.to(dtype=dtype).eval()


def _load_dcp_shard(path: Path, params: dict, buffers: dict, groups, stored: dict, kv_heads: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tessera.common.checkpoint import load_model_tensors, metadata_digest
    from tessera.common.parallel.layers import shard_dim_of
    from tessera.common.parallel.state_dict import MODEL_PREFIX, load_model_state_dict, model_state_dict
    from tessera.common.safe_dcp import dcp_load

    state = model_state_dict(params, groups)  # global DTensors: DCP reads this rank's slices only
    replicated = [n for n, p in params.items()
                  if (dim := shard_dim_of(p)) is not None and p.shape[dim] * groups.tp != stored[n][dim]]
    if replicated:  # k/v projections of replicated key/value heads: rank r reads head r // (tp / kv_heads)
        mesh = DeviceMesh(groups.device.type, torch.arange(groups.tp).view(kv_heads, groups.tp // kv_heads),
                          mesh_dim_names=("kv", "replica"))
        for n in replicated:
            state[MODEL_PREFIX + n] = DTensor.from_local(params[n].detach().clone(), mesh,
                                                         [Shard(shard_dim_of(params[n])), Replicate()],
                                                         run_check=False)
    dcp_load(state, path, expected_digest=metadata_digest(path))
    load_model_state_dict(params, state)
    if buffers:  # persistent buffers (an MoE router's bias): small and replicated
        for name, t in load_model_tensors(path, list(buffers)).items():
            buffers[name].copy_(t)


def _load_hf_shard(path: Path, cfg: ModelConfig, params: dict, buffers: dict, rank: int, world: int) -> None:
    from tessera.common.hf.directory import checked_hf_weights
    from tessera.common.parallel.layers import shard_dim_of

    weights, rules = checked_hf_weights(path, cfg)
    local = {**params, **buffers}
    with torch.no_grad():
        for rule in rules:  # one full tensor (memory-mapped sources, converted) at a time
            full = rule.apply([weights.get(s) for s in rule.sources])
            dst = local[rule.target]
            dim = shard_dim_of(dst) if rule.target in params else None
            if dim is not None:
                # `pieces` is world, or for a replicated key/value head the kv_heads it is one of.
                pieces = full.shape[dim] // dst.shape[dim]
                full = full.chunk(pieces, dim=dim)[rank * pieces // world]
            dst.copy_(full)
            del full


def die_with_parent(parent: int) -> None:
    """Be killed when `parent` (this process's parent) dies, or exit now if it already has: it
    may have died before the prctl, whose signal then never comes. Linux sends the signal when the
    *thread* that started this process ends, so workers are started from a thread that lives as long
    as the driver (every entry point builds its engine on its main thread)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent:
        os._exit(0)


def _worker_main(rank: int, world: int, store_path: str, init: dict, conn: Connection,
                 mailbox: torch.Tensor | None = None) -> None:
    die_with_parent(init["driver"])
    # The driver decides when to stop: a Ctrl-C sent to the whole group must not end a worker while
    # the server drains; the driver's death still does (above). SIGTERM keeps its default: the
    # workers are daemons, which multiprocessing ends with SIGTERM at the driver's exit (ignoring it
    # would hang that exit on any worker still alive).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        code = _worker(rank, world, store_path, init, conn, mailbox)
    except (EOFError, OSError):
        code = 0  # the driver went away
    except UserError as exc:
        _reply(conn, {"t": "error", "user": True, "message": str(exc)})
        code = 2
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then exit
        traceback.print_exc()
        _reply(conn, {"t": "error", "user": False, "message": f"rank {rank}: {type(exc).__name__}: {exc}"})
        code = 1
    os._exit(code)  # skip teardown that could wait on peers that are gone


def _reply(conn: Connection, msg: dict) -> None:
    try:
        conn.send_bytes(json.dumps(msg).encode())
    except OSError:
        pass


def _worker(rank: int, world: int, store_path: str, init: dict, conn: Connection,
            mailbox: torch.Tensor | None) -> int:
    import datetime

    import torch.distributed as dist

    from tessera.common.layout import ParallelLayout
    from tessera.common.parallel.state import build_groups

    threads = init["threads"][rank]  # this rank's share of the cores (cpu_threads.py)
    apply_binding(Binding(int(threads["threads"]), None if threads["cpus"] is None else tuple(threads["cpus"])))
    cuda = init["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=READY_TIMEOUT_S))
    groups = build_groups(ParallelLayout(tensor=world), device)
    from tessera.common.models.registry import model_config

    cfg = model_config(init["model"])
    dtype = DTYPES[init["dtype"]]
    model = load_shard(Path(init["path"]), init["hf"], cfg, groups, device, dtype, init["expert_parallel"])
    numel = sum(p.numel() for p in model.parameters())  # before packing (packed weights are not parameters)
    # This rank's shards of q/k/v and gate/up stacked, its Linear weights packed (prepare.py).
    prep = ServingPrep(**init["prep"])
    if init.get("pooling"):  # an encoder: its shard pools embed requests (pooling/encoder.py)
        runner = encoder_runner(model, device, dtype, prep.cpu_linear, prep.batch_hint, prep.quantized)
    else:
        runner = serving_runner(model, prep, init["num_blocks"], init["block_size"], device, dtype, rank, world,
                                kv_dtype=kv_cache_dtype(init["kv_cache_dtype"], dtype, device),
                                what=f"tensor-parallel rank {rank}")
    if init.get("graphs"):  # every rank captures the same buckets in the same order (NCCL all-reduces included)
        runner.use_decode_graphs(GraphSpec(**init["graphs"]))
    packed = sum(isinstance(m, PackedLinear) for m in model.modules())
    mailbox, unmapped = open_mailbox(init.get("mailbox"), mailbox) if rank == 0 else (None, None)  # (logits_mailbox.py)
    _reply(conn, {"t": "ready", "numel": numel, "kv_bytes": runner.kv.nbytes, "packed": packed, "unmapped": unmapped,
                  "state": runner.state_summary(), "pools": hasattr(runner, "forward_pooled"),
                  "decode_batch": not init.get("pooling") and type(runner).keeps_decode_batch(),
                  "threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0))})
    tp_group = groups.tp_group
    drafter = None  # the MTP's drafter over this shard (speculative method mtp: spec_decode/mtp.py)
    while True:
        msg = json.loads(conn.recv_bytes())
        if msg["t"] == "stop":
            return 0
        if msg["t"] == "mtp_attach":
            drafter = worker_drafter(runner, msg["num_blocks"], msg["block_size"])
            _reply(conn, {"t": "ready"})
            continue
        if msg["t"] == "mtp":
            with torch.inference_mode():
                rows = worker_mtp(drafter, msg, world, tp_group)
            if rows is not None and rank == 0:
                send_rows(conn, [rows], mailbox=mailbox)
            continue
        if msg["t"] == "pool":
            runner.pool_mode = msg["mode"]
            vectors = runner.pool_inputs([(rid, ids) for rid, ids in msg["inputs"]])
            if rank == 0:
                _reply(conn, {"t": "pooled", "vectors": vectors})
            continue
        if msg["t"] == "decode":  # a steady decode step: the driver's update to this rank's persistent batch
            with torch.inference_mode():
                local = runner.decode_logits(DecodeUpdate.from_wire(msg["u"]))
            send_gathered(conn, local, rank, world, tp_group, mailbox=mailbox)
            continue
        batch = with_wire_images([BatchSeq(*s) for s in msg["seqs"]], msg.get("images"))
        pooling, pooled = msg.get("pooling"), None  # embed requests' (mode, spans): pooling/runner.py
        with torch.inference_mode():
            if pooling:
                local, pooled = runner.forward_pooled(batch, msg["rows"], pooling[0], [tuple(p) for p in pooling[1]])
            else:
                local = runner.forward_batch(batch, msg["rows"])  # [R, vocab rows / tp]
            if msg.get("hidden") is not None:  # the sequences' hidden rows, kept for the MTP's catch-up
                drafter.record(msg["hidden"], batch, runner)
            send_gathered(conn, local, rank, world, tp_group, pooled=pooled, mailbox=mailbox)


# ---- the driver ------------------------------------------------------------------------------

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

    def _send(self, frame: bytes) -> None:
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
        self._send(json.dumps({"t": "step", "seqs": [[s.tokens, s.start, s.block_table, s.num_q, s.state_slot,
                                                      s.prompt_len] for s in batch],
                               "rows": rows, "pooling": pooling, "images": images_to_wire(batch),
                               "hidden": hidden}).encode())
        return self.recv_logits(device, pooling is not None)

    def forward_decode(self, update: DecodeUpdate, device: torch.device) -> torch.Tensor:
        """A steady decode step's logits rows, the workers sent only its update to their batches."""
        self._send(json.dumps({"t": "decode", "u": update.to_wire()}).encode())
        return self.recv_logits(device)[0]

    def recv_logits(self, device: torch.device, pooling: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rank 0's logits rows of the last command (and pooled rows, with `pooling`)."""
        return receive_rows(self._recv(0), self.conns[0], self.mailbox, device, pooling)

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


class TensorParallelRunner(PoolingSteps, ModelRunner):
    """The driver's model runner: `execute` (which rows to compute, sampling, verifying drafts,
    pooling embed requests) is ModelRunner's own; `forward` runs on the workers. It holds no
    weights and no KV cache."""

    def __init__(self, executor: TensorParallelExecutor, device: torch.device):  # noqa: D107 - no super(): no model
        self.executor = executor
        self.device = device
        self.block_size = executor.block_size
        self.sampler = Sampler()

    @property
    def pools(self) -> bool:
        return self.executor.pools

    # Set by the MTP proposer (spec_decode/mtp.py): request id -> (start, rows) of the last step,
    # whose hidden rows the workers keep.
    step_rows: dict[str, tuple[int, int]] | None = None

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """A steady decode step goes as an update to the workers' persistent batches (unless the
        MTP keeps hidden rows, which its `step` command carries); any other as its sequences."""
        if plan.single_token and self.executor.decode_batch and self.step_rows is None:
            return self._execute_single_token(plan)
        return super().execute(plan)

    def decode_logits(self, update: DecodeUpdate, tokens: torch.Tensor | None = None) -> torch.Tensor:
        # A step that fails on its way leaves the workers' batches behind the driver's: harmless, as
        # a row is kept only when its sequence advanced by one, i.e. when the step before it ran.
        assert tokens is None, "no async scheduling under tensor parallel"
        return self.executor.forward_decode(update, self.device)

    def forward(self, plan: SchedulerOutput, logits_rows: list[int]) -> torch.Tensor:
        hidden = None
        if self.step_rows is not None:
            self.step_rows.update({s.seq.request_id: (s.start, s.num_new) for s in plan.scheduled})
            hidden = [s.seq.request_id for s in plan.scheduled]
        pooling = None if self._pool_spans is None else (self.pool_mode, self._pool_spans)
        logits, pooled = self.executor.forward_pooled(batch_seqs(plan), logits_rows, self.device, pooling, hidden)
        if pooling is not None:
            self._pooled = pooled
        return logits

    def state_summary(self) -> str | None:
        return self.executor.state

    def close(self) -> None:
        self.executor.shutdown()
