"""Prometheus metrics of the HTTP server, exposed at ``/metrics``.

Two sources: what only the server sees (latencies as the client experiences them, finish reasons,
accepted prompt tokens) is recorded as it happens on the event loop; what the engine counts (tokens
computed, prefix-cache queries and hits, KV blocks, queue lengths) is read at scrape time from the
snapshot the engine thread publishes after every step, so scraping never touches the engine itself.
Each app gets its own registry, so several servers (or tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pagedkv:"
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    60.0,
)

# engine stats key -> (metric name, help); counters only ever grow, gauges are a current level.
ENGINE_COUNTERS = {
    "prompt_tokens_computed": (
        "prompt_tokens_computed",
        "Prompt tokens run through the model (cache misses)",
    ),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "evictions": ("kv_block_evictions", "Cached KV blocks evicted to make room"),
    "num_preemptions": ("preemptions", "Requests preempted for lack of KV blocks"),
    "draft_tokens": ("spec_decode_draft_tokens", "Speculative draft tokens proposed"),
    "draft_tokens_accepted": ("spec_decode_accepted_tokens", "Speculative draft tokens the model agreed with"),
    "disk_write_failures": ("kv_disk_write_failures", "KV blocks the disk tier failed to write (see the log)"),
}
ENGINE_GAUGES = {
    "num_requests_running": ("num_requests_running", "Sequences in the running batch"),
    "num_requests_waiting": ("num_requests_waiting", "Sequences waiting to be scheduled"),
    "kv_blocks_used": ("kv_blocks_used", "KV blocks held by requests"),
    "kv_blocks_free": ("kv_blocks_free", "KV blocks free (including cached blocks nobody holds)"),
    "kv_blocks_total": ("kv_blocks_total", "KV blocks in the pool"),
}


class EngineStatsCollector(Collector):
    """Turns the engine's latest ``stats()`` snapshot into metric families at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=float(stats.get(key, 0)))
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats.get(key, 0)))


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests",
            "Finished sequences (one per sample) by finish reason: stop, length or abort",
            ["finish_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            PREFIX + "requests_rejected",
            "Requests answered with an error, by HTTP status",
            ["status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of accepted requests, cached or not",
            registry=self.registry,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From request arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Between consecutive outputs of one request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineStatsCollector(stats))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
