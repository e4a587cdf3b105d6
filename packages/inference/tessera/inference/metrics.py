"""Prometheus metrics of the serving engine (names follow vLLM's, with a tessera: prefix).

Each server owns its own CollectorRegistry, so two servers in one process (tests) never share
counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class ServingMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("tessera:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("tessera:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("tessera:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", labels, registry=r)
        self.prefix_hit_rate = Gauge("tessera:prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens looked up.",
                                     labels, registry=r)
        self.prefix_queries = Counter("tessera:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r)
        self.prefix_hits = Counter("tessera:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r)
        self.prompt_tokens = Counter("tessera:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter("tessera:generation_tokens", "Generated tokens.", labels, registry=r)
        self.preemptions = Counter("tessera:num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.", labels, registry=r)
        self.requests_finished = Counter("tessera:request_success", "Finished requests by finish reason.",
                                         labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("tessera:time_to_first_token_seconds", "Arrival to first generated token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tessera:inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tessera:e2e_request_latency_seconds", "Arrival to last token.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.model_name = model_name
        # Create every labelled child now so scrapers see zeros before the first request.
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_hit_rate, self.prefix_queries,
                       self.prefix_hits, self.prompt_tokens, self.generation_tokens, self.preemptions,
                       self.ttft, self.itl, self.e2e):
            metric.labels(model_name)
        self._last_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0

    def update_engine(self, stats) -> None:
        """Refresh gauges and counters from an EngineStats snapshot (engine thread)."""
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_blocks_used / max(1, stats.kv_blocks_total))
        self.preemptions.labels(m).inc(stats.num_preemptions - self._last_preemptions)
        self._last_preemptions = stats.num_preemptions
        self.prefix_queries.labels(m).inc(stats.prefix_queries - self._last_queries)
        self.prefix_hits.labels(m).inc(stats.prefix_hits - self._last_hits)
        self._last_queries, self._last_hits = stats.prefix_queries, stats.prefix_hits
        self.prefix_hit_rate.labels(m).set(stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
