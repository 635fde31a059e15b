"""The dashboard's state: the latest snapshot plus short histories derived from successive snapshots.

Pure Python (no Textual): the app feeds every snapshot to `ingest()` as it arrives (sampling) and the
screens read the model when they redraw (drawing), so a slow terminal never slows sampling down.
"""

from __future__ import annotations

from collections import deque
from typing import Any

HISTORY = 120  # points per sparkline

SORT_KEYS = ("arrival", "stage", "loop", "tokens")


class DashboardModel:
    def __init__(self, history: int = HISTORY) -> None:
        self.latest: dict[str, Any] | None = None
        self.snapshots = 0
        self.throughput: deque[float] = deque(maxlen=history)  # output tokens/s between snapshots
        self.ttft_p50: deque[float] = deque(maxlen=history)
        self.ttft_p99: deque[float] = deque(maxlen=history)
        self.tpot_p50: deque[float] = deque(maxlen=history)
        self.tpot_p99: deque[float] = deque(maxlen=history)
        self.depth: deque[float] = deque(maxlen=history)  # prefill depth P (only when reported)
        self.kv_usage: deque[float] = deque(maxlen=history)
        self._prev_time: float | None = None
        self._prev_tokens: float | None = None
        self.sort_key = SORT_KEYS[0]

    # Sampling -------------------------------------------------------------------------------------------
    def ingest(self, snap: dict[str, Any]) -> None:
        self.latest = snap
        self.snapshots += 1
        t = snap.get("time")
        tokens = (snap.get("tokens") or {}).get("generation_total")
        if (
            isinstance(t, (int, float))
            and isinstance(tokens, (int, float))
            and self._prev_time is not None
            and self._prev_tokens is not None
            and t > self._prev_time
        ):
            self.throughput.append(max(0.0, (tokens - self._prev_tokens) / (t - self._prev_time)))
        if isinstance(t, (int, float)) and isinstance(tokens, (int, float)):
            self._prev_time, self._prev_tokens = t, tokens
        lat = snap.get("latency") or {}
        for key, p50s, p99s in (
            ("ttft", self.ttft_p50, self.ttft_p99),
            ("tpot", self.tpot_p50, self.tpot_p99),
        ):
            d = lat.get(key) or {}
            if d.get("p50") is not None:
                p50s.append(float(d["p50"]))
                p99s.append(float(d.get("p99") or d["p50"]))
        depth = snap.get("prefill_depth")
        if isinstance(depth, (int, float)):
            self.depth.append(float(depth))
        kv = snap.get("kv") or {}
        if isinstance(kv.get("usage"), (int, float)):
            self.kv_usage.append(float(kv["usage"]))

    def cycle_sort(self) -> str:
        self.sort_key = SORT_KEYS[(SORT_KEYS.index(self.sort_key) + 1) % len(SORT_KEYS)]
        return self.sort_key

    # Reading --------------------------------------------------------------------------------------------
    def section(self, name: str) -> Any:
        return (self.latest or {}).get(name)

    def sorted_requests(self) -> list[dict[str, Any]] | None:
        reqs = (self.section("requests") or {}).get("list")
        if reqs is None:
            return None
        order = {"prefill": 0, "prelude": 1, "recurrent": 2, "coda": 3, "waiting": 4}
        keys = {
            "arrival": lambda r: -float(r.get("age_s", 0)),
            "stage": lambda r: (order.get(r.get("stage"), 9), -float(r.get("age_s", 0))),
            "loop": lambda r: (-int(r.get("loop", 0)), -float(r.get("age_s", 0))),
            "tokens": lambda r: (-int(r.get("tokens", 0)), -float(r.get("age_s", 0))),
        }
        return sorted(reqs, key=keys[self.sort_key])


def window_label(latency: dict[str, Any]) -> str:
    """Over what the percentiles are: a Prometheus source says (its histograms count since the server
    started); a looptrace server's snapshot carries no window ("")."""
    if latency.get("window") == "total":
        return "since start"
    seconds = latency.get("window_s")
    if latency.get("window") == "interval" and isinstance(seconds, (int, float)):
        return f"last {seconds:.0f} s" if seconds >= 10 else f"last {seconds:.1f} s"
    return ""


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def fmt_num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"
