"""Serving metrics with vLLM's names and definitions (`vllm bench serve`), computed from a `RunRecord`.

- TTFT: first token time − scheduled arrival.
- TPOT (excl. 1st token): (E2EL − TTFT) / (output_len − 1), only for requests with output_len > 1.
- ITL: every gap between consecutive tokens of a request, pooled over requests.
- E2EL: finish time − scheduled arrival.
Latency statistics cover completed requests only, as vLLM's cover successful ones; percentiles are numpy's
(linear interpolation) and the std is the population std, as in vLLM. An empty sample reports 0, as vLLM
does; `LatencyStats.count` tells an empty sample from a real 0.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from looptrace.drive.benchmark import FAILED_REASONS, INTERRUPTED, RequestRecord, RunRecord

PERCENTILES: tuple[float, ...] = (90, 99)  # the median (p50) is always reported
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # SLOs in ms, as vLLM's `--goodput ttft:500 tpot:50`


@dataclass
class LatencyStats:
    """One latency metric in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # p -> value (ms)
    count: int  # samples (requests, or token gaps for ITL)

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> LatencyStats:
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        if ms.size == 0:
            return cls(0.0, 0.0, 0.0, {float(p): 0.0 for p in percentiles}, 0)
        pcts = {float(p): float(np.percentile(ms, p)) for p in percentiles}
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()), pcts, int(ms.size))


@dataclass
class ServingMetrics:
    duration: float  # s
    completed: int
    failed: int  # rejected before submission, or aborted (an interrupt's in-flight requests are not)
    total_input_tokens: int  # completed requests
    total_output_tokens: int  # completed requests
    request_throughput: float  # completed req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # (input + output) tok/s
    max_output_tokens_per_s: float  # peak over 1 s buckets of the run
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    # Engine work per token: steps and forward submissions over *every* token sampled in the run (aborted
    # requests' tokens cost steps too).
    engine_steps: int
    submissions: int
    tokens_sampled: int
    steps_per_output_token: float
    submissions_per_output_token: float
    peak_kv_usage: float
    interrupted: bool
    interrupted_requests: int = 0  # in flight at a Ctrl-C: incomplete, not failed
    unsubmitted_requests: int = 0  # still waiting for their arrival at a Ctrl-C
    request_goodput: float | None = None  # good req/s, when SLOs were given
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # Raw samples in seconds (vLLM's `ttfts`, `itls` per request, `input_lens`, `output_lens`).
    input_lens: list[int] = field(default_factory=list, repr=False)
    output_lens: list[int] = field(default_factory=list, repr=False)
    ttfts: list[float] = field(default_factory=list, repr=False)
    itls: list[list[float]] = field(default_factory=list, repr=False)

    def to_dict(self, raw: bool = True) -> dict[str, Any]:
        """JSON-able dict with vLLM's keys (`mean_ttft_ms`, `median_tpot_ms`, `p99_itl_ms`, ...)."""
        d: dict[str, Any] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats: LatencyStats = getattr(self, name)
            d[f"mean_{name}_ms"] = stats.mean
            d[f"median_{name}_ms"] = stats.median
            d[f"std_{name}_ms"] = stats.std
            for p, v in stats.percentiles.items():
                d[f"p{_pct_word(p)}_{name}_ms"] = v
        d |= {
            "engine_steps": self.engine_steps,
            "submissions": self.submissions,
            "tokens_sampled": self.tokens_sampled,
            "steps_per_output_token": self.steps_per_output_token,
            "submissions_per_output_token": self.submissions_per_output_token,
            "peak_kv_usage": self.peak_kv_usage,
            "interrupted": self.interrupted,
            "interrupted_requests": self.interrupted_requests,
            "unsubmitted_requests": self.unsubmitted_requests,
            "finish_reasons": dict(self.finish_reasons),
        }
        if raw:
            d |= {"input_lens": self.input_lens, "output_lens": self.output_lens, "ttfts": self.ttfts}
            d["itls"] = self.itls
        return d


def _pct_word(p: float) -> str:
    """vLLM's key spelling: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def tpot_of(rec: RequestRecord) -> float | None:
    """(E2EL − TTFT) / (output_len − 1): the first token is excluded; undefined for 1-token requests."""
    if rec.output_len <= 1 or rec.e2el is None or rec.ttft is None:
        return None
    return (rec.e2el - rec.ttft) / (rec.output_len - 1)


def _peak_tokens_per_s(record: RunRecord) -> float:
    """Most tokens of completed requests timestamped within one 1-second bucket of the run."""
    buckets = Counter(math.floor(t) for r in record.requests if r.completed for t in r.token_times)
    return float(max(buckets.values(), default=0))


def _is_good(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    # vLLM counts a 1-token request's TPOT as 0 for goodput.
    values = {"ttft": rec.ttft or 0.0, "tpot": tpot_of(rec) or 0.0, "e2el": rec.e2el or 0.0}
    return all(values[k] * 1000.0 <= slo for k, slo in slos_ms.items())


def _check_slos(slos_ms: dict[str, float]) -> None:
    for key, value in slos_ms.items():
        if key not in GOODPUT_METRICS:
            raise ValueError(f"goodput metric must be one of {', '.join(GOODPUT_METRICS)}, got {key!r}")
        if not value > 0:
            raise ValueError(f"goodput SLO for {key} must be > 0 ms, got {value!r}")


def summarize(
    record: RunRecord,
    *,
    percentiles: Sequence[float] = PERCENTILES,
    goodput: dict[str, float] | None = None,
) -> ServingMetrics:
    """Serving metrics of one run. `goodput` maps "ttft"/"tpot"/"e2el" to an SLO in ms."""
    done = [r for r in record.requests if r.completed]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [t for t in map(tpot_of, done) if t is not None]
    itls = [r.itls for r in done]
    e2els = [r.e2el for r in done if r.e2el is not None]
    n_in = sum(r.prompt_len for r in done)
    n_out = sum(r.output_len for r in done)
    sampled = sum(r.output_len for r in record.requests)
    dur = record.duration
    good = None
    if goodput:
        _check_slos(goodput)
        good = _ratio(sum(_is_good(r, goodput) for r in done), dur)
    return ServingMetrics(
        duration=dur,
        completed=len(done),
        failed=sum(r.finish_reason in FAILED_REASONS for r in record.requests),
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=_ratio(len(done), dur),
        output_throughput=_ratio(n_out, dur),
        total_token_throughput=_ratio(n_in + n_out, dur),
        max_output_tokens_per_s=_peak_tokens_per_s(record),
        ttft=LatencyStats.of(ttfts, percentiles),
        tpot=LatencyStats.of(tpots, percentiles),
        itl=LatencyStats.of([g for gaps in itls for g in gaps], percentiles),
        e2el=LatencyStats.of(e2els, percentiles),
        engine_steps=record.engine_steps,
        submissions=record.submissions,
        tokens_sampled=sampled,
        steps_per_output_token=_ratio(record.engine_steps, sampled),
        submissions_per_output_token=_ratio(record.submissions, sampled),
        peak_kv_usage=record.peak_kv_usage,
        interrupted=record.interrupted,
        interrupted_requests=sum(r.finish_reason == INTERRUPTED for r in record.requests),
        unsubmitted_requests=record.unsubmitted,
        request_goodput=good,
        finish_reasons=dict(Counter(r.finish_reason or "unfinished" for r in record.requests)),
        input_lens=[r.prompt_len for r in done],
        output_lens=[r.output_len for r in done],
        ttfts=ttfts,
        itls=itls,
    )
