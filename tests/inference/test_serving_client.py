"""benchmarks/serving_client.py, the serving benchmarks' client: streamed over P processes against a
live tiny server, its merged figures match one process's request for request (in workload order),
and each process's CPU and wall time come back; its SSE reading is checked byte by byte."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_server import LiveServer

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_client.py"


@pytest.fixture(scope="module")
def client():
    spec = importlib.util.spec_from_file_location("bench_serving_client", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_requests_and_the_concurrency_are_shared_out_whole(client):
    shares = client.split(11, 7, 3)
    assert [idx for idx, _ in shares] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert [c for _, c in shares] == [3, 2, 2]  # adds up to 7, none more than one apart
    assert client.default_processes(1) == 1


def test_p_processes_give_what_one_gives_request_for_request(client, tiny_ckpt):
    # 10 requests of different lengths: a merge out of workload order shows in completion_tokens
    workload = [([(7 * i + j) % 500 + 1 for j in range(4 + i % 5)], 3 + (i * 5) % 9) for i in range(10)]
    server = LiveServer(tiny_ckpt, max_num_seqs=8, num_kv_blocks=200, block_size=4)
    try:
        one = asyncio.run(client.run_client(server.url, workload, 4, processes=1))
        two = asyncio.run(client.run_client(server.url, workload, 4, processes=2))
        plain = asyncio.run(client.run_client(server.url, workload, 4, processes=3, http="httpx"))
        with pytest.raises(RuntimeError, match="client process 1 failed"):  # a 400 (max_tokens over 100)
            asyncio.run(client.run_client(server.url, [workload[0], (workload[1][0], 1000)], 2, processes=2))
    finally:
        server.stop()
    wanted = [n for _, n in workload]
    for res, procs in ((one, 1), (two, 2), (plain, 3)):
        assert res["completion_tokens"] == wanted  # ignore_eos: exactly max_tokens, in workload order
        assert len(res["ttft"]) == len(res["e2e"]) == len(workload)
        assert all(0 < t <= e for t, e in zip(res["ttft"], res["e2e"]))  # per request, in the same order
        assert len(res["tpot"]) == sum(n > 1 for n in wanted)
        assert len(res["itl"]) <= sum(n - 1 for n in wanted)  # one per chunk after the first
        assert res["output_tok_per_s"] == pytest.approx(sum(wanted) / res["duration"])
        c = res["client"]
        assert c["processes"] == procs and len(c["cpu_s"]) == len(c["wall_s"]) == procs
        assert all(cpu > 0 for cpu in c["cpu_s"]) and all(0 < w <= res["duration"] * 1.01 for w in c["wall_s"])
        assert c["cpu_us_per_token"] == pytest.approx(1e6 * sum(c["cpu_s"]) / sum(wanted))
        busiest = max(cpu / wall for cpu, wall in zip(c["cpu_s"], c["wall_s"]))
        assert c["busiest_utilisation"] == pytest.approx(busiest) and c["client_bound"] == (busiest > 0.8)
    assert one["client"]["http"].startswith("aiohttp") and plain["client"]["http"].startswith("httpx")


def test_a_client_process_busy_over_80_percent_is_called_out(client):
    figures = {"processes": 2, "http": "aiohttp 3", "loop": "uvloop", "cpu_us_per_token": 20.0}
    calm = client.describe({**figures, "busiest_utilisation": 0.5, "client_bound": False})
    busy = client.describe({**figures, "busiest_utilisation": 0.9, "client_bound": True})
    assert "busiest process 50% of its wall" in calm and "client-bound" not in calm
    assert busy.splitlines()[1].startswith("warning:") and "client-bound" in busy


def _event(obj: dict, separators=None) -> bytes:
    return b"data: " + json.dumps(obj, separators=separators).encode() + b"\n\n"


# tessera-serve's spacing, compact (vLLM's), and a spelling the byte check does not know (parsed)
@pytest.mark.parametrize("separators", [None, (",", ":"), (",", " : ")], ids=["tessera", "compact", "other"])
def test_sse_events_are_counted_wherever_the_reads_split_them(client, separators):
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1,
            "model": 'a "choices": [{"x "choices":[{'}  # the byte checks' text inside a string: escaped there
    stream = b"".join([
        *(_event({**head, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": None}]}, separators)
          for t in ("a", ', "choices": [{', "")),
        _event({**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}},
               separators),
        b"data: [DONE]\n\n"])
    for cut in range(1, len(stream)):  # every place one read can end and the next begin
        sse = client.SseCounter()
        sse.feed(stream[:cut], 1.0)
        sse.feed(stream[cut:], 2.0)
        assert len(sse.times) == 3 and sse.completion == 3, cut
    sse = client.SseCounter()
    with pytest.raises(RuntimeError, match="error event: boom"):
        sse.feed(_event({"error": "boom"}), 0.0)


def _tree_with_roles(client, pid: int, want: list[str]) -> dict[int, str]:
    """`client.process_tree(pid)` once its roles are `want` (sorted), or as it is after 60 s: between
    fork and exec a child bears its parent's command line, and so, for a moment, its role."""
    deadline = time.monotonic() + 60
    while sorted((tree := client.process_tree(pid)).values()) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return tree


def _probe_for_a_second(client, pid: int) -> dict:
    probe = client.ServerCpu(pid)
    probe.start()
    time.sleep(1.0)
    return probe.stop()


def test_the_server_cpu_probe_names_each_process_by_its_role_and_finds_the_busy_one(client):
    # A stand-in tree with tessera-serve's shape: the root (HTTP process) starts an "engine process"
    # (core_process in its command line) that spins, and that one starts a worker of its own (with the
    # command line's mark of multiprocessing's spawn, as executor.py's workers have).
    spin = "import subprocess, sys, time\n" \
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '--multiprocessing-fork'])\n" \
           "end = time.time() + 60\nwhile time.time() < end: pass\n"
    root = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             f"subprocess.Popen([sys.executable, '-c', {spin!r}, 'core_process'])\ntime.sleep(60)"])
    tree: dict[int, str] = {}
    try:
        want = ["HTTP process", "engine process", "tensor-parallel worker"]
        assert sorted((tree := _tree_with_roles(client, root.pid, want)).values()) == want
        server = _probe_for_a_second(client, root.pid)
    finally:
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        root.wait()
    by_role = {p["role"]: p["utilisation"] for p in server["processes"]}
    assert server["busiest_role"] == "engine process" and by_role["engine process"] > 0.05
    assert by_role["HTTP process"] < by_role["engine process"]
    line = client.describe_server(server)
    assert line.endswith(f"busiest: engine process {100 * by_role['engine process']:.0f}%")


def test_the_server_cpu_probe_names_a_spawned_worker_of_the_http_process_as_a_worker(client):
    """--no-engine-process with --tensor-parallel: executor.py's workers, started by multiprocessing's
    spawn, are children of the HTTP process; the busy one is a worker, not the HTTP process (and
    spawn's resource tracker, a helper, is named as its parent)."""
    script = ("import multiprocessing as mp, time\n"
              "if __name__ == '__main__':\n"
              "    mp.get_context('spawn').Process(target=exec, args=('while True: pass',)).start()\n"
              "    time.sleep(60)\n")
    root = subprocess.Popen([sys.executable, "-c", script])
    tree: dict[int, str] = {}
    try:
        want = ["HTTP process", "HTTP process", "tensor-parallel worker"]  # the root, the resource tracker, the worker
        assert sorted((tree := _tree_with_roles(client, root.pid, want)).values()) == want
        server = _probe_for_a_second(client, root.pid)
    finally:
        for pid in tree:
            if pid != root.pid:
                os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait()
    by_pid = {p["pid"]: p for p in server["processes"]}
    assert by_pid[root.pid]["role"] == "HTTP process"
    assert server["busiest_role"] == "tensor-parallel worker" and server["busiest_utilisation"] > 0.05


def test_under_several_api_servers_the_root_is_named_the_launcher_and_each_child_an_http_process(client):
    sleeper = "import time; time.sleep(60)"
    root = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             f"for a in ('tessera.inference.entrypoints.api_server_process', 'x.core_process'):\n"
                             f"    subprocess.Popen([sys.executable, '-c', {sleeper!r}, a])\n"
                             f"subprocess.Popen([sys.executable, '-c', {sleeper!r}, 'tessera.inference.entrypoints.api_server_process'])\n"
                             "time.sleep(60)"])
    tree: dict[int, str] = {}
    try:
        tree = _tree_with_roles(client, root.pid, ["HTTP process", "HTTP process", "engine process", "launcher"])
    finally:
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait()
    assert tree[root.pid] == "launcher"
    assert sorted(tree.values()) == ["HTTP process", "HTTP process", "engine process", "launcher"]
