"""Sources without Textual: Prometheus parsing and quantiles, session files, the diff loader."""

from __future__ import annotations

import json
import math

import pytest

from looptrace.tui.diff_data import DiffDataError, first_divergence, load_diff
from looptrace.tui.model import DashboardModel
from looptrace.tui.sources import (
    PrometheusSource,
    Recorder,
    ReplayError,
    ReplaySource,
    SourceError,
    histogram_quantile,
    load_session,
)
from tests.tui.conftest import DIFF, FIXTURES, SESSION


def test_histogram_quantile_follows_prometheus():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: top of the first bucket
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert histogram_quantile(0.99, [(1.0, 1.0), (math.inf, 2.0)]) == 1.0  # +Inf bucket: its lower bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None


def test_vllm_scrapes_become_snapshots(vllm_endpoint):
    url, served = vllm_endpoint
    src = PrometheusSource(url)
    first, second = src.fetch(), src.fetch()
    assert served["n"] == 2
    assert first["requests"] == {"running": 12, "waiting": 3, "list": None}
    assert second["kv"] == {"usage": 0.305}
    assert second["tokens"]["generation_total"] == 10500
    # second scrape: percentiles of the 25 new TTFT observations only (20 x 45 ms, 5 x 200 ms)
    ttft = second["latency"]["ttft"]
    assert ttft["window"] == "interval" and ttft["n"] == 25
    assert 0.04 < ttft["p50"] <= 0.06 and 0.1 < ttft["p99"] <= 0.25
    assert second["prefix"]["hit_rate"] == pytest.approx(26000 / 51200)
    assert second["probe"] is None and second["graphs"] is None
    model = DashboardModel()
    model.ingest(first)
    model.ingest(second)
    assert model.throughput[-1] == pytest.approx(2500 / (second["time"] - first["time"]))


def test_prometheus_source_rejects_other_endpoints():
    src = PrometheusSource("http://127.0.0.1:1/metrics")
    with pytest.raises(SourceError):
        src.convert("# TYPE foo gauge\nfoo 1\n", 0.0)
    with pytest.raises(SourceError):
        src.fetch()  # nothing listens on port 1


def test_session_round_trip_and_errors(tmp_path):
    header, frames = load_session(SESSION)
    assert header["schema"] == "looptrace.top-session/1" and len(frames) >= 10
    rec = Recorder(tmp_path / "s.jsonl", "test")
    for i, (_, snap) in enumerate(frames[:3]):
        rec.write(snap, now=float(i))
    rec.close()
    assert [t for t, _ in ReplaySource(tmp_path / "s.jsonl").frames] == [0.0, 1.0, 2.0]
    bad = tmp_path / "bad.jsonl"
    for text, why in (
        ("", "empty"),
        ("not json\n", ":1: not JSON"),
        ('{"schema": "other"}\n', "not a looptrace top session"),
        ('{"schema": "looptrace.top-session/1"}\n{"t": "x"}\n', ":2:"),
        ('{"schema": "looptrace.top-session/1"}\n', "no snapshots"),
    ):
        bad.write_text(text)
        with pytest.raises(ReplayError, match=why):
            load_session(bad)


def test_diff_loader(tmp_path):
    reqs = load_diff(DIFF)
    assert [r.first_divergence for r in reqs] == [None, 3, 2]
    assert first_divergence([1, 2], [1, 2]) is None
    path = tmp_path / "d.json"
    path.write_text(json.dumps(DIFF))
    assert load_diff(path)[1].id == "req-1"
    path.write_text('{"requests": [{"a_tokens": [1], "b_tokens": "x"}]}')
    with pytest.raises(DiffDataError, match=r"requests\[0\].b_tokens"):
        load_diff(path)
    with pytest.raises(DiffDataError):
        load_diff(FIXTURES / "missing.json")
