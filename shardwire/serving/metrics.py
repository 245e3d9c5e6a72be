"""GET /metrics: Prometheus text, read from the server's state at each scrape.

llama-server's names where shardwire has the same quantity (llamacpp:prompt_tokens_total,
llamacpp:tokens_predicted_total, llamacpp:prompt_seconds_total, ...), so its dashboards keep
working; shardwire's own under shardwire: (per-worker heartbeat latency, bytes on the
coordinator's connections, recoveries, requests by outcome).
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE_LATEST", "Totals", "registry_for", "render"]


class Totals:
    """Tokens and seconds of every finished request, as llama-server counts them: prompt time from
    submission to the first token, generation time from there to the end."""

    def __init__(self):
        self.prompt_tokens = self.cached_tokens = self.predicted_tokens = 0
        self.prompt_seconds = self.predicted_seconds = 0.0
        self._lock = threading.Lock()  # requests end on the event loop, scrapes may come from a thread

    def add(self, handles) -> None:
        with self._lock:
            for h in handles:
                s = h.stats
                if not s.t_first_token or not s.t_end:  # no token yet, or still stopping after a cancel
                    continue
                self.prompt_tokens += s.prompt_tokens - s.cached_tokens  # computed; the rest came from the cache
                self.cached_tokens += s.cached_tokens
                self.prompt_seconds += s.t_first_token - s.t_submit
                self.predicted_tokens += s.completion_tokens
                self.predicted_seconds += max(0.0, s.t_end - s.t_first_token)

    def snapshot(self) -> tuple[int, int, float, int, float]:
        with self._lock:
            return (
                self.prompt_tokens,
                self.cached_tokens,
                self.prompt_seconds,
                self.predicted_tokens,
                self.predicted_seconds,
            )


class _ServerCollector:
    def __init__(self, backend):
        self.backend = backend

    def collect(self):
        b = self.backend
        prompt_n, cached_n, prompt_s, predicted_n, predicted_s = b.totals.snapshot()
        yield _counter("llamacpp:prompt_tokens", "Number of prompt tokens processed.", prompt_n)
        yield _counter("llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from the KV cache.", cached_n)
        yield _counter("llamacpp:prompt_seconds", "Prompt process time", prompt_s)
        yield _counter("llamacpp:tokens_predicted", "Number of generation tokens processed.", predicted_n)
        yield _counter("llamacpp:tokens_predicted_seconds", "Predict process time", predicted_s)
        yield _gauge(
            "llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.", _ratio(prompt_n, prompt_s)
        )
        yield _gauge(
            "llamacpp:predicted_tokens_seconds",
            "Average generation throughput in tokens/s.",
            _ratio(predicted_n, predicted_s),
        )
        if b.engine is not None:
            yield from _engine_families(b.engine)
        requests = CounterMetricFamily("shardwire:requests", "API requests by outcome.", labels=["outcome"])
        for outcome, n in b.requests.items():
            requests.add_metric([outcome], n)
        yield requests
        yield _gauge("shardwire:ready", "1 when every stage is loaded and reachable.", int(b.problem() is None))
        yield from _cluster_families(b.cluster)


def _engine_families(engine):
    slots, done = engine.slots(), engine.counters
    yield _counter("llamacpp:n_decode", "Number of steps sent through the stages.", done.steps)
    yield _counter("llamacpp:n_tokens_max", "Largest number of positions a sequence has reached.", done.most_positions)
    yield _gauge(
        "llamacpp:n_busy_slots_per_decode",
        "Average number of sequences per decode step.",
        _ratio(done.decode_rows, done.decode_steps),
    )
    yield _counter("llamacpp:spec_decode_num_drafts", "Decode rows that carried proposed tokens.", done.drafts)
    yield _counter("llamacpp:spec_decode_num_draft_tokens", "Proposed tokens decode steps checked.", done.draft_tokens)
    yield _counter("llamacpp:spec_decode_num_accepted_tokens", "Proposed tokens kept.", done.draft_accepted)
    yield _counter(
        "shardwire:spec_ahead_steps",
        "Decode steps sent ahead of the one in flight, on what it would give.",
        done.ahead_steps,
    )
    yield _counter("shardwire:spec_void_steps", "Of those, the ones whose step before gave otherwise.", done.void_steps)
    yield _gauge("llamacpp:requests_processing", "Number of requests processing.", slots["busy"])
    yield _gauge("llamacpp:requests_deferred", "Number of requests deferred.", slots["waiting"])
    yield _gauge("shardwire:slots", "Sequence slots (--parallel).", slots["total"])
    kv = slots["kv"]
    yield _gauge("shardwire:kv_page_tokens", "Positions per KV page.", kv["page_tokens"])
    pages = GaugeMetricFamily(
        "shardwire:kv_pages",
        "Pages of every stage's KV pool: in use by a sequence, cached (a known prefix nobody uses), free.",
        labels=["state"],
    )
    pages.add_metric(["in_use"], kv["in_use"])
    pages.add_metric(["cached"], kv["idle"])
    pages.add_metric(["free"], kv["free"])
    yield pages


def _cluster_families(cluster):
    latency = GaugeMetricFamily(
        "shardwire:worker_latency_seconds", "Last heartbeat round trip to each worker.", labels=["worker"]
    )
    alive = GaugeMetricFamily("shardwire:worker_alive", "1 while the worker is connected.", labels=["worker"])
    sent = CounterMetricFamily(
        "shardwire:wire_sent_bytes",
        "Bytes the coordinator sent to each worker on its current connection (restarts at 0 on a reconnect).",
        labels=["worker"],
    )
    received = CounterMetricFamily(
        "shardwire:wire_received_bytes",
        "Bytes the coordinator received from each worker on its current connection (restarts at 0 on a reconnect).",
        labels=["worker"],
    )
    recoveries = CounterMetricFamily(
        "shardwire:recoveries", "Pipeline rebuilds after a lost worker or to rebalance, by outcome.", labels=["outcome"]
    )
    replayed = CounterMetricFamily(
        "shardwire:replayed_tokens", "Tokens replayed to rebuild KV caches after recoveries."
    )
    events = list(cluster.events) if cluster is not None else []
    for link in list(cluster.links) if cluster is not None else []:
        alive.add_metric([link.name], int(link.alive))
        if link.latency_ms is not None:
            latency.add_metric([link.name], link.latency_ms / 1000)
        conn = link.conn
        if conn is not None:
            sent.add_metric([link.name], conn.bytes_sent)
            received.add_metric([link.name], conn.bytes_received)
    for outcome, recovered in (("recovered", True), ("failed", False)):
        recoveries.add_metric([outcome], sum(1 for e in events if e.get("recovered") is recovered))
    replayed.add_metric([], sum(e.get("replayed_tokens", 0) for e in events))
    yield from (latency, alive, sent, received, recoveries, replayed)


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _ratio(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def registry_for(backend) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ServerCollector(backend))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    # llama-server's n_tokens_max is a counter without the _total that prometheus_client gives
    # every counter
    return generate_latest(registry).replace(b"llamacpp:n_tokens_max_total", b"llamacpp:n_tokens_max")
