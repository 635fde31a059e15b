"""Profile an engine: warm up, then measure a decode window and a prefill window under torch.profiler.

Order matters. Decode runs first (after a warm-up that captures the CUDA graphs the window will replay),
so no profiler session runs before graph capture (a known CUPTI pitfall leaves graph kernels untraced).
The prefill window then admits a fresh burst (new prompts, so no prefix-cache hits) inside the same
profiler session. Windows are `record_function` ranges (`lt.window/decode`, `lt.window/prefill`), and
the counters come from the exported Kineto trace, the same code path as `looptrace trace analyze`. Each
window also carries `lt.tokens/<n>` markers (tokens sampled by a step, prompt tokens prefilled), so that
`trace analyze` of the saved trace divides by the same token count as the live report.

Ctrl-C during a window stops the profiler and returns the windows that finished (`interrupted=True`);
with none finished, the KeyboardInterrupt propagates.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looptrace.engine.llm_engine import LLMEngine
from looptrace.engine.request import SamplingParams
from looptrace.probes import counters as names
from looptrace.probes import ring_clock
from looptrace.probes.counters import Analysis, analyze
from looptrace.probes.events import Trace, trace_from_profiler
from looptrace.probes.ranges import RangeProbe
from looptrace.probes.ring_clock import RingAnatomy

Progress = Callable[[str], None]


class ProfileInputError(ValueError):
    """A profile configuration the engine cannot run (one line, raised before any profiling)."""


@dataclass
class ProfileConfig:
    concurrency: int = 1
    prompt_len: int = 64
    decode_steps: int | None = None  # None: enough steps for ~8 tokens per request
    warmup_tokens: int = 2
    level: str = "op"
    seed: int = 0
    # Record every op's input shapes (torch.profiler record_shapes): the attention's key length, what the
    # dead_kv finding compares with the live context. Off by default: it adds host time to every op.
    record_shapes: bool = False


@dataclass
class WindowRun:
    """What the engine did inside one window (the trace says what the device did)."""

    name: str
    tokens: int  # output tokens sampled (decode) or prompt tokens prefilled (prefill)
    token_unit: str
    steps: int
    submissions: int
    wall_s: float
    graph: dict[str, dict[str, Any]] = field(default_factory=dict)  # per graph cache: counter deltas
    steps_by_stage: dict[str, int] = field(default_factory=dict)
    context_tokens: float | None = None  # mean KV length of a decode row over the window (roofline rows)


@dataclass
class ProfileResult:
    trace: Trace
    windows: dict[str, WindowRun]
    analyses: dict[str, Analysis]
    raw_counts: dict[str, int]  # cross-check: events as the profiler itself reports them
    trace_counts: dict[str, int]  # the same categories in the exported trace
    interrupted: bool = False  # Ctrl-C: `windows` holds the windows that finished before it
    # The persistent loop's launch, stage by stage (ring_clock.measure): empty where no op clocks itself.
    ring_clock: list[RingAnatomy] = field(default_factory=list)


def steps_per_token(engine: LLMEngine) -> int:
    """Engine steps one decode token takes per batch (`DecodeMode.steps_per_token`)."""
    return engine.snapshot().decode.steps_per_token


def default_decode_steps(engine: LLMEngine, concurrency: int) -> int:
    """~8 tokens per request: one token costs `steps_per_token` steps per batch of max_num_seqs rows."""
    batches = -(-concurrency // engine.snapshot().limits.max_num_seqs)
    return 8 * steps_per_token(engine) * batches


def _graph_snapshot(engine: LLMEngine) -> dict[str, dict[str, Any]]:
    return {
        k: {**v, "fallback_reasons": dict(v["fallback_reasons"])} for k, v in engine.graph_counters().items()
    }


def _graph_delta(before: dict, after: dict) -> dict[str, dict[str, Any]]:
    out = {}
    for name, a in after.items():
        b = before.get(
            name, {"captures": 0, "replays": 0, "fallbacks": 0, "evictions": 0, "fallback_reasons": {}}
        )
        reasons = {k: v - b["fallback_reasons"].get(k, 0) for k, v in a["fallback_reasons"].items()}
        out[name] = {k: a[k] - b[k] for k in ("captures", "replays", "fallbacks", "evictions")}
        out[name]["fallback_reasons"] = {k: v for k, v in reasons.items() if v}
    return out


class _Counting:
    """Engine-side bookkeeping for a window: steps, stages, submissions, tokens, graph counters."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps0, self.subs0 = engine.stats.steps, engine.stats.submissions
        self.stage0 = dict(engine.stats.steps_by_stage)
        self.graph0 = _graph_snapshot(engine)
        self.t0 = time.perf_counter()

    def finish(self, name: str, tokens: int, unit: str) -> WindowRun:
        e = self.engine
        stages = {k: v - self.stage0.get(k, 0) for k, v in e.stats.steps_by_stage.items()}
        return WindowRun(
            name,
            tokens,
            unit,
            e.stats.steps - self.steps0,
            e.stats.submissions - self.subs0,
            time.perf_counter() - self.t0,
            _graph_delta(self.graph0, _graph_snapshot(e)),
            {k: v for k, v in stages.items() if v},
        )


def _burst(engine: LLMEngine, n: int, prompt_len: int, max_tokens: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    high = engine.spec.vocab_size
    return [
        engine.add_request(rng.integers(0, high, prompt_len).tolist(), SamplingParams(max_tokens=max_tokens))
        for _ in range(n)
    ]


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _activities(engine: LLMEngine) -> dict[str, Any]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    kwargs: dict[str, Any] = {}
    if engine.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        with contextlib.suppress(Exception):  # sync events need a recent torch; counts still work without
            kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(
                enable_cuda_sync_events=True
            )
    return {"activities": acts, **kwargs}


@contextlib.contextmanager
def _quiet_native_stderr():
    """Some torch builds print `USDT: ... profiler_start/stop` lines from C++ on stderr at every start and
    stop. Capture the native stderr of those calls and pass on every other line (Kineto's warnings, e.g. a
    truncated GPU buffer, must stay visible)."""
    try:
        saved = os.dup(2)
    except OSError:  # no usable fd 2 (embedded interpreters): just run
        yield
        return
    with tempfile.TemporaryFile(mode="w+") as captured:
        try:
            sys.stderr.flush()
            os.dup2(captured.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured:
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)


def plan(engine: LLMEngine, cfg: ProfileConfig) -> tuple[int, int]:
    """(decode steps, max_tokens per request); ProfileInputError if a request would not fit the context."""
    decode_steps = cfg.decode_steps or default_decode_steps(engine, cfg.concurrency)
    # Enough output tokens that no request finishes inside the decode window.
    per_token_steps = steps_per_token(engine) * -(-cfg.concurrency // engine.snapshot().limits.max_num_seqs)
    max_tokens = cfg.warmup_tokens + decode_steps // max(1, per_token_steps // 2) + 4
    need = cfg.prompt_len + max_tokens - 1
    if need > engine.max_model_len:
        raise ProfileInputError(
            f"prompt length {cfg.prompt_len} + {max_tokens} output tokens need {need} KV positions; "
            f"max context of {engine.spec.name} here is {engine.max_model_len}"
        )
    return decode_steps, max_tokens


def profile_engine(
    engine: LLMEngine,
    cfg: ProfileConfig,
    *,
    trace_path: Path | None = None,
    progress: Progress | None = None,
) -> ProfileResult:
    say = progress or (lambda _msg: None)
    decode_steps, max_tokens = plan(engine, cfg)
    probe = RangeProbe(cfg.level).attach(engine)
    try:
        return _run(engine, cfg, probe, decode_steps, max_tokens, trace_path, say)
    finally:
        probe.detach()


def _mark_tokens(n: int) -> None:
    """An `lt.tokens/<n>` marker: what `trace analyze` divides by (see counters.py)."""
    if n:
        with torch.profiler.record_function(names.tokens_name(n)):
            pass


def _mean_context(engine: LLMEngine, ids: list[str]) -> float:
    """Mean tokens in context of the unfinished requests (what a decode row's attention reads)."""
    reqs = [engine.request_view(i) for i in ids]
    lens = [r.context_tokens for r in reqs if not r.finished]
    return sum(lens) / len(lens) if lens else 0.0


def _windows(engine, cfg, decode_steps, max_tokens, ids, windows, ring, say) -> None:
    """The decode window, then the prefill window; each finished one is added to `windows` (and the
    persistent loop's stage clocks, after the decode window, to `ring`)."""
    say(f"decode window: {decode_steps}+ engine steps")
    while engine.step() == []:  # start at a token boundary (right after a coda step)
        pass
    count = _Counting(engine)
    tokens = 0
    context0 = _mean_context(engine, ids)
    with torch.profiler.record_function(names.WINDOW_DECODE):
        while True:
            out = engine.step()
            tokens += len(out)
            _mark_tokens(len(out))
            if engine.stats.steps - count.steps0 >= decode_steps and out:
                break
            if not engine.has_unfinished_requests():  # every request finished: nothing left to step
                break
    windows["decode"] = count.finish("decode", tokens, "output token")
    context1 = _mean_context(engine, ids) or context0  # 0: every request finished in the window
    windows["decode"].context_tokens = (context0 + context1) / 2  # grows linearly over the window
    _sync(engine)
    for name, rows, thunk in engine.graph_bodies():  # op map for kernels inside graph replays
        with torch.profiler.record_function(f"{names.GRAPH_BODY_PREFIX}{name}/{rows}"):
            thunk()
    _sync(engine)
    with torch.profiler.record_function(names.RING_CLOCK):  # after the bodies: not in the op map
        ring.extend(ring_clock.measure(engine))
    _abort(engine, ids)

    say("prefill window: a fresh burst until every request has its first token")
    ids += _burst(engine, cfg.concurrency, cfg.prompt_len, max_tokens, cfg.seed + 1)
    count = _Counting(engine)
    with torch.profiler.record_function(names.WINDOW_PREFILL):
        while any(not engine.request_view(i).outputs for i in ids):
            engine.step()
        fresh = [engine.request_view(i) for i in ids]
        prompt_tokens = sum(r.prompt_tokens - r.cached_tokens for r in fresh)
        _mark_tokens(prompt_tokens)
    windows["prefill"] = count.finish("prefill", prompt_tokens, "prompt token")
    _sync(engine)
    _abort(engine, ids)


def _abort(engine: LLMEngine, ids: list[str]) -> None:
    while ids:
        engine.abort_request(ids.pop())


def _close_open_ranges(probe: RangeProbe) -> None:
    """After a Ctrl-C inside a step, end the step's open ranges so that the trace stays well nested."""
    with contextlib.suppress(Exception):
        while getattr(probe, "_stack", None):
            probe.pop()


def _run(engine, cfg, probe, decode_steps, max_tokens, trace_path, say) -> ProfileResult:
    say("warm-up: prefill and first decode tokens (graphs are captured here)")
    ids = _burst(engine, cfg.concurrency, cfg.prompt_len, max_tokens, cfg.seed)
    while min(len(engine.request_view(i).outputs) for i in ids) < cfg.warmup_tokens:
        engine.step()
    _sync(engine)
    windows: dict[str, WindowRun] = {}
    ring: list[RingAnatomy] = []
    interrupted = False
    activities = _activities(engine)
    activities.setdefault("record_shapes", cfg.record_shapes)
    prof = torch.profiler.profile(**activities)
    with _quiet_native_stderr():
        prof.start()
    try:
        _windows(engine, cfg, decode_steps, max_tokens, ids, windows, ring, say)
    except KeyboardInterrupt:
        interrupted = True
        _close_open_ranges(probe)
        with contextlib.suppress(Exception):  # the interrupted step may have left the engine mid-way
            _abort(engine, ids)
        if not windows:
            raise
    finally:
        with _quiet_native_stderr():
            prof.stop()
    say("exporting and analysing the trace")
    raw = _raw_counts(prof)
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or Path(tmp) / "trace.json"
        trace = trace_from_profiler(prof, path)
    analyses = {
        name: analyze(trace, tokens=w.tokens, window=name, submissions=w.submissions)
        for name, w in windows.items()
    }
    return ProfileResult(trace, windows, analyses, raw, trace_counts(trace), interrupted, ring)


CROSS_CHECK_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "cpu_op", "user_annotation", "cuda_runtime")


def _raw_counts(prof) -> dict[str, int]:
    """Independent of our trace loader: events per category as the profiler's own event list holds them
    for the whole session (compare with `trace_counts`)."""
    out = dict.fromkeys(CROSS_CHECK_CATS, 0)
    try:
        events = prof.profiler.kineto_results.events()
    except Exception:  # noqa: BLE001 - private API; the cross-check is best effort
        return out
    for e in events:
        cat = _category(e)
        if cat in out:
            out[cat] += 1
    return out


_SYNC_ACTIVITIES = ("Event Sync", "Stream Sync", "Context Sync", "Unknown Sync", "Stream Wait Event")


def _category(e) -> str:
    """Kineto category of a profiler event; torch < 2.12 has no `activity_type()`, so classify the way
    Kineto names things (device memcpy/memset/sync names, CUDA API names, annotations)."""
    if hasattr(e, "activity_type"):
        return e.activity_type()
    name = e.name()
    if str(e.device_type()).endswith("CUDA"):
        # GPU projections of record_function ranges (seen on an H200, torch 2.11) are not kernels.
        if e.is_user_annotation() or name.startswith(names.PREFIX):
            return "gpu_user_annotation"
        if name.startswith("Memcpy"):
            return "gpu_memcpy"
        if name.startswith("Memset"):
            return "gpu_memset"
        return "cuda_sync" if name in _SYNC_ACTIVITIES else "kernel"
    if e.is_user_annotation():
        return "user_annotation"
    if name.startswith(("cuda", "cu")) and not name.startswith("cudnn"):
        return "cuda_runtime"
    return "cpu_op"


def trace_counts(trace: Trace) -> dict[str, int]:
    """The same categories counted in the exported trace."""
    out = dict.fromkeys(CROSS_CHECK_CATS, 0)
    for e in trace.events:
        if e.cat in out:
            out[e.cat] += 1
    return out
