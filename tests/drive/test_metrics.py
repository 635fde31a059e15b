"""Serving metrics on hand-built records: every expected value below is computed by hand."""

from __future__ import annotations

import json
import math

import pytest

from looptrace.drive.benchmark import RequestRecord, RunRecord
from looptrace.drive.metrics import LatencyStats, summarize, tpot_of


def _req(
    rid: str,
    prompt_len: int,
    arrival: float,
    times: list[float],
    finish: float | None = None,
    reason: str | None = "length",
) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        prompt_len=prompt_len,
        max_tokens=len(times),
        arrival=arrival,
        submit_time=arrival,
        token_times=list(times),
        token_ids=list(range(len(times))),
        exit_depths=[4] * len(times),
        finish_time=times[-1] if finish is None else finish,
        finish_reason=reason,
    )


def _record(requests: list[RequestRecord], duration: float = 1.0, interrupted: bool = False) -> RunRecord:
    return RunRecord(
        requests=requests,
        duration=duration,
        start_time=100.0,
        steps_start=0,
        steps_end=20,
        submissions_start=10,
        submissions_end=50,
        peak_kv_usage=0.375,
        interrupted=interrupted,
    )


def _four_requests() -> RunRecord:
    return _record(
        [
            # ttft 100 ms, e2el 600 ms, tpot (600 - 100) / 2 = 250 ms, itls 200, 300 ms
            _req("a", 10, 0.0, [0.1, 0.3, 0.6]),
            # ttft 300 ms (from the scheduled arrival 0.2), e2el 400 ms, tpot 100 ms, itl 100 ms
            _req("b", 20, 0.2, [0.5, 0.6]),
            # one token: ttft 500 ms, e2el 500 ms, no tpot, no itl
            _req("c", 30, 0.4, [0.9], reason="stop"),
            # aborted: kept out of latency and throughput, but its token cost engine steps
            _req("d", 40, 0.0, [0.7], finish=0.8, reason="abort"),
        ]
    )


def test_counts_and_throughput():
    m = summarize(_four_requests())
    assert (m.duration, m.completed, m.failed) == (1.0, 3, 1)
    assert (m.total_input_tokens, m.total_output_tokens, m.tokens_sampled) == (60, 6, 7)
    assert m.request_throughput == pytest.approx(3.0)
    assert m.output_throughput == pytest.approx(6.0)
    assert m.total_token_throughput == pytest.approx(66.0)
    assert m.max_output_tokens_per_s == 6.0
    assert (m.engine_steps, m.submissions) == (20, 40)
    assert m.steps_per_output_token == pytest.approx(20 / 7)
    assert m.submissions_per_output_token == pytest.approx(40 / 7)
    assert m.peak_kv_usage == 0.375 and not m.interrupted
    assert m.finish_reasons == {"length": 2, "stop": 1, "abort": 1}


def test_ttft_counts_from_scheduled_arrival():
    m = summarize(_four_requests())
    assert m.ttfts == pytest.approx([0.1, 0.3, 0.5])
    t = m.ttft
    assert t.count == 3
    assert (t.mean, t.median) == (pytest.approx(300.0), pytest.approx(300.0))
    assert t.std == pytest.approx(math.sqrt((200**2 + 0 + 200**2) / 3))  # population std, as vLLM
    # Linear interpolation over sorted [100, 300, 500]: p90 sits at index 1.8, p99 at 1.98.
    assert t.percentiles[90] == pytest.approx(300 + 0.8 * 200)
    assert t.percentiles[99] == pytest.approx(300 + 0.98 * 200)


def test_tpot_excludes_first_token_and_skips_one_token_requests():
    m = summarize(_four_requests())
    assert m.tpot.count == 2  # request c (1 token) has no TPOT
    assert m.tpot.mean == pytest.approx(175.0)
    assert m.tpot.median == pytest.approx(175.0)
    assert m.tpot.percentiles[99] == pytest.approx(100 + 0.99 * 150)
    # A huge TTFT does not leak into TPOT: 10 s to the first token, then 50 ms per token.
    slow_start = _req("s", 4, 0.0, [10.0, 10.05, 10.10, 10.15])
    assert tpot_of(slow_start) == pytest.approx(0.05)
    assert tpot_of(_req("one", 4, 0.0, [2.0])) is None


def test_tpot_uses_finish_time_not_last_token():
    # E2EL runs to the finish time, so a finish after the last token counts in TPOT (vLLM's definition).
    r = _req("late", 4, 0.0, [0.1, 0.2, 0.3], finish=0.5)
    assert tpot_of(r) == pytest.approx((0.5 - 0.1) / 2)


def test_itl_pools_every_gap():
    m = summarize(_four_requests())
    assert m.itls == [pytest.approx([0.2, 0.3]), pytest.approx([0.1]), []]
    i = m.itl
    assert i.count == 3
    assert (i.mean, i.median) == (pytest.approx(200.0), pytest.approx(200.0))
    assert i.percentiles[90] == pytest.approx(280.0)
    assert i.percentiles[99] == pytest.approx(298.0)


def test_e2el():
    m = summarize(_four_requests())
    assert m.e2el.count == 3
    assert m.e2el.mean == pytest.approx(500.0)
    assert m.e2el.median == pytest.approx(500.0)
    assert m.e2el.percentiles[99] == pytest.approx(598.0)


def test_to_dict_uses_vllm_keys_and_is_json_able():
    d = summarize(_four_requests(), percentiles=(50, 99.9)).to_dict()
    json.dumps(d, allow_nan=False)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for key in (
            f"mean_{name}_ms",
            f"median_{name}_ms",
            f"std_{name}_ms",
            f"p50_{name}_ms",
            f"p99.9_{name}_ms",
        ):
            assert key in d
    assert d["median_tpot_ms"] == pytest.approx(175.0)
    assert d["p50_tpot_ms"] == pytest.approx(d["median_tpot_ms"])
    assert d["mean_ttft_ms"] == pytest.approx(300.0)
    assert (d["completed"], d["total_output_tokens"], d["output_throughput"]) == (3, 6, pytest.approx(6.0))
    assert d["output_lens"] == [3, 2, 1] and d["input_lens"] == [10, 20, 30]
    assert "ttfts" not in summarize(_four_requests()).to_dict(raw=False)
    default = summarize(_four_requests()).to_dict()
    assert {"p90_itl_ms", "p99_itl_ms"} <= default.keys()


def test_goodput():
    # ttft <= 400 ms: a (100) and b (300) pass, c (500) fails.
    assert summarize(_four_requests(), goodput={"ttft": 400}).request_goodput == pytest.approx(2.0)
    # tpot <= 200 ms: a (250) fails; b (100) passes; c (1 token counts as 0, as in vLLM) passes.
    assert summarize(_four_requests(), goodput={"tpot": 200}).request_goodput == pytest.approx(2.0)
    both = summarize(_four_requests(), goodput={"ttft": 400, "tpot": 200})
    assert both.request_goodput == pytest.approx(1.0)
    assert summarize(_four_requests()).request_goodput is None
    with pytest.raises(ValueError, match="goodput metric must be one of ttft, tpot, e2el, got 'itl'"):
        summarize(_four_requests(), goodput={"itl": 10})


def test_empty_and_interrupted_runs_report_zeros():
    r = _record([_req("x", 5, 0.0, [0.5], finish=0.6, reason="abort")], duration=0.6, interrupted=True)
    m = summarize(r)
    assert (m.completed, m.failed, m.total_output_tokens, m.tokens_sampled) == (0, 1, 0, 1)
    assert m.interrupted
    assert m.ttft == LatencyStats(0.0, 0.0, 0.0, {90.0: 0.0, 99.0: 0.0}, 0)
    assert m.max_output_tokens_per_s == 0.0
    json.dumps(m.to_dict(), allow_nan=False)
    z = summarize(_record([], duration=0.0))
    assert (z.request_throughput, z.steps_per_output_token) == (0.0, 0.0)


def test_interrupted_requests_are_incomplete_not_failed():
    """A Ctrl-C'd run: in-flight requests are neither completed nor failed, and their tokens count."""
    reqs = [
        _req("done", 4, 0.0, [0.1, 0.2]),
        _req("cut", 4, 0.0, [0.1, 0.2, 0.3], finish=0.35, reason="interrupted"),
        _req("gone", 4, 0.0, [], finish=0.1, reason="rejected"),
    ]
    m = summarize(_record(reqs, duration=0.35, interrupted=True))
    assert (m.completed, m.failed, m.interrupted_requests) == (1, 1, 1)
    assert (m.total_output_tokens, m.tokens_sampled) == (2, 5)
    assert m.ttft.count == 1  # latency covers the completed request only
    d = m.to_dict(raw=False)
    assert (d["interrupted_requests"], d["unsubmitted_requests"], d["interrupted"]) == (1, 0, True)


def test_peak_tokens_per_second_buckets():
    reqs = [_req("a", 1, 0.0, [0.1, 0.2, 1.1]), _req("b", 1, 0.0, [1.2, 1.3, 1.9]), _req("c", 1, 0.0, [2.5])]
    assert summarize(_record(reqs, duration=3.0)).max_output_tokens_per_s == 4.0  # bucket [1, 2)
