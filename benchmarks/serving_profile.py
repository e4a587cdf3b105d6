"""Where tessera-serve's time goes on the serving benchmark's workload (issue #18), as fractions.

Two measurements, both as ratios so that they mean something on a loaded machine too:

1. The engine step, in this process: an `LLMEngine` built as tessera-serve builds it (same
   checkpoint, same --max-num-seqs / --max-num-batched-tokens / KV pool) runs the workload (all
   requests at once, at most `--concurrency` running, greedy, ignore_eos), and each part of every
   step is timed by wrapping it: scheduling, input preparation, the model forward split into
   attention (KV write + paged attention) / LM head / the rest of the layers (GEMMs, norms, RoPE,
   SiLU), sampling, the output update (of which detokenization is timed on its own), and the
   engine process's share of the IPC (each step's outputs to JSON frames), plus the HTTP process's
   share (frames back to RequestOutputs) for comparison. A torch profiler pass over a few decode
   steps splits the forward by ATen op (`--torch-profile`).
2. The server (`--server`): tessera-serve is started as serving.py starts it and the same workload
   sent over HTTP/SSE; the CPU seconds of the HTTP process, the engine process and the client are
   read from /proc before and after, so the HTTP/SSE side's cost per engine-process CPU second is
   printed (on a quiet machine with free cores the HTTP process runs beside the engine, not in
   series with it).

3. Host vs device time of a decode step: after every prompt is prefilled, each decode step's
   scheduling, input preparation, forward call (on CUDA: the kernel launches or the graph replay)
   and the rest are timed on the host, and on CUDA the forward also on the device (CUDA events),
   eager and with CUDA graphs (`--device cuda`). The host time per step is the overhead graphs cut.

4. The client (`--client-ab ROUNDS`): the single-process httpx client the serving benchmarks used
   before serving_client.py against serving_client's processes, on one server, alternating: the
   client's CPU per output token, TPOT, ITL and output tok/s.

    .venv/bin/python benchmarks/serving_profile.py --preset llama-25m --concurrency 32 --output-len 64 64 --server
    python3 benchmarks/serving_profile.py --device cuda --preset llama-160m --concurrency 64 --num-requests 64
    .venv/bin/python benchmarks/serving_profile.py --client-ab 5 --preset host-bound --concurrency 64 --num-requests 512
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from serving import build_checkpoint, free_port, pct, run_client, wait_healthy
from serving_client import cpu_seconds, describe, single_process_client

TIMES: collections.Counter = collections.Counter()


def timed(name: str, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            TIMES[name] += time.perf_counter() - t
    return wrapper


def engine_profile(ckpt: Path, args, workload) -> None:
    from tessera.inference.config import EngineConfig
    from tessera.inference.core import detokenizer
    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.engine.wire import decode, encode, output_from_wire, output_to_wire, stats_to_wire
    from tessera.inference.worker.loader import load_for_serving

    cfg = EngineConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_tokens=65536, dtype="float32", device="cpu")
    engine = LLMEngine(load_for_serving(str(ckpt), torch.device("cpu"), torch.float32, None), cfg,
                       torch.device("cpu"), torch.float32)
    r = engine.runner
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    r.prepare = timed("prepare inputs", r.prepare)
    r._attention = timed("forward: attention (KV write + paged attention)", r._attention)
    # The layer stack as the runner calls it (compiled or eager; attention inside it), the head apart.
    r._hidden = timed("forward: layers", r._hidden)
    r.model.logits = timed("forward: LM head", r.model.logits)
    r.sampler = timed("sample", r.sampler)
    engine.processor.update = timed("output update", engine.processor.update)
    Detok = detokenizer.IncrementalDetokenizer
    Detok.append = timed("output update: detokenize", Detok.append)
    Detok.take_new_text = timed("output update: detokenize", Detok.take_new_text)

    def run(n_steps_cap: int | None = None) -> tuple[int, int, float]:
        for i, (prompt, n) in enumerate(workload):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        steps = tokens = 0
        t0 = time.perf_counter()
        while engine.has_unfinished() and (n_steps_cap is None or steps < n_steps_cap):
            t = time.perf_counter()
            outs = engine.step()
            TIMES["step (engine.step)"] += time.perf_counter() - t
            t = time.perf_counter()
            frame = encode({"t": "step", "outs": [output_to_wire(o) for o in outs], "failed": [],
                            "stats": stats_to_wire(engine.stats()), "adds_seen": len(workload)})
            TIMES["IPC: engine side (outputs -> JSON frame)"] += time.perf_counter() - t
            t = time.perf_counter()
            now = time.monotonic()
            _ = [output_from_wire(o, now) for o in decode(frame)["outs"]]
            TIMES["IPC: HTTP side (frame -> outputs; not in the engine process)"] += time.perf_counter() - t
            steps += 1
            tokens += sum(len(o.new_token_ids) for o in outs)
        return steps, tokens, time.perf_counter() - t0

    run()  # warm-up: the same workload once
    TIMES.clear()
    steps, tokens, wall = run()
    step = TIMES["step (engine.step)"] + TIMES["IPC: engine side (outputs -> JSON frame)"]
    print(f"engine, in process: {steps} steps, {tokens} tokens, {wall:.2f} s wall ({tokens / wall:.0f} tok/s here), "
          f"{1e3 * step / steps:.2f} ms per step (engine.step + its frame)")
    fw = TIMES["forward: layers"]
    rest = {
        "schedule": TIMES["schedule"],
        "prepare inputs": TIMES["prepare inputs"],
        "forward: attention (KV write + paged attention)": TIMES["forward: attention (KV write + paged attention)"],
        "forward: rest of the layers (GEMMs, norms, RoPE, SiLU, embedding)": fw - TIMES["forward: attention (KV write + paged attention)"],
        "forward: LM head": TIMES["forward: LM head"],
        "sample": TIMES["sample"],
        "output update: detokenize": TIMES["output update: detokenize"],
        "output update: the rest (append, stop checks, prefix-cache commit, finish)":
            TIMES["output update"] - TIMES["output update: detokenize"],
        "IPC: engine side (outputs -> JSON frame)": TIMES["IPC: engine side (outputs -> JSON frame)"],
    }
    rest["engine step, not in the parts above"] = step - sum(rest.values())
    print(f"{'part of an engine step':76s} {'share':>7s} {'ms/step':>8s}")
    for name, t in rest.items():
        print(f"{name:76s} {100 * t / step:6.1f}% {1e3 * t / steps:8.3f}")
    http = TIMES["IPC: HTTP side (frame -> outputs; not in the engine process)"]
    print(f"{'(IPC: HTTP side, frame -> outputs; in the other process)':76s} {100 * http / step:6.1f}% {1e3 * http / steps:8.3f}")

    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        for i, (prompt, n) in enumerate(workload):
            engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        while engine.scheduler.waiting or any(s.num_computed < len(s.prompt_ids) for s in engine.scheduler.running):
            engine.step()  # every prompt prefilled: the profiled steps are decode steps
        running = len(engine.scheduler.running)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.torch_profile):
                engine.step()
        while engine.has_unfinished():
            engine.step()
        print(f"torch profiler, {args.torch_profile} decode steps of {running} sequences:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def decode_step_profile(ckpt: Path, args, workload) -> None:
    """Host vs device time of a decode step (issue #18 item 2, issue #34 item 5): every prompt is
    prefilled first, then `--decode-steps` steps of each concurrency in `--decode-concurrency` (default:
    `--concurrency`) decoding sequences are timed part by part, each step's engine-process IPC frame
    (core_process.py's) included. On CUDA the forward is timed twice: on the host (the call returns
    once its kernels are queued or its graph is launched) and on the device (CUDA events around it),
    with a synchronize after it so the wait for the GPU is its own line; eager and CUDA-graph engines
    run back to back. On CPU the forward is the computation itself and the host part is everything
    else. Medians of the per-step sums are printed beside the means (a loaded machine's outliers)."""
    from tessera.inference.config import EngineConfig
    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.engine.wire import encode, output_to_wire, stats_to_wire
    from tessera.inference.worker import batch as batch_module
    from tessera.inference.worker import model_runner
    from tessera.inference.worker.loader import load_for_serving

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    loaded = load_for_serving(str(ckpt), device, dtype, None)
    modes = [("eager", True), ("CUDA graphs", False)] if cuda else [("eager", True)]
    model_runner.batch_seqs = timed("inputs: the plan as BatchSeqs", model_runner.batch_seqs)
    # The persistent decode batch (absent in older code: an A/B peer); since its split, its halves.
    for name in ("plan_update", "apply") if hasattr(batch_module, "DecodeUpdate") else ("inputs",):
        if hasattr(batch_module, "DecodeBatch"):
            setattr(batch_module.DecodeBatch, name,
                    timed("inputs: tensors (prepare)", getattr(batch_module.DecodeBatch, name)))
    forward_part = "forward call after its input preparation (CUDA: launches; CPU: compute)"
    stubs = [False, True] if args.stub_forward else [False]
    for conc, stub in ((c, st) for c in args.decode_concurrency or [args.concurrency] for st in stubs):
        for mode, eager in modes:
            cfg = EngineConfig(max_num_seqs=conc, max_num_batched_tokens=max(args.max_num_batched_tokens, conc),
                               kv_cache_tokens=max(65536, conc * 2048), dtype=str(dtype).removeprefix("torch."),
                               device=args.device, enforce_eager=eager, async_scheduling=args.async_scheduling)
            engine = LLMEngine(loaded, cfg, device, dtype)
            r, t = engine.runner, collections.Counter()
            r.prepare = timed("inputs: tensors (prepare)", r.prepare)
            if r.decode_graphs is not None:
                r.decode_graphs.prepare = timed("inputs: tensors (prepare)", r.decode_graphs.prepare)
                if hasattr(r.decode_graphs, "prepare_step"):  # fed from the persistent decode batch
                    r.decode_graphs.prepare_step = timed("inputs: tensors (prepare)", r.decode_graphs.prepare_step)
            if args.async_scheduling:
                r.sampler.sample_on_device = timed("sample", r.sampler.sample_on_device)
                engine.scheduler.schedule_ahead = timed("schedule", engine.scheduler.schedule_ahead)
            else:
                r.sampler = timed("sample", r.sampler)
            engine.processor.update = timed("output update (append, stops, detokenize, outputs)",
                                            engine.processor.update)
            engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)

            def forward(*a, inner, t=t):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                prep0 = TIMES["inputs: tensors (prepare)"]
                out = inner(*a)
                t1 = time.perf_counter()
                t[forward_part] += t1 - t0 - (TIMES["inputs: tensors (prepare)"] - prep0)
                if cuda:
                    end.record()
                    torch.cuda.synchronize()
                    t["wait for the GPU after the forward call"] += time.perf_counter() - t1
                    t["device: the forward on the GPU (CUDA events)"] += start.elapsed_time(end) / 1e3
                return out

            # The forward is the layer stack and head (`_logits`: eager, either input path) or a graph replay.
            if stub:  # host work alone: fixed logits rows in place of the forward (greedy picks their argmax)
                r._logits = partial(forward, inner=partial(stub_logits, torch.randn(
                    997, loaded.config.vocab_size, generator=torch.Generator().manual_seed(0)), [0]))
            else:
                r._logits = partial(forward, inner=r._logits)
            if r.decode_graphs is not None:
                r.decode_graphs.forward = partial(forward, inner=r.decode_graphs.forward)
                if hasattr(r.decode_graphs, "forward_step"):
                    r.decode_graphs.forward_step = partial(forward, inner=r.decode_graphs.forward_step)
            parts = ["schedule", "inputs: the plan as BatchSeqs", "inputs: tensors (prepare)", forward_part]
            if cuda:
                parts.append("wait for the GPU after the forward call")
            parts += ["sample", "output update (append, stops, detokenize, outputs)", "IPC frame (engine side)"]
            hosts: list[float] = []
            for rnd in range(2):  # the first round warms up (Triton compiles, allocator, caches)
                for i in range(conc):
                    prompt = workload[i % len(workload)][0]
                    # Room to decode while the later prompts prefill: every sequence still runs in the timed steps.
                    engine.add_request(f"d{rnd}-{i}", prompt, SamplingParams(max_tokens=args.decode_steps + 256,
                                                                              temperature=0, ignore_eos=True))
                while engine.scheduler.waiting or any(s.num_computed < len(s.prompt_ids) for s in engine.scheduler.running):
                    engine.step()
                running = len(engine.scheduler.running)
                TIMES.clear()
                t.clear()
                hosts.clear()
                steps, wall0 = 0, time.perf_counter()
                for _ in range(args.decode_steps):
                    before = TIMES["inputs: tensors (prepare)"], t[forward_part], t["wait for the GPU after the forward call"]
                    s0 = time.perf_counter()
                    outs = engine.step()
                    s1 = time.perf_counter()
                    encode({"t": "step", "outs": [output_to_wire(o) for o in outs], "failed": [],
                            "stats": stats_to_wire(engine.stats()), "adds_seen": 0})
                    s2 = time.perf_counter()
                    t["step (engine.step)"] += s1 - s0
                    t["IPC frame (engine side)"] += s2 - s1
                    off = (t["wait for the GPU after the forward call"] - before[2]) if cuda else (t[forward_part] - before[1])
                    hosts.append(s2 - s0 - off)
                    steps += 1
                wall = time.perf_counter() - wall0
                for rid in list(engine.requests):
                    engine.abort(rid)
            for name in parts[:-1]:
                if name in TIMES:
                    t[name] = TIMES[name]
            step = t["step (engine.step)"] + t["IPC frame (engine side)"]
            wait = t["wait for the GPU after the forward call"]
            t["rest of the step (execute's bookkeeping, stats, finishing)"] = step - sum(t[k] for k in parts)
            parts.append("rest of the step (execute's bookkeeping, stats, finishing)")
            replays = sum(r.decode_graphs.replays.values()) if r.decode_graphs is not None else 0
            mode_name = mode + (", forward stubbed (host work alone)" if stub else "")
            print(f"decode steps, {mode_name} ({args.device}, {str(dtype).removeprefix('torch.')}): {steps} steps of "
                  f"{running} sequences, {1e3 * wall / steps:.2f} ms per step"
                  + (f", {replays} graph replays" if replays else ""))
            for name in parts:
                print(f"  {name:76s} {1e3 * t[name] / steps:8.3f} ms")
            host = step - wait if cuda else step - t[forward_part]
            what = " (the step less the wait)" if cuda else " (the step less the forward)"
            print(f"  {'host time per decode step' + what:76s} {1e3 * host / steps:8.3f} ms "
                  f"(median {1e3 * statistics.median(hosts):.3f} ms)")
            if cuda:
                print(f"  {'device time per decode step (the forward, CUDA events)':76s} "
                      f"{1e3 * t['device: the forward on the GPU (CUDA events)'] / steps:8.3f} ms")
            engine.close()
            del engine


def stub_logits(bank: torch.Tensor, offset: list[int], step) -> torch.Tensor:
    """Logits rows for a step without computing them (`--stub-forward`): a moving window of `bank`."""
    n = step.tokens.shape[1] if step.logits_rows is None else step.logits_rows.shape[0]
    offset[0] = (offset[0] + 7) % (bank.shape[0] - n) if n < bank.shape[0] else 0
    return bank[offset[0]:offset[0] + n]


def compile_ab(ckpt: Path, args, workload) -> None:
    """Compiled vs eager CPU engine steps (issue #18; tessera.inference.worker.compiled): two engines, one
    with the inductor-compiled layer stack and one eager (oneDNN-packed weights), hold the same
    greedy requests and are stepped alternately (which goes first alternates too), so a loaded
    machine slows both alike; for each concurrency in `--compile-ab` the median of the per-step
    time ratios and the ratio of the medians over the decode steps (prefill steps are left out)."""
    from tessera.inference.config import EngineConfig
    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    cpu = torch.device("cpu")
    engines = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        cfg = EngineConfig(max_num_seqs=max(args.compile_ab), max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_cache_tokens=65536, dtype="float32", device="cpu", cpu_compile=compiled)
        t = time.perf_counter()
        engines[name] = LLMEngine(load_for_serving(str(ckpt), cpu, torch.float32, None), cfg, cpu, torch.float32)
        print(f"{name} engine built in {time.perf_counter() - t:.1f} s")
    if engines["compiled"].runner.compiled is None or engines["compiled"].compile_seconds <= 0:
        raise SystemExit("the compiled engine did not compile its layer stack (see the warning above); nothing to A/B")
    for conc in args.compile_ab:
        for engine in engines.values():
            for i, (prompt, _) in enumerate(workload[:conc]):
                engine.add_request(f"{conc}-{i}", prompt, SamplingParams(max_tokens=args.output_len[1],
                                                                          temperature=0, ignore_eos=True))
        times: dict[str, list[float]] = {name: [] for name in engines}
        step = 0
        while any(e.has_unfinished() for e in engines.values()):
            decode = all(not e.scheduler.waiting and all(s.num_computed >= len(s.prompt_ids) for s in e.scheduler.running)
                         for e in engines.values())
            order = list(engines.items()) if step % 2 else list(engines.items())[::-1]
            took = {}
            for name, engine in order:
                t = time.perf_counter()
                engine.step()
                took[name] = time.perf_counter() - t
            if decode:
                for name in engines:
                    times[name].append(took[name])
            step += 1
        eager, comp = times["eager"], times["compiled"]
        ratios = [c / e for c, e in zip(comp, eager)]
        if len(ratios) < 2:
            print(f"concurrency {conc}: {len(ratios)} decode steps, too few to compare; raise --output-len")
            continue
        q = statistics.quantiles(ratios, n=4)
        print(f"concurrency {conc}: {len(eager)} decode steps; eager median {1e3 * statistics.median(eager):.2f} ms, "
              f"compiled {1e3 * statistics.median(comp):.2f} ms; compiled/eager: ratio of medians "
              f"{statistics.median(comp) / statistics.median(eager):.3f}, median of per-step ratios "
              f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")


def start_server(ckpt: Path, args) -> tuple[subprocess.Popen, str, int]:
    """tessera-serve as serving.py starts it; (process, URL, engine process id) once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "tessera.inference", "--checkpoint", str(ckpt), "--port", str(port), "--quiet",
           "--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--kv-cache-tokens", "65536", "--torch-threads", str(args.threads), "--device", "cpu", "--dtype", "float32"]
    server = subprocess.Popen(cmd, start_new_session=True)  # not in the client's session (serving.py says why)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, 300, "tessera-serve")  # the CPU compile at start (compiled.py)
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.pid)], capture_output=True, text=True)
        return server, url, int(children.stdout.split()[0])
    except BaseException:
        server.terminate()
        server.wait(timeout=60)
        raise


def server_profile(ckpt: Path, args, workload) -> None:
    server, url, engine_pid = start_server(ckpt, args)
    try:
        asyncio.run(run_client(url, workload[:4], 4))
        pids = {"HTTP process (FastAPI, SSE, tokenizer, frames -> outputs)": server.pid, "engine process": engine_pid}
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        res = asyncio.run(run_client(url, workload, args.concurrency, processes=args.client_processes))
        after = {k: cpu_seconds(p) for k, p in pids.items()}
        used = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in pids}
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"server: {res['output_tok_per_s']:.0f} output tok/s here, {res['duration']:.2f} s, TPOT p50 "
          f"{1e3 * statistics.median(res['tpot']):.1f} ms")
    eng = sum(used["engine process"])
    tokens = res["output_tok_per_s"] * res["duration"]
    for k, (user, system) in used.items():
        v = user + system
        print(f"  CPU s {k:58s} {v:7.2f}  ({v / eng:.2f} per engine-process CPU s; {1e3 * v / tokens * args.concurrency:.2f} "
              f"ms per {args.concurrency} output tokens, a decode step's: user {1e3 * user / tokens * args.concurrency:.2f}, "
              f"system {1e3 * system / tokens * args.concurrency:.2f})")
    client = sum(res["client"]["cpu_s"])
    print(f"  CPU s {'benchmark client (all its processes)':58s} {client:7.2f}  ({client / eng:.2f} per engine-process CPU s)")
    print(f"  {describe(res['client'])}")


def client_ab(ckpt: Path, args, workload) -> None:
    """The single-process client against serving_client's (`--client-processes`, default as serving.py's)
    on one server, alternating which goes first, `--client-ab` rounds: client CPU per output token,
    TPOT p50, ITL p50/p99, output tok/s and the HTTP process's CPU per output token."""
    server, url, _ = start_server(ckpt, args)
    rows: dict[str, list[dict]] = {"single process (httpx lines)": [], "serving_client": []}
    try:
        asyncio.run(run_client(url, workload[:args.concurrency], args.concurrency))  # warm-up
        for r in range(args.client_ab):
            for name in list(rows) if r % 2 == 0 else list(rows)[::-1]:
                http0 = sum(cpu_seconds(server.pid))
                if name == "serving_client":
                    res = asyncio.run(run_client(url, workload, args.concurrency, processes=args.client_processes))
                else:
                    res = asyncio.run(single_process_client(url, workload, args.concurrency))
                c, tokens = res["client"], sum(res["completion_tokens"])
                row = {"cpu_us": c["cpu_us_per_token"], "tpot": 1e3 * statistics.median(res["tpot"]),
                       "itl50": 1e3 * statistics.median(res["itl"]), "itl99": 1e3 * pct(res["itl"], 99),
                       "tok_s": res["output_tok_per_s"], "busiest": max(a / b for a, b in zip(c["cpu_s"], c["wall_s"])),
                       "http_us": 1e6 * (sum(cpu_seconds(server.pid)) - http0) / tokens}
                rows[name].append(row)
                print(f"round {r + 1} {name:30s} client CPU {row['cpu_us']:6.1f} us/token (busiest process "
                      f"{100 * row['busiest']:3.0f}%), TPOT p50 {row['tpot']:5.2f} ms, ITL p50 {row['itl50']:5.2f} "
                      f"p99 {row['itl99']:6.2f} ms, {row['tok_s']:7.0f} output tok/s, HTTP process "
                      f"{row['http_us']:5.1f} us/token" + (f" ({describe(res['client'])})" if "processes" in c else ""),
                      flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    for name, rs in rows.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        print(f"median {name:30s} client CPU {med['cpu_us']:6.1f} us/token, TPOT p50 {med['tpot']:5.2f} ms, ITL p50 "
              f"{med['itl50']:5.2f} p99 {med['itl99']:6.2f} ms, {med['tok_s']:7.0f} output tok/s, HTTP process "
              f"{med['http_us']:5.1f} us/token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["llama-20m", "llama-25m", "llama-160m", "llama-1b", "host-bound"],
                    default="llama-25m", help="host-bound: one layer of width 64, whose forward takes a small part "
                    "of a CPU step, as a GPU's does: the step is host work")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--output-len", type=int, nargs=2, default=[64, 64])
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-profile", type=int, default=0, metavar="STEPS",
                    help="also run the torch profiler over this many decode steps and print its op table")
    ap.add_argument("--server", action="store_true", help="also measure the server's processes (HTTP/SSE side)")
    ap.add_argument("--server-only", action="store_true", help="only the server measurement (implies --server)")
    ap.add_argument("--client-processes", type=int, default=None, metavar="P",
                    help="the benchmark client's processes (default as serving.py's: benchmarks/serving_client.py)")
    ap.add_argument("--client-ab", type=int, default=0, metavar="ROUNDS",
                    help="only compare the single-process client (before serving_client.py) with serving_client's "
                         "on one server, alternating, this many rounds")
    ap.add_argument("--device", default="cpu",
                    help="cpu or cuda for the decode-step profile (on cuda, eager and CUDA graphs back to back; the "
                         "engine-step and server profiles run on CPU only)")
    ap.add_argument("--decode-steps", type=int, default=32, help="decode steps timed by the decode-step profile")
    ap.add_argument("--decode-concurrency", type=int, nargs="+", default=None, metavar="SEQS",
                    help="decoding sequences of the decode-step profile, e.g. 8 64 256 (default: --concurrency)")
    ap.add_argument("--stub-forward", action="store_true",
                    help="also run each decode-step profile with the forward replaced by fixed logits: host work alone")
    ap.add_argument("--decode-only", action="store_true", help="only the decode-step profile (and --server)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="decode-step profile with async scheduling (each step launched before the one in flight "
                         "is applied; its planning counts as schedule, its device-side sampling as sample)")
    ap.add_argument("--compile-ab", type=int, nargs="+", default=None, metavar="CONCURRENCY",
                    help="only compare compiled and eager CPU engine steps at these concurrencies, e.g. 8 32 64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="tessera-profile-")) / "run"
    if args.preset == "host-bound":
        from tessera.common.models.causal_lm.config import ModelConfig

        ckpt, model = build_checkpoint(root, args.preset, lambda vocab: ModelConfig(
            arch="llama", vocab_size=vocab, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
            ffn_hidden_size=128, max_seq_len=1024))
    else:
        ckpt, model = build_checkpoint(root, args.preset)
    vocab = model.cfg.vocab_size
    workload = [([rng.randrange(1, vocab) for _ in range(rng.randint(*args.input_len))], rng.randint(*args.output_len))
                for _ in range(args.num_requests)]
    print(f"model {args.preset}, {args.num_requests} requests, concurrency {args.concurrency}, input {args.input_len}, "
          f"output {args.output_len}, torch threads {args.threads}")
    if args.client_processes is not None and args.client_processes < 1:
        ap.error("--client-processes: must be at least 1")
    if args.server_only:
        server_profile(ckpt, args, workload)
        return
    if args.client_ab:
        client_ab(ckpt, args, workload)
        return
    if args.compile_ab:
        compile_ab(ckpt, args, workload)
        return
    if args.device == "cpu" and not args.decode_only:
        engine_profile(ckpt, args, workload)
    decode_step_profile(ckpt, args, workload)
    if args.server and args.device == "cpu":
        server_profile(ckpt, args, workload)


if __name__ == "__main__":
    main()
