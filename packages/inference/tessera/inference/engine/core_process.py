"""The engine process (`python -m tessera.inference.engine.core_process FD [FD ...]`): loads the model,
then steps `LLMEngine` in a loop, reading requests from and writing each step's outputs to one pipe
(an inherited socket) per HTTP process: one by default, N under `tessera-serve --api-server-count N`
(entrypoints/api_servers.py). The first pipe carries the init and ready messages. See wire.py for
the messages.

With several pipes the engine remembers which pipe added each request and sends that request's
outputs and failures only there; every pipe gets every step's stats and its own count of adds seen
(its HTTP process's queue limit reads both). A pipe's "stop" ends only that pipe (its requests are
aborted); the loop ends when every pipe has stopped. A pipe that closes without "stop" means its
HTTP process died: the engine exits, and the launcher stops the rest of the server (as vLLM does
when one API server dies).

Why a process: in the server process the engine thread and the asyncio event loop take turns
on one GIL, and every torch op the engine runs gives the loop a chance to keep it; here the
engine has an interpreter to itself (vLLM V1 splits its server the same way).

It ignores SIGINT/SIGTERM: the HTTP processes decide when to stop (after draining) and say so.
If the process that started it (the HTTP process, or the launcher of several) dies, this one is
killed with it (PR_SET_PDEATHSIG, and so are its tensor-parallel workers, by theirs), even while it
loads the model and reads no pipe.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import sys
import traceback
from multiprocessing.connection import Connection, wait

from tessera.common.errors import UserError
from tessera.inference.engine.gc_heap import freeze_heap
from tessera.inference.engine.wire import decode, encode, output_to_wire, stats_to_wire
from tessera.inference.worker.cpu_threads import measure
from tessera.inference.worker.tensor_parallel.worker import die_with_parent

log = logging.getLogger("tessera.inference")


def _load(init: dict):
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.cpu_threads import ThreadPlan, apply_binding
    from tessera.inference.worker.loader import load_for_serving, resolve_device, resolve_dtype

    plan = ThreadPlan.from_wire(init["threads"]) if init.get("threads") else None
    if plan is not None:  # first: torch's thread pool must start on these CPUs
        apply_binding(plan.engine)
    cfg = EngineConfig.model_validate(init["engine"])
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    loaded = load_for_serving(init["checkpoint"], device, dtype, cfg.quantization, cfg.tensor_parallel,
                              kv_cache_dtype=cfg.kv_cache_dtype, skip_checksum_verify=cfg.skip_checksum_verify,
                              generation_config=cfg.generation_config)
    workers = plan.workers if plan is not None and plan.workers else None
    return LLMEngine(loaded, cfg, device, dtype, workers), device, dtype


def serve(conns: list[Connection]) -> int:
    conn = conns[0]
    init = decode(conn.recv_bytes())
    try:
        engine, device, dtype = _load(init)
    except UserError as exc:
        conn.send_bytes(encode({"t": "error", "user": True, "message": str(exc)}))
        return 2
    except Exception as exc:
        traceback.print_exc()
        conn.send_bytes(encode({"t": "error", "user": False, "message": f"{type(exc).__name__}: {exc}"}))
        return 1
    loaded = engine.loaded
    conn.send_bytes(encode({
        "t": "ready", "name": loaded.name, "arch": loaded.config.arch, "dtype": str(dtype), "device": str(device),
        "max_model_len": engine.max_model_len, "vocab_size": loaded.config.vocab_size,
        "eos_ids": sorted(engine.eos_ids), "num_blocks": engine.blocks.num_blocks,
        "state_pool": engine.runner.state_summary(),
        "tokenizer_dir": str(loaded.tokenizer.directory), "compile_s": engine.compile_seconds,
        "threads": measure(engine), "pooling": None if engine.pooling is None else engine.pooling.to_wire(),
        "generates": engine.generates, "scores_prompts": engine.scores_prompts, "vision": engine.vision,
        "generation_defaults": engine.generation_defaults.to_wire(),
    }))
    freeze_heap()  # the model and everything loaded with it: no collection walks them again
    try:
        _loop(conns, engine)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # an HTTP process went away: the server is ending (one process) or failed (several)
    except Exception as exc:  # a bug or an OOM: tell the HTTP processes so they fail requests, not hang them
        traceback.print_exc()
        for c in conns:
            try:
                c.send_bytes(encode({"t": "failed", "message": f"{type(exc).__name__}: {exc}"}))
            except OSError:
                pass
        return 1
    finally:
        engine.close()  # stops tensor-parallel workers
    return 0


def _loop(conns: list[Connection], engine) -> None:
    """The shared engine loop (loop.py) with these pipes as its inbox and outbox."""
    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.engine.loop import run_engine_loop

    open_conns = list(range(len(conns)))  # pipes not yet stopped, by index
    routed = len(conns) > 1  # one pipe: every request is its own, nothing to remember
    owner: dict[str, int] = {}  # request id -> the pipe that added it (several pipes)
    adds_seen = [0] * len(conns)  # adds read from each pipe: all taken by the loop before its next emit

    def receive(block: bool) -> list[tuple]:
        ready = wait([conns[i] for i in open_conns]) if block else []
        commands: list[tuple] = []
        for i in list(open_conns):
            conn = conns[i]
            frames = [conn.recv_bytes()] if conn in ready else []
            while conn.poll():
                frames.append(conn.recv_bytes())
            for frame in frames:
                msg = decode(frame)
                if msg["t"] == "add":
                    adds_seen[i] += 1
                    if routed:
                        owner[msg["id"]] = i
                    commands.append(("add", msg["id"], msg["prompt"], SamplingParams.model_validate(msg["params"])))
                elif msg["t"] == "abort":
                    # Only the pipe that added a request aborts it; another pipe's abort of it (ids are
                    # tagged per HTTP process, so a bug) is ignored and must not unroute its outputs.
                    mine = [rid for rid in msg["ids"] if not routed or owner.get(rid) == i]
                    for rid in mine if routed else ():
                        del owner[rid]
                    commands.extend(("abort", rid) for rid in mine)
                elif msg["t"] == "stop":  # this HTTP process has drained: end its requests, stop reading it
                    theirs = [rid for rid, o in owner.items() if o == i]
                    for rid in theirs:
                        del owner[rid]
                    commands.extend(("abort", rid) for rid in theirs)
                    open_conns.remove(i)
                    conn.close()  # its reader sees the end now, not when the last pipe stops
                    break
        if not open_conns:
            commands.append(("stop",))
        return commands

    def emit(outputs, failed, stats, num_adds) -> None:
        wire_stats = stats_to_wire(stats)
        if len(conns) == 1:  # one HTTP process: everything is its own (no routing to pay for)
            per_conn = {0: ([output_to_wire(o) for o in outputs], [list(f) for f in failed])}
        else:
            per_conn = {i: ([], []) for i in open_conns}
            for o in outputs:
                i = owner.pop(o.request_id, None) if o.finished else owner.get(o.request_id)
                if i in per_conn:
                    per_conn[i][0].append(output_to_wire(o))
            for rid, message in failed:
                i = owner.pop(rid, None)
                if i in per_conn:
                    per_conn[i][1].append([rid, message])
        for i, (outs, fails) in per_conn.items():
            conns[i].send_bytes(encode({"t": "step", "outs": outs, "failed": fails, "stats": wire_stats,
                                        "adds_seen": adds_seen[i]}))

    run_engine_loop(engine, receive, emit)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_parent(_peer_pid(int(argv[0])))
    conns = [Connection(int(fd)) for fd in argv]
    try:
        return serve(conns)
    finally:
        for conn in conns:
            conn.close()


def _peer_pid(fd: int) -> int:
    """The pid of the process that made the socket pair `fd` belongs to: the HTTP process (or the
    launcher of several, api_servers.py)."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]


if __name__ == "__main__":
    sys.exit(main())
