"""Prometheus metrics of the serving engine, with vLLM V1's names, types and labels, so a vLLM
dashboard (Grafana) or tool reads them unchanged.

The prefix is `vllm:` unless `--metrics-prefix` says otherwise (e.g. `tessera:` beside a real
vLLM on the same Prometheus). Labels are vLLM's: `model_name` and `engine` ("0": one engine
core), plus `finished_reason` on request_success. Counters carry prometheus_client's `_total`
suffix as vLLM's do (`vllm:prompt_tokens_total`). `prefix_cache_hit_rate` is Tessera's own (a
gauge vLLM does not have; the ratio of the two prefix-cache counters).

Request intervals follow vLLM's definitions: queue = arrival in the engine -> first scheduled;
prefill = first scheduled -> first token; decode = first token -> last token; inference =
first scheduled -> last token (all measured in the engine, as durations, since the engine may
run in another process); TTFT, inter-token and end-to-end latency are measured in the HTTP
process from the request's arrival there. time per output token = decode / (tokens - 1).

Speculative decoding has vLLM's four counters: `spec_decode_num_drafts` (verification rows),
`spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens` and
`spec_decode_num_accepted_tokens_per_pos` (label `position`, 0-based); the acceptance rate is
also logged (vLLM's "SpecDecoding metrics" line) at most every LOG_INTERVAL seconds.

`request_max_num_generation_tokens` is vLLM's per "sequence group": one observation when every
choice of a prompt (its `n` requests) has finished, the most tokens any of them generated (the
frontend groups them: async_engine.py). The dashboard's "Max Generation Token in Sequence Group"
panel reads it.

No `_created` series: vLLM turns them off (prometheus_client's `disable_created_metrics`, a
process-wide switch) and its dashboards never read them; each would double a counter's series.

Each server owns its own CollectorRegistry, so two servers in one process (tests) never share
counters.

Several HTTP processes in front of one engine (`tessera-serve --api-server-count N`,
entrypoints/api_servers.py) report the whole server from any of them, as vLLM does: prometheus_client's
multiprocess mode (each process writes its values to files in `PROMETHEUS_MULTIPROC_DIR`, which the
launcher makes and sets before prometheus_client is imported there, and removes at exit), rendered
through a `MultiProcessCollector`, which sums counters and histograms over the processes. Every
process sees every engine step's stats, so the engine's own figures (its gauges, the preemption,
prefix-cache, step-size and speculative-decoding counts) are kept by API server 0 alone, counted once.
Its gauges are written by every process and read as the most recent value written
(`multiprocess_mode="mostrecent"`), so they stay current while process 0 drains before the others.
"""

from __future__ import annotations

import logging
import os
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from tessera.inference.spec_decode.stats import format_spec_stats

log = logging.getLogger("tessera.inference")
LOG_INTERVAL = 10.0  # seconds between speculative-decoding log lines (vLLM logs stats every 10 s)

DEFAULT_PREFIX = "vllm:"
ENGINE_LABEL = "0"

# Buckets of the same ranges as vLLM's for each family.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class ServingMetrics:
    def __init__(self, model_name: str, prefix: str = DEFAULT_PREFIX, max_model_len: int = 2048,
                 api_server: int | None = None):
        """`api_server`: this HTTP process's index among several sharing one engine (multiprocess
        mode, see above); None: the only one."""
        disable_created_metrics()
        if api_server is not None and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            raise RuntimeError("ServingMetrics(api_server=...) needs PROMETHEUS_MULTIPROC_DIR set before "
                               "prometheus_client is imported")
        self.api_server = api_server
        self.engine_owner = api_server in (None, 0)  # keeps the engine's own figures (see above)
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        labels = ["model_name", "engine"]
        p = prefix
        tokens = _token_buckets(max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            if api_server is None:
                return Gauge(p + name, doc, labels, registry=r)
            return Gauge(p + name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(p + name, doc, labels + (extra or []), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(p + name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens looked up (Tessera).")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.requests_finished = counter("request_success", "Count of successfully processed requests.",
                                         ["finished_reason"])
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                                   tokens)
        self.max_generation_tokens = histogram("request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        # vLLM still emits the older name of the same observations (dashboards query it).
        self.tpot_step = histogram("time_per_output_token_seconds",
                                   "Histogram of time per output token in seconds. DEPRECATED: use "
                                   "inter_token_latency_seconds instead.", _ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               _REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                _REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", _REQUEST_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.", ["position"])
        # Create every labelled child now so scrapers see zeros before the first request.
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_hit_rate, self.prefix_queries,
                       self.prefix_hits, self.prompt_tokens, self.generation_tokens, self.preemptions,
                       self.iteration_tokens, self.request_prompt_tokens, self.request_generation_tokens,
                       self.max_generation_tokens, self.ttft,
                       self.itl, self.tpot_step, self.tpot, self.e2e, self.queue, self.prefill, self.decode,
                       self.inference, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
            metric.labels(model_name, ENGINE_LABEL)
        for reason in ("stop", "length", "abort"):
            self.requests_finished.labels(model_name, ENGINE_LABEL, reason)
        self._last_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0
        self._last_spec = (0, 0, 0)
        self._last_per_pos: list[int] = []
        self._spec_logged_at = float("-inf")  # time of the last speculative-decoding log line
        # Each metric's one labelled child, looked up once: `labels()` costs more than the update
        # itself, and a step updates a few per streamed token.
        self._children: dict = {}

    def child(self, metric):
        found = self._children.get(metric)
        if found is None:
            found = self._children[metric] = metric.labels(self.model_name, ENGINE_LABEL)
        return found

    def update_engine(self, stats) -> None:
        """Refresh gauges and counters from an EngineStats snapshot (after each engine step)."""
        c = self.child
        c(self.running).set(stats.num_running)  # every process: the newest write is read (mostrecent)
        c(self.waiting).set(stats.num_waiting)
        c(self.kv_usage).set(stats.kv_blocks_used / max(1, stats.kv_blocks_total))
        c(self.prefix_hit_rate).set(stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0)
        if not self.engine_owner:
            return
        c(self.preemptions).inc(stats.num_preemptions - self._last_preemptions)
        self._last_preemptions = stats.num_preemptions
        c(self.prefix_queries).inc(stats.prefix_queries - self._last_queries)
        c(self.prefix_hits).inc(stats.prefix_hits - self._last_hits)
        self._last_queries, self._last_hits = stats.prefix_queries, stats.prefix_hits
        if stats.step_tokens:
            c(self.iteration_tokens).observe(stats.step_tokens)
        self._update_spec(stats)

    def _update_spec(self, stats) -> None:
        drafts, tokens, accepted = stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        if drafts == self._last_spec[0]:
            return
        c = self.child
        c(self.spec_drafts).inc(drafts - self._last_spec[0])
        c(self.spec_draft_tokens).inc(tokens - self._last_spec[1])
        c(self.spec_accepted).inc(accepted - self._last_spec[2])
        self._last_spec = (drafts, tokens, accepted)
        for pos, count in enumerate(stats.spec_accepted_per_pos):
            before = self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0
            self.spec_accepted_per_pos.labels(self.model_name, ENGINE_LABEL, str(pos)).inc(count - before)
        self._last_per_pos = list(stats.spec_accepted_per_pos)
        now = time.monotonic()
        if now - self._spec_logged_at >= LOG_INTERVAL:
            log.info("%s", format_spec_stats(drafts, tokens, accepted, stats.spec_accepted_per_pos))
            self._spec_logged_at = now

    def observe_token(self, first: bool, since: float) -> None:
        """A step gave a request new tokens: `since` is the time since arrival (first) or since
        its previous tokens."""
        if first:
            self.child(self.ttft).observe(since)
        else:
            self.child(self.itl).observe(since)
            self.child(self.tpot_step).observe(since)

    def observe_finished(self, out, e2e: float) -> None:
        """A request ended: its lengths, latency and the engine's intervals (RequestOutput.timings)."""
        c = self.child
        c(self.e2e).observe(e2e)
        c(self.prompt_tokens).inc(out.num_prompt_tokens)
        c(self.request_prompt_tokens).observe(out.num_prompt_tokens)
        c(self.request_generation_tokens).observe(out.num_output_tokens)
        self.requests_finished.labels(self.model_name, ENGINE_LABEL, out.finish_reason or "unknown").inc()
        t = out.timings
        if t:
            c(self.queue).observe(t["queue"])
            c(self.prefill).observe(t["prefill"])
            c(self.decode).observe(t["decode"])
            c(self.inference).observe(t["inference"])
            if out.num_output_tokens > 1:
                c(self.tpot).observe(t["decode"] / (out.num_output_tokens - 1))

    def observe_group_finished(self, max_generated: int) -> None:
        """Every choice of one prompt has ended: the most tokens one of them generated."""
        self.child(self.max_generation_tokens).observe(max_generated)

    def render(self) -> bytes:
        if self.api_server is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        merged = CollectorRegistry()  # read afresh per scrape: every process's files, summed
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)
