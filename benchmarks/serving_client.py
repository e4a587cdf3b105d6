"""The serving benchmarks' client: streams the workload over P client processes, so the client is
not what a run measures.

One Python process reading 64 SSE streams costs CPU per streamed token, and once that process is
behind, chunks arrive in bursts (ITL median 0) and TPOT is the client's. So `run_client` execs P
worker processes of this file (not forked, not multiprocessing's spawn: the caller may hold CUDA,
and spawn would re-run the caller's script, torch and all, in every worker), each with its share of
the requests (request i goes to worker i % P) and of the concurrency, on its own event loop
(uvloop when importable), all starting at one CLOCK_MONOTONIC instant the parent hands out once
every worker is ready. Each worker returns its raw figures per request, the parent merges them in
workload order, and each worker's CPU seconds (getrusage) and wall time come back with them. Each
worker holds its own share of the concurrency: with unequal output lengths the total in flight can
dip under `concurrency` near the end, when one worker has run out of requests before another.

HTTP: aiohttp when importable (its C parser: 22-26 us of client CPU per streamed token against httpx's
110-170 us on the 2-core box, benchmarks/RESULTS.md), else httpx's raw byte stream. Either way an SSE
event is classified on its bytes: one that holds `"choices": [{` (tessera-serve's spacing) or
`"choices":[{` (compact, vLLM's) carries choices. Inside a JSON string every quote is escaped, so the
quote after `choices` would be `\"` there: those bytes can only be a key. Any other `data: {` event
(the usage chunk, an error, a server that spells the key otherwise) is parsed as JSON.

    python benchmarks/serving_client.py --worker    # what run_client starts; reads its share on stdin
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import resource
import sys
import tempfile
import time

# One clock for every process: the start instant crosses process boundaries.
CLOCK = time.CLOCK_MONOTONIC
CHOICE_MARKS = (b'"choices": [{', b'"choices":[{')  # tessera-serve's spacing, then compact JSON (vLLM's)
BUSY = 0.8  # a worker busier than this share of its wall time may be what the run measures


def now() -> float:
    return time.clock_gettime(CLOCK)


def default_processes(concurrency: int) -> int:
    """At most 8 streams per client process, and no more processes than half the CPUs (the server
    needs the rest), at least 1."""
    return max(1, min(math.ceil(concurrency / 8), len(os.sched_getaffinity(0)) // 2))


def split(requests: int, concurrency: int, processes: int) -> list[tuple[list[int], int]]:
    """Each process's request indices (request i goes to process i % P) and its share of the
    concurrency (as even as possible; the shares add up to `concurrency`)."""
    return [(list(range(k, requests, processes)), concurrency // processes + (k < concurrency % processes))
            for k in range(processes)]


def http_library(wanted: str | None = None) -> str:
    """"aiohttp <version>" when importable (or "httpx <version>" when `wanted` says httpx or aiohttp is absent)."""
    if wanted not in (None, "aiohttp", "httpx"):
        raise ValueError(f"http: {wanted!r} is not aiohttp or httpx")
    if wanted != "httpx":
        try:
            import aiohttp
            return f"aiohttp {aiohttp.__version__}"
        except ImportError:
            if wanted == "aiohttp":
                raise
    import httpx
    return f"httpx {httpx.__version__}"


def event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
        return "uvloop"
    except ImportError:
        return "asyncio"


class SseCounter:
    """One stream's SSE events (separated by a blank line, as tessera-serve and vLLM write them): the
    time each chunk with choices arrived and the usage chunk's completion_tokens."""

    __slots__ = ("rest", "times", "completion")

    def __init__(self):
        self.rest, self.times, self.completion = b"", [], 0

    def feed(self, data: bytes, at: float) -> None:
        events = (self.rest + data).split(b"\n\n")
        self.rest = events.pop()  # an event not complete yet
        for event in events:
            if CHOICE_MARKS[0] in event or CHOICE_MARKS[1] in event:
                self.times.append(at)
            elif event.startswith(b"data: {"):  # the rare event: parsed
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    raise RuntimeError(f"the server sent an error event: {chunk['error']}")
                if chunk.get("choices"):
                    self.times.append(at)
                elif chunk.get("usage"):
                    self.completion = chunk["usage"]["completion_tokens"]


async def _stream_aiohttp(session, url: str, body: dict, sse: SseCounter) -> None:
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for data in r.content.iter_any():
            sse.feed(data, now())


async def _stream_httpx(client, url: str, body: dict, sse: SseCounter) -> None:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for data in r.aiter_raw():
            sse.feed(data, now())


async def _worker_run(spec: dict, start_line) -> dict:
    """Run this worker's share; `start_line` waits for the parent's start instant."""
    url = spec["url"] + "/v1/completions"
    sem = asyncio.Semaphore(spec["concurrency"])
    records = []

    async def one(index: int, prompt, n_out: int, arrival: float) -> None:
        await asyncio.sleep(max(0.0, start + arrival - now()))
        async with sem:
            body = {"prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, **spec["extra_body"]}
            sse = SseCounter()
            t0 = now()
            try:
                await stream(session, url, body, sse)
            except Exception as exc:
                raise RuntimeError(f"request {index}: {exc}") from exc
            end = now()
            if not sse.times:
                raise RuntimeError(f"request {index}: the stream ended without a chunk that carries choices")
            # one chunk per token here except held-back partial characters; usage counts tokens exactly
            times, generated = sse.times, sse.completion
            records.append([index, times[0] - t0, end - t0,
                            (end - times[0]) / (generated - 1) if generated > 1 else None, generated,
                            [b - a for a, b in zip(times, times[1:])]])

    if http_library(spec["http"]).startswith("aiohttp"):
        import aiohttp
        stream = _stream_aiohttp
        # 600 s without a byte, as httpx's timeout=600 means; no limit on a whole request (a slow CPU peer)
        opened = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=600, sock_read=600),
                                       connector=aiohttp.TCPConnector(limit=spec["concurrency"]))
    else:
        import httpx
        stream = _stream_httpx
        opened = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=spec["concurrency"]))
    async with opened as session:
        print("ready", flush=True)
        start = float(await start_line())
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.gather(*(one(*r) for r in spec["requests"]))
        end = now()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"records": records, "end": end, "cpu_s": cpu, "wall_s": end - start}


def worker_main() -> int:
    spec = json.loads(sys.stdin.readline())
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(_worker_run(spec, lambda: loop.run_in_executor(None, sys.stdin.readline)))
    finally:
        loop.close()
    # A file, not the stdout pipe: a result line of ~1 MB came back cut at 128 KiB once (exit code 0)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0


async def run_client(url: str, workload, concurrency: int, arrivals: list[float] | None = None,
                     extra_body: dict | None = None, processes: int | None = None, http: str | None = None) -> dict:
    """Send every request of `workload` ((prompt, max_tokens) pairs), at most `concurrency` in flight
    in all, over `processes` client processes (default: `default_processes`); with `arrivals`
    (seconds from the start, one per request) a request is not sent before its arrival time. Output
    tokens are counted from each request's usage (`completion_tokens`, in workload order); ttft, e2e
    and itl are in workload order too. `client` holds each process's CPU seconds and wall time.
    `http`: "aiohttp" or "httpx" (default: aiohttp when importable)."""
    http_library(http)  # a name it does not know fails here, before any process starts
    n = len(workload)
    procs = max(1, min(processes or default_processes(concurrency), concurrency, n))
    offsets = arrivals or [0.0] * n
    workers = []
    outdir = tempfile.TemporaryDirectory(prefix="serving-client-")
    try:
        for k, (indices, share_concurrency) in enumerate(split(n, concurrency, procs)):
            share = {"url": url, "extra_body": extra_body or {}, "concurrency": share_concurrency, "http": http,
                     "requests": [[i, *workload[i], offsets[i]] for i in indices],
                     "out": os.path.join(outdir.name, f"worker{k}.json")}
            w = await asyncio.create_subprocess_exec(
                sys.executable, os.path.abspath(__file__), "--worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE)
            workers.append(w)
            w.stdin.write(json.dumps(share).encode() + b"\n")
            await w.stdin.drain()
        for k, w in enumerate(workers):
            if (await w.stdout.readline()).strip() != b"ready":
                raise RuntimeError(f"client process {k} did not start (exit code {await w.wait()}; its stderr above)")
        start = now() + 0.01
        for w in workers:
            w.stdin.write(f"{start!r}\n".encode())
            await w.stdin.drain()
        results = []
        for k, w in enumerate(workers):
            if await w.wait() != 0:
                raise RuntimeError(f"client process {k} failed (exit code {w.returncode}; its stderr above)")
            with open(os.path.join(outdir.name, f"worker{k}.json")) as f:
                results.append(json.load(f))
    finally:
        for w in workers:
            if w.returncode is None:
                w.kill()
                await w.wait()
        outdir.cleanup()
    records = sorted((r for res in results for r in res["records"]), key=lambda r: r[0])
    dur = max(res["end"] for res in results) - start
    completion = [r[4] for r in records]
    cpu = [res["cpu_s"] for res in results]
    wall = [res["wall_s"] for res in results]
    busiest = max(c / w for c, w in zip(cpu, wall))
    tokens = sum(completion)
    client = {"processes": procs, "http": http_library(http), "loop": event_loop_name(), "cpu_s": cpu, "wall_s": wall,
              "cpu_us_per_token": 1e6 * sum(cpu) / tokens if tokens else float("nan"),
              "busiest_utilisation": busiest, "client_bound": busiest > BUSY}
    return {"duration": dur, "requests_per_s": n / dur, "output_tok_per_s": tokens / dur,
            "ttft": [r[1] for r in records], "itl": [x for r in records for x in r[5]],
            "tpot": [r[3] for r in records if r[3] is not None], "e2e": [r[2] for r in records],
            "completion_tokens": completion, "client": client}


async def single_process_client(url: str, workload, concurrency: int) -> dict:
    """The serving benchmarks' client before this file, kept as the baseline of serving_profile.py's
    `--client-ab`: every stream in the caller's process on its loop through one httpx client, a line
    iterator and a json.loads per chunk. Returns run_client's figures (not its order), CPU from getrusage."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    ttft, itl, tpot, completion = [], [], [], []

    async def one(client, prompt, n_out):
        async with sem:
            t0, times, generated = time.perf_counter(), [], 0
            body = {"prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"]:
                            times.append(time.perf_counter())
                        elif chunk.get("usage"):
                            generated = chunk["usage"]["completion_tokens"]
            end = time.perf_counter()
            ttft.append(times[0] - t0)
            itl.extend(b - a for a, b in zip(times, times[1:]))
            if generated > 1:
                tpot.append((end - times[0]) / (generated - 1))
            completion.append(generated)

    async with httpx.AsyncClient(timeout=600) as client:
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        await asyncio.gather(*(one(client, p, n) for p, n in workload))
        dur, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    return {"duration": dur, "output_tok_per_s": sum(completion) / dur, "ttft": ttft, "itl": itl, "tpot": tpot,
            "completion_tokens": completion, "client": {"cpu_s": [cpu], "wall_s": [dur],
                                                        "cpu_us_per_token": 1e6 * cpu / sum(completion)}}


def describe(client: dict) -> str:
    """One line on the client's own cost, and a warning when a worker may have been the bottleneck."""
    line = (f"client: {client['processes']} process(es) ({client['http']}, {client['loop']}), CPU per output token "
            f"{client['cpu_us_per_token']:.1f} us, busiest process {100 * client['busiest_utilisation']:.0f}% of its wall")
    if client["client_bound"]:
        line += (f"\nwarning: a client process was busy more than {100 * BUSY:.0f}% of its wall time: the run may be "
                 f"client-bound (TPOT/ITL may be the client's, not the server's); raise --client-processes")
    return line



# ---- the server's side of a run: which of its processes was busy -------------------------------
def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process `pid` so far (/proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> dict[int, str]:
    """`pid` (tessera-serve's HTTP process) and its descendants, each named by its role, from its
    command line: HTTP process (the root; under --api-server-count N the launcher, and its N HTTP
    processes, entrypoints/api_server_process.py), engine process, tokenizer process, tensor-parallel worker
    (executor.py's, started by multiprocessing's spawn: children of the engine process, or of the
    HTTP process with --no-engine-process); any other process (a grammar check, multiprocessing's
    resource tracker) is named as its parent, whose helper it is."""
    tree, todo, launcher = {}, [(pid, "")], False
    while todo:
        p, parent = todo.pop()
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
            children = [int(c) for task in os.listdir(f"/proc/{p}/task")
                        for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except OSError:  # gone meanwhile
            continue
        role = ("HTTP process" if p == pid or "entrypoints.api_server_process" in cmd else "engine process"
                if "core_process" in cmd else "tokenizer process" if "tokenizer_process" in cmd
                else "tensor-parallel worker" if "--multiprocessing-fork" in cmd else parent)
        tree[p] = role
        todo += [(c, role) for c in children]
        launcher |= p != pid and "entrypoints.api_server_process" in cmd
    if launcher:  # --api-server-count N: the root serves nothing
        tree[pid] = "launcher"
    return tree


class ServerCpu:
    """Each server process's CPU over a measured run: `start()` before it, `stop()` after. A process
    near 100% of one core is what bounds TPOT (with one HTTP process, typically that one)."""

    def __init__(self, pid: int):
        self.pid = pid

    def start(self) -> None:
        self.tree = process_tree(self.pid)
        self.before = {p: sum(cpu_seconds(p)) for p in self.tree}
        self.t0 = time.perf_counter()

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        used = {}
        for p, name in self.tree.items():
            try:
                used[p] = (name, (sum(cpu_seconds(p)) - self.before[p]) / wall)
            except OSError:
                continue
        busiest = max(used.values(), key=lambda x: x[1], default=("-", 0.0))
        return {"wall": wall, "processes": [{"pid": p, "role": n, "utilisation": u} for p, (n, u) in used.items()],
                "busiest_role": busiest[0], "busiest_utilisation": busiest[1]}


def describe_server(server: dict) -> str:
    """One line: each server process's share of a core over the run, the busiest named."""
    parts = ", ".join(f"{p['role']} {100 * p['utilisation']:.0f}%" for p in server["processes"])
    return (f"server CPU (share of one core over the run): {parts}; busiest: {server['busiest_role']} "
            f"{100 * server['busiest_utilisation']:.0f}%")

if __name__ == "__main__":
    if sys.argv[1:] != ["--worker"]:
        raise SystemExit("serving_client.py: run by run_client as `serving_client.py --worker` (its share on stdin)")
    sys.exit(worker_main())
