"""tessera-serve's default: the engine in its own process. The same answers as the in-process
engine (greedy tokens, logprobs) after the trip through the pipe; a client hanging up mid-stream
frees the child's blocks; metrics come from the child; a child that dies fails requests with
500 and /health with 503 instead of hanging; a bad checkpoint is one line and exit 2."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from inference_helpers import make_engine, run_all
from ports import start_uvicorn

from tessera.common.checkpoint import resolve_checkpoint
from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.metrics import ServingMetrics
from tessera.inference.engine.process_client import ProcessEngine
from tessera.inference.entrypoints.server import OpenAIServer, ServerLimits
from tessera.inference.worker.cpu_threads import plan_threads

pytestmark = pytest.mark.slow


class ProcessServer:
    def __init__(self, ckpt, **engine_cfg):
        self.engine = ProcessEngine.launch(str(ckpt), EngineConfig(**engine_cfg), plan_threads([], explicit=1))
        self.engine.metrics = ServingMetrics("tiny")
        limits = ServerLimits(max_prompt_tokens=64, max_tokens=200, max_prompts=4)
        app = OpenAIServer(self.engine, "tiny", limits, self.engine.metrics).build_app()
        self.server, self.thread, self.url = start_uvicorn(app)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + "{")))

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    s = ProcessServer(tiny_ckpt, block_size=8, num_kv_blocks=256)
    yield s
    s.stop()
    assert s.engine._proc.poll() is not None  # shutdown stopped the engine process


def test_same_tokens_and_logprobs_as_in_process_engine(served, tiny_ckpt):
    prompts = [[5, 6, 7, 8], [40, 41], [100, 101, 102, 103, 104, 105]]
    ref_engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=256)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    ref = run_all(ref_engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    body = {"prompt": prompts, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    got = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
    for i, choice in enumerate(sorted(got["choices"], key=lambda c: c["index"])):
        outs = ref[str(i)]
        assert choice["text"] == "".join(o.new_text for o in outs)
        want_lps = [lp.logprob for o in outs for lp in o.new_logprobs]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want_lps, abs=1e-5)
        spell = lambda t: ref_engine.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        want_top = [{spell(t): v for t, v in lp.top} for o in outs for lp in o.new_logprobs]
        for top, want in zip(choice["logprobs"]["top_logprobs"], want_top, strict=True):
            assert top == pytest.approx(want, abs=1e-5)


def test_logit_bias_crosses_the_pipe(served, tiny_ckpt):
    """logit_bias (int keys, JSON string keys on the wire) reaches the engine process."""
    ref_engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=256)
    prompt = [5, 6, 7, 8]
    texts = {}
    for bias in ({}, {50: 100.0}):
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias=bias)
        want = "".join(o.new_text for o in run_all(ref_engine, {"r": (prompt, params)})["r"])
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                "logit_bias": {str(k): v for k, v in bias.items()}}
        got = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want
        texts[bool(bias)] = want
    assert texts[True] != texts[False]


def test_disconnect_frees_blocks_in_the_engine_process(served):
    body = {"prompt": "def f(x):", "max_tokens": 150, "temperature": 0, "stream": True, "ignore_eos": True}
    before = served.metric("vllm:generation_tokens_total")
    for _ in range(3):
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: {")
                if got == 3:
                    break  # hang up mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        if (served.engine.num_active() == 0 and served.metric("vllm:kv_cache_usage_perc") == 0.0
                and served.metric("vllm:num_requests_running") == 0.0):
            break
        time.sleep(0.1)
    else:
        pytest.fail("blocks or requests still held in the engine process")
    assert 0 < served.metric("vllm:generation_tokens_total") - before < 3 * 150


def test_engine_process_death_fails_requests_not_hangs(tiny_ckpt):
    s = ProcessServer(tiny_ckpt, block_size=8, num_kv_blocks=64)
    try:
        body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
        lines = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    os.kill(s.engine.pid, signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        assert any('"server_error"' in line for line in lines)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 503
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    finally:
        s.stop()


def test_serve_cli_bad_checkpoint_is_one_line(tiny_ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(resolve_checkpoint(tiny_ckpt), bad)
    (bad / "tessera_checkpoint.json").write_text("{oops")  # the child fails to load it
    code = "from tessera.inference.entrypoints.serve_cli import entry; entry()"
    r = subprocess.run([sys.executable, "-c", code, "--checkpoint", str(bad), "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "tessera_checkpoint.json" in lines[0]


def test_structured_output_echo_logprobs_and_request_timings_cross_the_engine_process(served):
    import json as _json

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 30, "temperature": 1.0,
                                                         "seed": 4, "guided_json": schema}, timeout=60).json()
    assert 0 <= _json.loads(r["choices"][0]["text"])["n"] <= 9 and r["choices"][0]["finish_reason"] == "stop"
    echo = httpx.post(served.url + "/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 0, "echo": True,
                                                            "logprobs": 1}, timeout=60).json()
    assert echo["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert len(echo["choices"][0]["logprobs"]["token_logprobs"]) == 4
    assert served.metric("vllm:request_queue_time_seconds_count") >= 2
    assert served.metric("vllm:request_prefill_time_seconds_count") >= 2
