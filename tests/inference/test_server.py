"""The HTTP server end to end on a real socket: the official openai client, SSE streaming,
chat, Megatron PUT /api, metrics, auth, limits and errors, and cancellation mid-stream."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from inference_helpers import make_engine
from live_server import LiveServer

API_KEY = "sekrit"


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    s = LiveServer(tiny_ckpt, block_size=8, num_kv_blocks=256)
    yield s
    s.stop()


def test_openai_client_completions_and_chat(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt="def parse(text):", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    again = client.completions.create(model="tiny", prompt="def parse(text):", max_tokens=8, temperature=0)
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic
    # Streaming gives the same text in pieces, then a usage chunk.
    pieces, usage = [], None
    for chunk in client.completions.create(model="tiny", prompt="def parse(text):", max_tokens=8, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == r.choices[0].text and usage.completion_tokens == 8
    # Seeded sampling reproduces; two prompts in one request come back as two choices.
    a = client.completions.create(model="tiny", prompt=["import os", "class A:"], max_tokens=6, temperature=1.0,
                                  seed=11, top_p=0.9, extra_body={"top_k": 50, "min_p": 0.01})
    b = client.completions.create(model="tiny", prompt=["import os", "class A:"], max_tokens=6, temperature=1.0,
                                  seed=11, top_p=0.9, extra_body={"top_k": 50, "min_p": 0.01})
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == 5 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0, stream=True)
        if c.choices)
    assert streamed == chat.choices[0].message.content
    assert server.wait_idle()


def test_chat_prompt_uses_template(server):
    tok = server.engine.tokenizer
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=30).json()
    rendered = "<|bos|><|user|>hi<|endoftext|><|assistant|>"
    assert r["usage"]["prompt_tokens"] == len(tok.encode(rendered))


def test_completion_logprobs_and_echo(server):
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": "x = 1", "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}, timeout=30).json()
    lp = r["choices"][0]["logprobs"]
    prompt_len = r["usage"]["prompt_tokens"]
    # Every prompt token comes back, the first with a null logprob (OpenAI and vLLM do so).
    assert len(lp["tokens"]) == prompt_len + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    assert r["choices"][0]["text"].startswith("x = 1")
    # greedy: the chosen token is the top-1 alternative
    assert max(lp["top_logprobs"][-1].values()) == pytest.approx(lp["token_logprobs"][-1], abs=1e-5)


def test_megatron_api(server):
    r = httpx.put(server.url + "/api", json={"prompts": ["import os", "def f("], "tokens_to_generate": 4,
                                              "logprobs": True, "top_k": 1}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and len(body["text"]) == 2
    assert body["text"][0].startswith("import os")
    for segs, lps in zip(body["segments"], body["logprobs"]):
        assert len(lps) == len(segs) - 1
    # tokens_to_generate=0 scores the prompt only
    score = httpx.put(server.url + "/api", json={"prompts": ["import os, sys"], "tokens_to_generate": 0,
                                                "logprobs": True}, timeout=30).json()
    assert score["text"] == ["import os, sys"]
    assert len(score["logprobs"][0]) == len(score["segments"][0]) - 1 > 0
    bad = httpx.put(server.url + "/api", json={"prompts": ["a"], "top_k": 5, "top_p": 0.5}, timeout=30)
    assert bad.status_code == 400 and "top-k" in bad.json()
    assert httpx.put(server.url + "/api", json={"tokens_to_generate": 2}, timeout=30).status_code == 400


def test_errors_are_openai_shaped(server):
    url = server.url + "/v1/completions"
    cases = [
        (b"{not json", 400),
        (json.dumps({"prompt": "a", "max_tokens": 1000}).encode(), 400),  # over max_tokens limit
        (json.dumps({"prompt": "a " * 200, "max_tokens": 2}).encode(), 400),  # over prompt limit
        (json.dumps({"prompt": ["a", "b", "c", "d", "e"]}).encode(), 400),  # too many prompts
        (json.dumps({"prompt": "a", "temperature": -1}).encode(), 400),
        (json.dumps({"prompt": "a", "model": "other"}).encode(), 404),
        (json.dumps({"prompt": "a", "pad": "x" * 30_000}).encode(), 400),  # body size
        (json.dumps({"prompt": "a", "logit_bias": {"abc": 1}}).encode(), 400),  # key not a token id
        (json.dumps({"prompt": "a", "logit_bias": {"99999999": 1}}).encode(), 400),  # id out of vocabulary
        (json.dumps({"prompt": "a", "logit_bias": {"1": 500}}).encode(), 400),  # bias out of range
        (json.dumps({"prompt": "a", "n": 1, "best_of": 3}).encode(), 400),  # candidate ranking
    ]
    for body, status in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (body[:40], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # still alive



def test_lone_surrogate_huge_seed_and_reserved_template_kwargs_are_400(server):
    """Found by QA: these were 500s (tokenizer TypeError, engine overflow, render_chat TypeError)."""
    headers = {"content-type": "application/json"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ("/v1/completions", {"prompt": "a\udc80b", "max_tokens": 2}, "surrogate"),
        ("/v1/completions", {"prompt": ["ok", "\ud800"], "max_tokens": 2}, "surrogate"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "\udc80"}]}, "surrogate"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 2, "seed": 10**23}, "seed"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 2, "seed": 2**63 - 1, "n": 2}, "seed"),  # seed + 1 overflows
        ("/v1/chat/completions", {**chat, "seed": -(10**23)}, "seed"),
        ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"messages": 5}}, "chat_template_kwargs"),
    ]
    for path, body, needle in cases:
        r = httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=30)  # escapes surrogates
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"], r.text
    for body, needle in [({"prompts": ["\udc80"], "tokens_to_generate": 2}, "surrogate"),
                         ({"prompts": ["a"], "tokens_to_generate": 2, "random_seed": 10**23}, "seed")]:
        r = httpx.put(server.url + "/api", content=json.dumps(body), headers=headers, timeout=30)
        assert r.status_code == 400 and needle in r.json(), r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "seed": 2**63 - 1}, timeout=30)
    assert r.status_code == 200, r.text  # the largest 64-bit seed still works

def test_metrics_exposed(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=30)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hit_rate", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_preemptions_total"):
        assert name in text, name


def test_client_disconnect_mid_stream_frees_blocks(server):
    def generated() -> float:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("vllm:generation_tokens_total")))

    before = generated()
    body = {"prompt": "def f(x):", "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
    for _ in range(3):
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                if got == 3:
                    break  # hang up mid-stream
    assert server.wait_idle(), f"blocks still in use: {server.engine.blocks.num_used}"
    assert generated() - before < 3 * 100  # the requests were cut short, not run to the end


def _check_events_as_before(body: str) -> int:
    """Each SSE event of a reply is the JSON the server wrote before its per-stream templates:
    json.dumps of the chunk (same fields, order and spacing); returns how many there were."""
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        payload = event.removeprefix("data: ")
        chunk = json.loads(payload)
        assert payload == json.dumps(chunk, ensure_ascii=False)
        assert list(chunk)[:5] == ["id", "object", "created", "model", "choices"]
    assert len(events) >= 2, "no chunk before [DONE]"
    return len(events) - 1


def test_streamed_chunks_with_logprobs_echo_usage_and_chat_are_the_json_they_were(server):
    body = {"prompt": ["def f(x):", "x = 1"], "max_tokens": 6, "temperature": 0, "stream": True, "logprobs": 2,
            "echo": True, "stream_options": {"include_usage": True}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    # Queued outputs of a stream that falls behind merge into one chunk: how many chunks depends on timing.
    _check_events_as_before(r.text)
    plain = {**body, "logprobs": None, "echo": False, "n": 2}
    _check_events_as_before(httpx.post(server.url + "/v1/completions", json=plain, timeout=60).text)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "stream": True,
            "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}}
    _check_events_as_before(httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).text)
    chat = {**chat, "logprobs": False, "top_logprobs": None, "stream_options": None}
    _check_events_as_before(httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).text)


def test_a_queued_streamed_request_whose_client_hangs_up_is_aborted_before_it_runs(tiny_ckpt):
    s = LiveServer(tiny_ckpt, block_size=8, num_kv_blocks=64, max_num_seqs=1)
    try:
        long = {"prompt": "def f(x):", "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=30) as running:
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            # Only one sequence runs: this one waits, sends its headers and no event, and is hung up on.
            with httpx.stream("POST", s.url + "/v1/completions", json={**long, "max_tokens": 5}, timeout=30) as r:
                assert r.status_code == 200
            # The frontend forgets the request at once; the engine thread drops it from the scheduler's
            # queue at its next step, which a loaded machine can delay: wait for both (a polled bound).
            deadline = time.time() + 60
            while s.async_engine.num_active() > 1 or s.engine.scheduler.waiting:
                assert time.time() < deadline, "the hung-up request was not aborted"
                time.sleep(0.02)
            assert "data: [DONE]" in list(lines)  # the long one runs to its end
        assert s.wait_idle()
        metrics = httpx.get(s.url + "/metrics", timeout=10).text.splitlines()
        finished = [line for line in metrics
                    if line.startswith("vllm:request_success_total") and 'finished_reason="length"' in line]
        assert [float(line.split()[-1]) for line in finished] == [1.0]  # the long one only: the other never ran
        generated = [float(line.split()[-1]) for line in metrics if line.startswith("vllm:generation_tokens_total")]
        assert generated == [100.0], generated  # not even a first token of the hung-up one
    finally:
        s.stop()


def test_api_key_and_queue_full(tiny_ckpt):
    s = LiveServer(tiny_ckpt, api_key=API_KEY, block_size=8, num_kv_blocks=64, max_num_seqs=1,
                   max_num_batched_tokens=8, max_waiting=1)
    try:
        url = s.url + "/v1/completions"
        assert httpx.post(url, json={"prompt": "a"}, timeout=10).status_code == 401
        assert httpx.post(url, json={"prompt": "a"}, headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200  # health stays open
        auth = {"Authorization": f"Bearer {API_KEY}"}
        ok = httpx.post(url, json={"prompt": "a", "max_tokens": 2}, headers=auth, timeout=30)
        assert ok.status_code == 200
        # One running + one waiting fill the server (max_num_seqs=1, max_waiting=1); the next request is
        # refused with 429. The engine is held after the running one's first step until the refusal, so
        # the three meet in the server however loaded the machine is (four racing posts once all ran
        # one after another on a loaded CI machine).
        import concurrent.futures as cf

        step, first, free, held = s.engine.step, threading.Semaphore(1), threading.Event(), threading.Event()

        def held_step():
            if not free.is_set() and not first.acquire(blocking=False):  # the first step runs ...
                held.set()  # ... the next waits until freed
                assert first.acquire(timeout=120)
            return step()

        s.engine.step = held_step
        long = {"prompt": "a", "max_tokens": 60, "ignore_eos": True}
        try:
            with httpx.stream("POST", url, json={**long, "stream": True}, headers=auth, timeout=60) as running:
                lines = running.iter_lines()
                assert held.wait(60)  # it runs (its first step done; its first chunk may hold no text yet)
                with cf.ThreadPoolExecutor(1) as pool:
                    waiting = pool.submit(httpx.post, url, json=long, headers=auth, timeout=60)
                    deadline = time.monotonic() + 60
                    while s.async_engine._num_waiting() < 1 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    refused = httpx.post(url, json=long, headers=auth, timeout=30)
                    assert refused.status_code == 429, refused.text
                    assert "already waiting" in refused.text
                    free.set()
                    first.release()
                    assert waiting.result().status_code == 200
                assert "data: [DONE]" in list(lines)
        finally:
            free.set()
            first.release()
        assert s.wait_idle()
    finally:
        s.stop()
    assert not s.async_engine._thread.is_alive()  # shutdown stopped the engine thread


def test_seed_reproducible_regardless_of_batch(tiny_ckpt):
    from inference_helpers import run_all, token_ids

    from tessera.inference.core.sampling_params import SamplingParams

    p = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run_all(make_engine(tiny_ckpt, num_kv_blocks=64), {"x": ([5, 6, 7, 8], p)})
    g = torch.Generator().manual_seed(0)
    mates = {f"m{i}": (torch.randint(3, 500, (9 + i,), generator=g).tolist(),
                       SamplingParams(max_tokens=10, temperature=1.0, seed=i)) for i in range(5)}
    crowd = run_all(make_engine(tiny_ckpt, num_kv_blocks=64), {**mates, "x": ([5, 6, 7, 8], p)})
    assert token_ids(alone["x"]) == token_ids(crowd["x"])
