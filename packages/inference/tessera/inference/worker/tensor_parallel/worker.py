"""A tensor-parallel worker process (spawned by executor.py): it joins its peers' process group,
loads its shard, and runs each step the driver sends it.

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
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from tessera.common.errors import UserError
from tessera.common.layers.rope import reset_rotary_tables
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.inference.worker.batch import (
    BatchSeq,
    DecodeUpdate,
    with_wire_images,
)
from tessera.inference.worker.cpu_linear import PackedLinear
from tessera.inference.worker.cpu_threads import Binding, apply_binding
from tessera.inference.worker.cuda_graphs import GraphSpec
from tessera.inference.worker.kv_cache import kv_cache_dtype
from tessera.inference.worker.latent.mtp import worker_drafter, worker_mtp
from tessera.inference.worker.loader import DTYPES
from tessera.inference.worker.pooling.encoder import encoder_runner
from tessera.inference.worker.prepare import ServingPrep, serving_runner
from tessera.inference.worker.tensor_parallel.logits_mailbox import (
    open_mailbox,
    send_gathered,
    send_rows,
)

log = logging.getLogger("tessera.inference")

READY_TIMEOUT_S = 600.0  # loading a large shard from slow storage


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
