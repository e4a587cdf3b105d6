"""/metrics as a vLLM dashboard reads it (names, types, labels; parsed with prometheus_client's
own parser, and the histograms' counts and sums equal to what the requests' usage says), the
configurable prefix, and SHA-256 prefix-cache keys."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from inference_helpers import make_engine, run_all, token_ids
from live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families

from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.metrics import ServingMetrics
from tessera.inference.engine.wire import output_from_wire, output_to_wire

# What vLLM V1 exposes for the quantities Tessera has (the Grafana dashboard's panels read these).
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:iteration_tokens_total": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
}


# Every series the panels of vLLM's Grafana dashboard query (examples/observability/
# prometheus_grafana/grafana.json in vLLM: the metric names in its panels' PromQL expressions).
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",  # E2E Request Latency
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",  # Token Throughput
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",  # Inter Token Latency
    "vllm:num_requests_running", "vllm:num_requests_waiting",  # Scheduler State
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",  # Time To First Token Latency
    "vllm:kv_cache_usage_perc",  # Cache Utilization
    "vllm:request_prompt_tokens_bucket",  # Request Prompt Length
    "vllm:request_generation_tokens_bucket",  # Request Generation Length
    "vllm:request_success_total",  # Finish Reason
    "vllm:request_queue_time_seconds_sum",  # Queue Time
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",  # Prefill and Decode Time
    "vllm:request_max_num_generation_tokens_sum",  # Max Generation Token in Sequence Group
]


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict, name: str, suffix: str = "", **labels) -> float:
    family = families[name]
    return sum(s.value for s in family.samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_have_vllm_names_types_labels_and_the_requests_numbers(tiny_ckpt):
    server = LiveServer(tiny_ckpt, block_size=8, num_kv_blocks=128)
    try:
        before = scrape(server.url)
        assert {name: before[name].type for name in VLLM_METRICS} == VLLM_METRICS
        usages = []
        for prompt, max_tokens in [("import os", 5), ("def f(x):\n    return", 1), ("class A:", 9)]:
            r = httpx.post(server.url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}, timeout=60)
            usages.append(r.json()["usage"])
        assert server.wait_idle()
        after = scrape(server.url)
    finally:
        server.stop()
    for family in after.values():
        if family.name.startswith("vllm:"):
            for s in family.samples:
                assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0", s
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert sample(after, "vllm:prompt_tokens", "_total") == prompt
    assert sample(after, "vllm:generation_tokens", "_total") == generated == 15
    assert sample(after, "vllm:request_success", "_total", finished_reason="length") == 3
    assert sample(after, "vllm:request_prompt_tokens", "_sum") == prompt
    assert sample(after, "vllm:request_generation_tokens", "_sum") == generated
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
        assert sample(after, name, "_count") == 3, name
    assert sample(after, "vllm:request_time_per_output_token_seconds", "_count") == 2  # requests of > 1 token
    assert sample(after, "vllm:inter_token_latency_seconds", "_count") == 4 + 8  # tokens after each first
    assert sample(after, "vllm:time_per_output_token_seconds", "_count") == 4 + 8
    # Every computed token was in some step: the steps' tokens add up to prompts + all but the last tokens.
    assert sample(after, "vllm:iteration_tokens_total", "_sum") == prompt + generated - 3
    assert sample(after, "vllm:request_decode_time_seconds", "_sum") <= sample(
        after, "vllm:request_inference_time_seconds", "_sum")


def test_every_dashboard_panel_has_its_series_and_no_created_series_are_exposed(tiny_ckpt):
    server = LiveServer(tiny_ckpt, block_size=8, num_kv_blocks=128)
    try:
        for body in ({"prompt": ["import os", "class A:"], "n": 2, "max_tokens": 5},  # 2 groups of 2 choices
                     {"prompt": "def f(x):", "max_tokens": 3}):
            r = httpx.post(server.url + "/v1/completions", json={**body, "ignore_eos": True, "temperature": 0},
                           timeout=60)
            assert r.status_code == 200, r.text
        assert server.wait_idle()
        text = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples
               if s.labels.get("model_name") == "tiny"}
    assert [name for name in DASHBOARD_SERIES if name not in samples] == []
    assert [line for line in text.splitlines() if "_created" in line] == []
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vllm:request_max_num_generation_tokens"].type == "histogram"
    # One observation per prompt, not per choice: the longest of its choices.
    assert sample(families, "vllm:request_max_num_generation_tokens", "_count") == 3
    assert sample(families, "vllm:request_max_num_generation_tokens", "_sum") == 5 + 5 + 3


def test_the_metrics_prefix_is_configurable_and_checked(tiny_ckpt):
    families = {f.name: f for f in text_string_to_metric_families(ServingMetrics("m", "tessera:").render().decode())}
    assert "tessera:generation_tokens" in families and not any(n.startswith("vllm:") for n in families)
    code = "from tessera.inference.entrypoints.serve_cli import entry; entry()"
    r = subprocess.run([sys.executable, "-c", code, "--checkpoint", str(tiny_ckpt), "--metrics-prefix", "9 bad"],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "error: --metrics-prefix" in lines[0], r.stderr


def test_request_timings_cross_the_engine_pipe(tiny_ckpt):
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64)
    outs = run_all(engine, {"a": ([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))})["a"]
    final = outs[-1]
    assert set(final.timings) == {"queue", "prefill", "decode", "inference"} and min(final.timings.values()) >= 0
    assert all(o.timings is None for o in outs[:-1])
    assert output_from_wire(output_to_wire(final), 0.0).timings == final.timings


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_sha256_prefix_cache_keys_share_blocks_and_keep_outputs(tiny_ckpt, algo):
    engine = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64, prefix_cache_hash=algo)
    shared = list(range(40, 60))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = run_all(engine, {"a": (shared + [1], params)})
    second = run_all(engine, {"b": (shared + [2], params)})
    assert second["b"][-1].num_cached_tokens == 16  # two full blocks of the shared 20 tokens
    keys = list(engine.blocks.cached)
    assert keys and all(isinstance(k, bytes) and len(k) == 32 for k in keys) == (algo == "sha256")
    reference = make_engine(tiny_ckpt, block_size=8, num_kv_blocks=64, enable_prefix_caching=False)
    assert token_ids(second["b"]) == token_ids(run_all(reference, {"b": (shared + [2], params)})["b"])
    assert token_ids(first["a"])
