"""A live probe: every few seconds, profile a short window of serving steps and publish per-token counters.

The window runs on the engine thread between ordinary serving steps (nothing is replayed or paused:
requests keep decoding while torch.profiler records), with `probes.ranges.RangeProbe` at `step` level so
the trace carries `lt.step#`/`lt.stage/` ranges. After `prof.stop()` the export and the analysis
(`probes.counters.analyze`, the same code path as `looptrace profile`) run on a helper thread, so the
engine thread only pays for the profiler's own overhead during the window. On CPU the counters are leaf
CPU ops ("kernels" in CPU mode) and copy ops; on CUDA, kernels, memcpys and syncs. Graph replays and eager
fallbacks come from the engine's graph counters over the same window.

The cost: `prof.stop()` must run on the thread that started the profiler (stopped elsewhere, the session
records nothing), and it converts the window's events there, about 35 us per event on this CPU (ouro-tiny:
~9,000 events, 0.3 s) during which no request advances; the analysis thread then competes for the GIL. So
`looptrace serve` runs no probe unless `--probe-interval` asks for one (bench/serve_load.py --robustness
measures the ITL p99 it costs).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from looptrace.probes.counters import analyze
from looptrace.probes.events import trace_from_profiler

if TYPE_CHECKING:
    from looptrace.engine.llm_engine import LLMEngine
    from looptrace.engine.snapshot import GraphFamily

log = logging.getLogger("looptrace.serve")


def _graph_totals(families: tuple[GraphFamily, ...]) -> dict[str, Any]:
    """Replays, captures and eager fallbacks summed over the graph families, fallbacks by reason."""
    out: dict[str, Any] = {"replays": 0, "captures": 0, "fallbacks": 0, "reasons": {}}
    for g in families:
        out["replays"] += g.replays
        out["captures"] += g.captures
        out["fallbacks"] += g.fallbacks
        for reason, n in g.fallback_reasons.items():
            out["reasons"][reason] = out["reasons"].get(reason, 0) + n
    return out


def _quiet():
    """Some torch builds print `USDT: profiler_start/stop` from C++ on every start and stop: reuse the
    profiler session's filter (captures native stderr around the call, passes other lines on)."""
    try:
        # deferred: loads torch
        from looptrace.probes.session import _quiet_native_stderr

        return _quiet_native_stderr()
    except Exception:  # noqa: BLE001
        return contextlib.nullcontext()


def warm_up_profiler() -> None:
    """The first torch.profiler session imports a lot (seconds); pay that before serving, not mid-request."""
    # deferred: torch loads with the engine, not with this module
    import torch

    with _quiet():
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.start()
        torch.ones(1).add_(1)
        prof.stop()


class LiveProbe:
    """Called by the engine loop around each step (`before_step`, `after_step`). Not thread-safe except
    `result()`, which returns the latest finished window (a dict replaced whole) or None."""

    def __init__(self, engine: LLMEngine, interval_s: float = 5.0, window_steps: int | None = None) -> None:
        self.engine, self.interval_s = engine, interval_s
        loops = engine.snapshot().decode.max_loops
        # About two tokens of every running batch: one token costs loops + 2 steps (prelude, coda).
        self.window_steps = window_steps or 2 * (loops + 2)
        self._next = time.monotonic() + min(1.0, interval_s)
        self._prof = None
        self._ranges = None
        self._t0 = 0.0
        self._steps = self._tokens = 0
        self._subs0 = 0
        self._graph0: dict[str, Any] = {}
        self._result: dict[str, Any] | None = None
        self._windows = 0
        self._worker: threading.Thread | None = None
        warm_up_profiler()

    def result(self) -> dict[str, Any] | None:
        r = self._result
        if r is not None:
            r = {**r, "age_s": round(time.time() - r["finished_at"], 3)}
        return r

    # Engine-thread side -----------------------------------------------------------------------------
    def before_step(self) -> None:
        if self._prof is None and time.monotonic() >= self._next:
            if self._worker is not None and self._worker.is_alive():
                return  # the previous window is still being analysed
            self._start()

    def after_step(self, new_tokens: int) -> None:
        if self._prof is None:
            return
        self._steps += 1
        self._tokens += new_tokens
        if self._steps >= self.window_steps and self._tokens > 0:
            self._finish()
        elif self._steps >= 8 * self.window_steps or not self.engine.has_unfinished_requests():
            self.abandon() if self._tokens == 0 else self._finish()

    def abandon(self) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        self._stop(prof)
        self._next = time.monotonic() + self.interval_s

    def close(self) -> None:
        self.abandon()
        if self._worker is not None:
            self._worker.join(10.0)

    def _start(self) -> None:
        # deferred: torch loads with the engine, not with this module
        import torch

        from looptrace.probes.ranges import RangeProbe

        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.engine.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            self._ranges = RangeProbe("step", nvtx=False).attach(self.engine)
            prof = torch.profiler.profile(activities=acts)
            with _quiet():
                prof.start()
        except Exception:  # noqa: BLE001 - a profiler already running elsewhere: skip this window
            log.debug("live probe could not start a window", exc_info=True)
            if self._ranges is not None:
                self._ranges.detach()
                self._ranges = None
            self._next = time.monotonic() + self.interval_s
            return
        self._prof = prof
        self._t0 = time.perf_counter()
        self._steps = self._tokens = 0
        snap = self.engine.snapshot()
        self._subs0 = snap.stats.submissions
        self._graph0 = _graph_totals(snap.graphs)

    def _stop(self, prof: Any) -> None:
        try:
            with _quiet():
                prof.stop()
        finally:
            if self._ranges is not None:
                self._ranges.detach()
                self._ranges = None

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        self._stop(prof)
        wall = time.perf_counter() - self._t0
        snap = self.engine.snapshot()
        subs = snap.stats.submissions - self._subs0
        g1 = _graph_totals(snap.graphs)
        graphs = {k: g1[k] - self._graph0.get(k, 0) for k in ("replays", "captures", "fallbacks")}
        reasons = {
            k: v - self._graph0["reasons"].get(k, 0)
            for k, v in g1["reasons"].items()
            if v - self._graph0["reasons"].get(k, 0)
        }
        window = {"steps": self._steps, "tokens": self._tokens, "submissions": subs, "wall_s": wall}
        self._next = time.monotonic() + self.interval_s
        self._worker = threading.Thread(
            target=self._analyse, args=(prof, window, graphs, reasons), name="looptrace-probe", daemon=True
        )
        self._worker.start()

    # Helper-thread side -----------------------------------------------------------------------------
    def _analyse(self, prof: Any, window: dict, graphs: dict, reasons: dict) -> None:
        t0 = time.perf_counter()
        try:
            trace = trace_from_profiler(prof)
            c = analyze(
                trace, tokens=window["tokens"], window="all", submissions=window["submissions"]
            ).counters
        except Exception as exc:  # noqa: BLE001
            log.debug("live probe analysis failed", exc_info=True)
            self._result = {"error": f"{type(exc).__name__}: {exc}", "finished_at": time.time()}
            return
        tokens = max(1, window["tokens"])
        copies = c.htod + c.dtoh + c.dtod + c.memcpy_other + (c.copy_kernels if c.mode == "cpu" else 0)
        self._windows += 1
        self._result = {
            "mode": c.mode,
            "window": window,
            "windows": self._windows,
            "analysis_s": round(time.perf_counter() - t0, 3),
            "per_token": {
                "kernels": c.kernels / tokens,
                "copies": copies / tokens,
                "syncs": c.syncs / tokens,
                "graph_replays": graphs["replays"] / tokens,
                "eager_fallbacks": graphs["fallbacks"] / tokens,
                "steps": window["steps"] / tokens,
                "submissions": window["submissions"] / tokens,
            },
            "fallback_reasons": reasons,
            "finished_at": time.time(),
        }
