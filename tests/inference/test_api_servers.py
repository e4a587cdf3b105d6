"""`tessera-serve --api-server-count N`: N HTTP processes on one port in front of one engine process
(entrypoints/api_servers.py). As real processes: what the `openai` client gets equals the
one-process server's; both processes serve; /metrics from either counts the whole server once;
SIGTERM drains streams on both and leaves nothing; one dead HTTP process stops the whole server;
refusals are one line, exit 2. Which process holds a connection is read from the kernel (its
sockets), never guessed from timing."""

from __future__ import annotations

import concurrent.futures as cf
import glob
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from inference_helpers import wait_for_health
from ports import SERVE, start_serve
from process_tree import assert_gone, descendants

pytestmark = [pytest.mark.slow]

BASE = ("--quiet", "--num-kv-blocks", "64", "--torch-threads", "1", "--enforce-eager", "--served-model-name", "tiny")
PROMPTS = [[5, 17, 33], [9, 8, 7, 6], [40, 41], [100, 3, 250, 77, 12]]
MESSAGES = [[{"role": "user", "content": "hello there"}], [{"role": "user", "content": "two words"}]]


def _serve(ckpt, *extra):
    proc, url, _ = start_serve(SERVE, "--checkpoint", ckpt, *BASE, *extra)
    wait_for_health(proc, url, 120)
    return proc, url


def _stop(proc) -> None:
    if proc.poll() is None:
        below = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert_gone(below, "a test's tessera-serve")


def _api_servers(proc) -> list[psutil.Process]:
    found = [p for p in psutil.Process(proc.pid).children() if "entrypoints.api_server_process" in " ".join(p.cmdline())]
    return sorted(found, key=lambda p: p.pid)


@pytest.fixture(scope="module")
def servers(tiny_ckpt):
    """(the one-process server's URL, the two-process server) on the same checkpoint: the former
    the same app over the engine in a thread of this process (LiveServer), which starts in a
    fraction of a tessera-serve's time."""
    from live_server import LiveServer

    two = None
    one = LiveServer(tiny_ckpt, num_kv_blocks=64, enforce_eager=True)
    try:
        two, url = _serve(tiny_ckpt, "--api-server-count", "2")
        yield one.url, (two, url)
    finally:
        if two is not None:
            _stop(two)
        one.stop()


def _outputs(url: str) -> list:
    """Greedy completions and chats, streamed and not, through the `openai` client, sent at once;
    a client per request, so each is its own connection (one kept-alive connection would reach
    one process only)."""
    from openai import OpenAI

    def client():
        return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def completion(prompt, stream):
        r = client().completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=stream)
        if not stream:
            return r.choices[0].text, r.choices[0].finish_reason
        chunks = [c for c in r if c.choices]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    def chat(messages, stream):
        r = client().chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                              stream=stream)
        if not stream:
            return r.choices[0].message.content, r.choices[0].finish_reason
        chunks = [c for c in r if c.choices]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    jobs = [(completion, p, s) for p in PROMPTS for s in (False, True)] + \
           [(chat, m, s) for m in MESSAGES for s in (False, True)]
    with cf.ThreadPoolExecutor(6) as pool:
        return list(pool.map(lambda job: job[0](job[1], job[2]), jobs))


def test_two_http_processes_answer_the_openai_client_as_one_does(servers):
    one_url, (two, two_url) = servers
    assert len(_api_servers(two)) == 2
    want = _outputs(one_url)
    assert all(text for text, _ in want) and {r for _, r in want} == {"length"}, want
    assert _outputs(two_url) == want


def _samples(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metric(samples: dict[str, float], name: str, **labels) -> float:
    """The one sample of `name` (vllm: prefix) whose labels include `labels`."""
    found = [v for k, v in samples.items() if k.split("{")[0] == "vllm:" + name
             and all(f'{a}="{b}"' in k for a, b in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def _own_counts(child: psutil.Process, name: str) -> float:
    """What one HTTP process alone counted: its own files of the multiprocess metrics directory,
    read through prometheus_client's collector in a copy holding only them."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    directory = child.environ()["PROMETHEUS_MULTIPROC_DIR"]
    own = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tessera-test-metrics-{child.pid}")
    shutil.rmtree(own, ignore_errors=True)
    os.makedirs(own)
    try:
        for f in glob.glob(os.path.join(directory, f"*_{child.pid}.db")):
            shutil.copy(f, own)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=own)
        lines = generate_latest(registry).decode().splitlines()
    finally:
        shutil.rmtree(own, ignore_errors=True)
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:" + name)
               and 'finished_reason="length"' in line)


def _workload(url: str, k: int) -> None:
    """k greedy completions, each on a connection of its own, 4 at a time."""
    def one(i):
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 5,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text

    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(k)))


def test_metrics_from_either_process_count_the_whole_server_once(servers):
    """Per-request figures are summed over the processes (a process's own registry would count half);
    the engine's own ones (prefix-cache lookups, tokens per step) are counted once, as by one process."""
    one_url, (two, two_url) = servers
    k = 16
    deltas = {}
    for url in (one_url, two_url):
        before = _samples(url)
        _workload(url, k)
        after = _samples(url)
        deltas[url] = {name: _metric(after, name, **labels) - _metric(before, name, **labels)
                       for name, labels in [("request_success_total", {"finished_reason": "length"}),
                                            ("generation_tokens_total", {}),
                                            ("prefix_cache_queries_total", {}),
                                            ("iteration_tokens_total_sum", {}),
                                            ("e2e_request_latency_seconds_count", {})]}
    assert deltas[two_url]["request_success_total"] == k
    assert deltas[two_url]["e2e_request_latency_seconds_count"] == k
    assert deltas[two_url]["generation_tokens_total"] == 5 * k
    assert deltas[two_url] == deltas[one_url]
    # Both processes served some of them (the kernel spreads the connections).
    own = [_own_counts(c, "request_success_total") for c in _api_servers(two)]
    assert all(n > 0 for n in own), own
    # Every scrape, whichever process answers, reads the same totals.
    totals = {_metric(_samples(two_url), "request_success_total", finished_reason="length") for _ in range(6)}
    assert len(totals) == 1 and totals.pop() == sum(own)


def _holder(kids: list[psutil.Process], client_port: int, timeout: float = 60) -> int:
    """Which of `kids` holds the server side of the connection from `client_port` (the kernel's view)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, kid in enumerate(kids):
            if any(c.raddr and c.raddr.port == client_port for c in kid.net_connections(kind="tcp")):
                return i
        time.sleep(0.05)
    raise AssertionError(f"no HTTP process holds the connection from port {client_port}")


def test_sigterm_drains_streams_on_every_process_and_leaves_nothing(tiny_ckpt):
    """One sequence at a time (--max-num-seqs 1), so the streams queue in the engine. Streams are opened
    until each process holds three; SIGTERM then comes while each still has one whose first token is
    generated after it, and every stream must still end whole, the server exit 0 and nothing be left."""
    proc, url = _serve(tiny_ckpt, "--api-server-count", "2", "--max-num-seqs", "1", "--drain-timeout", "120")
    pool = cf.ThreadPoolExecutor(16)
    try:
        kids = _api_servers(proc)
        below = descendants(proc.pid)
        signalled = threading.Event()

        def stream(i: int, opened: queue.Queue):
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            first_after = None
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as r:
                opened.put(r.extensions["network_stream"].get_extra_info("socket").getsockname()[1])
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if first_after is None and events[-1]["choices"]:
                            first_after = signalled.is_set()
            return first_after, events[-1]["usage"]["completion_tokens"], [
                e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]

        held: list[list[cf.Future]] = [[], []]
        while min(len(h) for h in held) < 3:
            assert sum(len(h) for h in held) < 16, [len(h) for h in held]
            opened: queue.Queue = queue.Queue()
            future = pool.submit(stream, sum(len(h) for h in held), opened)
            held[_holder(kids, opened.get(timeout=60))].append(future)
        proc.send_signal(signal.SIGTERM)
        signalled.set()
        results = [[f.result(timeout=180) for f in h] for h in held]
        assert all(r[1:] == (64, "length") for h in results for r in h), results
        assert all(any(r[0] for r in h) for h in results), results  # each drained a stream begun after SIGTERM
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert "Traceback" not in err and "error:" not in err, err[-3000:]
        assert_gone(below, "tessera-serve --api-server-count 2 stopped by SIGTERM")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flags, words", [
    (["--api-server-count", "0"], "--api-server-count 0: must be >= 1"),
    (["--api-server-count", "2", "--no-engine-process"], "--api-server-count 2: needs the engine in its own "
                                                          "process; drop --no-engine-process"),
])
def test_refusals_are_one_line_and_exit_2(tiny_ckpt, flags, words, capsys):
    from tessera.common.errors import run_cli
    from tessera.inference.entrypoints.serve_cli import main

    with pytest.raises(SystemExit) as stopped:
        run_cli(main, ["--checkpoint", str(tiny_ckpt), *BASE, *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("count, make, words", [
    ("2", True, "--api-server-count 2: PROMETHEUS_MULTIPROC_DIR is set"),
    ("1", False, "not a directory (prometheus_client writes the metrics there)"),
])
def test_a_prometheus_multiproc_dir_set_beforehand_is_refused_in_one_line_before_the_model_loads(
        tiny_ckpt, tmp_path, monkeypatch, capsys, count, make, words):
    """Several processes: the launcher's own directory would silently replace the user's. One: a
    missing directory was a traceback once the model had loaded (prometheus_client writes there)."""
    from tessera.common.errors import run_cli
    from tessera.inference.entrypoints.serve_cli import main

    where = tmp_path / "prom"
    if make:
        where.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(where))
    monkeypatch.setattr("tessera.inference.engine.process_client.start_engine_process",
                        lambda *a, **k: pytest.fail("the engine was started"))
    with pytest.raises(SystemExit) as stopped:
        run_cli(main, ["--checkpoint", str(tiny_ckpt), *BASE, "--api-server-count", count])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_a_checkpoint_the_engine_cannot_load_is_its_one_line_error_over_the_first_of_n_pipes(tiny_ckpt, tmp_path):
    """The engine process's own load error (a payload that fails its checksum) crosses the first of
    its N pipes as with one (the CLI prints the UserError in one line, exit 2), and nothing is left."""
    from tessera.common.errors import UserError
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.process_client import start_engine_process

    broken = tmp_path / "run"
    shutil.copytree(tiny_ckpt, broken)
    payload = max((p for p in broken.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0x01
    payload.write_bytes(bytes(data))
    before = {p.pid for p in descendants()}
    with pytest.raises(UserError, match=f"{payload.name}: checksum mismatch"):
        start_engine_process(str(broken), EngineConfig(num_kv_blocks=64, enforce_eager=True), pipes=2)
    assert_gone([p for p in descendants() if p.pid not in before], "a failed engine start with 2 pipes")


def test_a_dead_http_process_stops_the_whole_server(servers):
    """Last: it ends the module's two-process server."""
    _, (proc, _) = servers
    kids = _api_servers(proc)
    below = descendants(proc.pid)
    assert any("core_process" in " ".join(p.cmdline()) for p in below)
    kids[1].kill()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert re.search(rf"API server process 1 \(pid {kids[1].pid}\) exited \(code -9\)", err), err[-3000:]
    assert_gone(below, "tessera-serve after one of its HTTP processes died")


class _OneStepEngine:
    """The engine surface run_engine_loop drives: every request added finishes at the next step."""

    def __init__(self):
        self.pending: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, rid, prompt, params) -> None:
        self.pending.append(rid)

    def abort(self, rid) -> None:
        self.aborted.append(rid)
        self.pending.remove(rid)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self):
        from tessera.inference.engine.output_processor import RequestOutput

        done, self.pending = self.pending, []
        return [RequestOutput(rid, [7], "x", [], True, "length", 3, 1, 0) for rid in done]

    def stats(self):
        from tessera.inference.engine.llm_engine import EngineStats

        return EngineStats(0, 0, 0, 64, 0, 0, 0)


def test_an_abort_from_a_pipe_that_does_not_own_the_request_is_ignored():
    """The engine process's routing (core_process._loop) over two pipes: pipe 1 aborting pipe 0's
    request neither aborts it nor loses where its outputs go; pipe 0 still gets its output."""
    import socket
    from multiprocessing.connection import Connection

    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.engine.core_process import _loop
    from tessera.inference.engine.wire import decode, encode

    pairs = [socket.socketpair() for _ in range(2)]
    ours = [Connection(a.detach()) for a, _ in pairs]
    theirs = [Connection(b.detach()) for _, b in pairs]
    engine = _OneStepEngine()
    ours[0].send_bytes(encode({"t": "add", "id": "cmpl-0-1", "prompt": [5, 6, 7],
                               "params": SamplingParams(max_tokens=1).model_dump(mode="json")}))
    ours[1].send_bytes(encode({"t": "abort", "ids": ["cmpl-0-1"]}))
    loop = threading.Thread(target=_loop, args=(theirs, engine), daemon=True)
    loop.start()
    try:
        assert ours[0].poll(60)
        step = decode(ours[0].recv_bytes())
        assert [o[0] for o in step["outs"]] == ["cmpl-0-1"] and step["adds_seen"] == 1, step
        assert engine.aborted == []
    finally:
        for c in ours:
            c.send_bytes(encode({"t": "stop"}))
        loop.join(60)
        for c in ours + theirs:
            c.close()
    assert not loop.is_alive()


# An HTTP process stand-in for the launcher's supervision: reports "listening" after DELAY s and
# records whether SIGTERM reached it before or after that.
_STAND_IN = """
import os, signal, sys, time
from multiprocessing.connection import Connection
control, delay, out = Connection(int(sys.argv[1])), float(sys.argv[2]), sys.argv[3]
state = {"listening": False}
def term(*_):
    open(out, "w").write("after" if state["listening"] else "before")
    os._exit(0)
signal.signal(signal.SIGTERM, term)
time.sleep(delay)
state["listening"] = True
control.send_bytes(b"listening")
time.sleep(120)
"""


def test_a_stop_while_an_http_process_starts_reaches_it_once_it_listens(tmp_path):
    """SIGTERM before uvicorn's handlers are in place would kill a starting HTTP process, end its pipe
    without "stop" and so the engine under the others' draining requests: the launcher holds the
    signal until the process says it listens (api_servers._Stopper, _supervise)."""
    import socket
    import sys
    from multiprocessing.connection import Connection

    from tessera.inference.entrypoints import api_servers

    read, write = os.pipe()  # the engine stand-in ends once every HTTP process has (their ends of its pipe)
    engine = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.buffer.read()"], stdin=read)
    os.close(read)
    children = []
    for i, delay in enumerate((0.0, 4.0)):  # 4 s: time enough on a loaded machine to stop before it listens
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-c", _STAND_IN, str(theirs.fileno()), str(delay),
                                 str(tmp_path / f"http{i}")], pass_fds=[theirs.fileno(), write])
        theirs.close()
        children.append(api_servers._Child(i, proc, Connection(ours.detach())))
    os.close(write)
    stop = api_servers._Stopper(children)
    result: list = []
    supervisor = threading.Thread(target=lambda: result.append(api_servers._supervise(
        children, engine, os.pidfd_open(engine.pid), stop, "listening", 60)), daemon=True)
    supervisor.start()
    try:
        deadline = time.monotonic() + 60
        while not children[0].listening and time.monotonic() < deadline:
            time.sleep(0.02)
        assert children[0].listening and not children[1].listening
        stop.begin()  # process 1 is still starting
        supervisor.join(90)
        assert result == [None]  # a clean stop: every process drained, the engine ended by itself
        assert [(tmp_path / f"http{i}").read_text() for i in range(2)] == ["after", "after"]
    finally:
        for c in children:
            c.send(signal.SIGKILL)
        engine.kill()
        engine.wait()
