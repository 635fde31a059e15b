"""Prometheus metrics: vLLM's names and meanings under a `looptrace:` prefix, plus looptrace's own.

Per-request latencies and token counters are prometheus-client Histograms/Counters observed on the engine
thread as tokens come out. Engine state (queue sizes, KV blocks and slots, CUDA-graph counters, steps,
prefix cache, prefill depth) is read at scrape time from the engine loop's latest snapshot by a custom
collector, so a scrape never touches the engine. Each server has its own registry (no global state).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

P = "looptrace:"

# Bucket edges in seconds: sub-millisecond CPU steps up to long CPU generations.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
E2EL_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240)


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.model_name = model_name

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(P + name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Histogram of time per output token (excluding the first) per request, in seconds.",
            TPOT_BUCKETS,
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TPOT_BUCKETS
        )
        self.e2el = hist(
            "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", E2EL_BUCKETS
        )
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Number of prefill tokens processed.", lab, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Number of generation tokens processed.", lab, registry=r
        ).labels(model_name)
        self._success = Counter(
            P + "request_success",
            "Count of finished requests by finish reason.",
            [*lab, "finished_reason"],
            registry=r,
        )
        r.register(EngineCollector(snapshot, model_name))

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()


class EngineCollector(Collector):
    """Gauges and counters from the engine loop's latest snapshot."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.snapshot, self.model_name = snapshot, model_name

    def describe(self):
        return []  # collected lazily; no names to reserve up front

    def collect(self):
        s = self.snapshot() or {}
        m = self.model_name
        reqs, kv, eng = s.get("requests", {}), s.get("kv", {}), s.get("engine", {})

        def gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None):
            labels = {"model_name": m, **(labels or {})}
            g = GaugeMetricFamily(P + name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), math.nan if value is None else float(value))
            return g

        yield gauge(
            "num_requests_running",
            "Number of requests admitted to the engine (any stage).",
            reqs.get("running", 0),
        )
        yield gauge(
            "num_requests_waiting", "Number of requests waiting for admission.", reqs.get("waiting", 0)
        )
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks held by requests (0 to 1; prefix-cache-only blocks count as free).",
            kv.get("usage", 0.0),
        )
        blocks = GaugeMetricFamily(
            P + "kv_blocks",
            "KV pool blocks by state: request, cached (evictable), free.",
            labels=["model_name", "state"],
        )
        for state, key in (
            ("request", "request_blocks"),
            ("cached", "cached_blocks"),
            ("free", "free_blocks"),
        ):
            blocks.add_metric([m, state], float(kv.get(key, 0)))
        yield blocks
        slots = GaugeMetricFamily(
            P + "kv_slots",
            "KV slots (token x layer) in blocks held by requests, per depth plane: live (written) or dead.",
            labels=["model_name", "plane", "state"],
        )
        for p in kv.get("planes", []):
            slots.add_metric([m, str(p["plane"]), "live"], float(p["live_slots"]))
            slots.add_metric([m, str(p["plane"]), "dead"], float(p["dead_slots"]))
        yield slots

        def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None):
            labels = {"model_name": m, **(labels or {})}
            c = CounterMetricFamily(P + name, doc, labels=list(labels))
            c.add_metric(list(labels.values()), float(value))
            return c

        yield counter("engine_steps", "Engine steps (one stage of one batch each).", eng.get("steps", 0))
        yield counter(
            "engine_submissions",
            "Device submissions (graph replays + eager launches).",
            eng.get("submissions", 0),
        )
        yield gauge(
            "steps_per_output_token", "Engine steps per output token since start.", eng.get("steps_per_token")
        )
        yield gauge(
            "submissions_per_output_token",
            "Device submissions per output token since start.",
            eng.get("submissions_per_token"),
        )
        prefix = s.get("prefix", {})
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            prefix.get("query_tokens", 0),
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", prefix.get("hit_tokens", 0)
        )
        yield gauge(
            "prefill_depth",
            "Current prefill depth P (NaN until the engine reports one).",
            s.get("prefill_depth"),
        )

        caches = s.get("graphs", {}).get("caches", {})
        fams = {
            k: CounterMetricFamily(
                P + f"cuda_graph_{k}", f"CUDA graph {k} per graph cache.", labels=["model_name", "graph"]
            )
            for k in ("replays", "captures", "evictions")
        }
        fallbacks = CounterMetricFamily(
            P + "cuda_graph_fallbacks",
            "Graph-able steps that ran eager, by reason.",
            labels=["model_name", "graph", "reason"],
        )
        graphs = GaugeMetricFamily(
            P + "cuda_graphs", "Captured CUDA graphs held per cache.", labels=["model_name", "graph"]
        )
        for name, c in caches.items():
            for k, fam in fams.items():
                fam.add_metric([m, name], float(c.get(k, 0)))
            for reason, n in c.get("fallback_reasons", {}).items():
                fallbacks.add_metric([m, name, reason], float(n))
            graphs.add_metric([m, name], float(c.get("graphs", 0)))
        yield from fams.values()
        yield fallbacks
        yield graphs
