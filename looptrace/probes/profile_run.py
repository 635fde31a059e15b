"""`looptrace profile`'s orchestration: build the engine of each side (a recipe + overrides), profile its
decode and prefill windows (looptrace.probes.session), add the roofline, and shape the report data.

A side is a dict: header (run_header + the profile's settings), windows (per window: the engine's counters,
the live analysis and its report dict), the profiler's raw counts against the exported trace's, and
whether a Ctrl-C cut it short.
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from looptrace.build import BuildRequest, ResolvedModel, build, run_header
from looptrace.engine.budget import check_memory, workload_needs
from looptrace.output_files import OutputError, atomic_path
from looptrace.probes.events import TraceError
from looptrace.probes.report import compare_rows, label_time_keys, to_dict
from looptrace.probes.roofline_report import profile_roofline
from looptrace.recipes import load_recipe

# A status line for `label` while a side profiles: yields a callback for progress messages, or None.
Status = Callable[[str], AbstractContextManager]


@dataclass(frozen=True)
class ProfileEngines:
    """What the engines of every side share: the user's build request and its model, resolved once (the
    sides differ in recipe and overrides)."""

    request: BuildRequest
    model: ResolvedModel


def check_options(level: str, concurrency: int, prompt_len: int, decode_steps: int | None) -> None:
    """The window options and the windows' prompts within host memory, before anything is built."""
    # deferred: loads torch: the options are checked before it
    from looptrace.probes.ranges import LEVELS
    from looptrace.probes.session import ProfileInputError

    if level not in LEVELS:
        raise ProfileInputError(f"--level '{level}': expected one of {', '.join(LEVELS)}")
    if concurrency < 1 or prompt_len < 1 or (decode_steps is not None and decode_steps < 1):
        raise ProfileInputError("--concurrency, --prompt-len and --decode-steps must be >= 1")
    check_prompts_memory(concurrency, prompt_len)


def sides_to_run(recipe: str | None, sets, compare, a_set, b_set) -> list[tuple[str, list[str]]]:
    """The (recipe, overrides) of each side (--compare A B: both), each loaded once to fail before any
    profiling."""
    if compare is None:
        return [(recipe or "base", list(sets or []))]
    runs = [(name, list(sets or []) + list(extra or [])) for name, extra in zip(compare, (a_set, b_set))]
    for name, overrides in runs:  # both sides valid before any profiling
        load_recipe(name, overrides)
    return runs


def check_prompts_memory(concurrency: int, prompt_len: int) -> None:
    """The windows' random prompts within host memory, before any engine (a huge -c used to hang)."""
    check_memory(workload_needs(concurrency, prompt_len, "--concurrency / --prompt-len"), "cpu")


def profile_side(
    recipe: str,
    sets: list[str],
    cfg,
    engines: ProfileEngines,
    trace: Path | None,
    peak: str | None,
    status: Status,
) -> dict[str, Any]:
    """Profile one (recipe, overrides) side; `trace`: where to write its Chrome trace."""
    # deferred: loads torch: the options are checked before it
    from looptrace.probes.session import plan, profile_engine

    max_len = cfg.prompt_len + 64 + (cfg.decode_steps or 0)
    side = replace(engines.request, recipe=recipe, sets=tuple(sets), max_model_len=max_len)
    setup = build(side, engines.model)
    plan(setup.engine, cfg)  # a prompt that cannot fit fails here, before any profiling
    header = run_header(setup)
    label = setup.recipe.name + (" + " + ", ".join(sets) if sets else "")
    with status(f"profiling {setup.engine.spec.name} ({label})") as line:
        say = (lambda msg: line.update(f"{label}: {msg}")) if line is not None else None
        result = profile_engine(setup.engine, cfg, trace_path=trace, progress=say)
    roofline = profile_roofline(setup.engine, result, peak)  # needs the engine's modules: before release
    header["inactive_settings"] = dict(setup.engine.inactive_settings)  # for --compare's "no effect" note
    # how the persistent loop op ran each decode row count (one launch, or layer by layer and why)
    header["loop_routes"] = {str(rows): how for rows, how in setup.engine.snapshot().loop_routes.items()}
    _release(setup)
    header.update(label=label, concurrency=cfg.concurrency, prompt_len=cfg.prompt_len, level=cfg.level)
    return _side(header, result, roofline)


def profile_sides(
    runs: list[tuple[str, list[str]]],
    cfg,
    engines: ProfileEngines,
    trace: Path | None,
    peak: str | None,
    status: Status,
) -> tuple[list[dict[str, Any]], bool]:
    """Profile each (recipe, overrides); the first side writes --trace. A Ctrl-C keeps the sides (and
    windows) that finished and skips the rest; with nothing finished it propagates."""
    sides: list[dict[str, Any]] = []
    for i, (name, overrides) in enumerate(runs):
        try:
            if i == 0 and trace is not None:
                with atomic_path(trace, "--trace") as tmp, _trace_written(trace):
                    side = profile_side(name, overrides, cfg, engines, tmp, peak, status)
                side["header"]["trace"] = str(trace)
            else:
                side = profile_side(name, overrides, cfg, engines, None, peak, status)
        except KeyboardInterrupt:
            if not sides:
                raise
            return sides, True
        sides.append(side)
        if side["interrupted"]:
            return sides, True
    return sides, False


@contextmanager
def _trace_written(trace: Path) -> Iterator[None]:
    """torch's profiler reports no error when it cannot write its trace (a full disk): the trace read
    back is then cut short. That is an OutputError naming --trace, not a broken trace of ours."""
    try:
        yield
    except TraceError as exc:
        free = shutil.disk_usage(trace.resolve().parent).free
        why = "No space left on device" if free < 1 << 20 else str(exc)
        raise OutputError(f"--trace {trace}: the profiler could not write the trace whole ({why})") from None


def _side(header: dict[str, Any], result, roofline: dict | None) -> dict[str, Any]:
    windows = {}
    for name, run in result.windows.items():
        analysis = result.analyses[name]
        windows[name] = {"engine": vars(run), "analysis": analysis, "report": to_dict(analysis, {})}
    if roofline is not None:
        mode = result.analyses["decode"].counters.mode
        windows["decode"]["report"]["roofline"] = label_time_keys(roofline, mode)  # CPU: cpu_op_ twins
    return {
        "header": header,
        "windows": windows,
        "raw_profiler_counts": result.raw_counts,
        "trace_counts": result.trace_counts,
        "interrupted": result.interrupted,
    }


def _release(setup) -> None:
    """Free the engine's KV pool before the next side of a --compare sizes its own from free memory."""
    # deferred: torch loads with the engine, not with this module
    import torch

    setup.engine = None
    gc.collect()  # the engine holds reference cycles (scheduler/block-manager callbacks)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_comparison(sides: list[dict[str, Any]], compare: bool) -> bool:
    """A --compare reports both sides once both decode windows finished; before that, side A alone."""
    return compare and len(sides) == 2 and all("decode" in s["windows"] for s in sides)


def report_data(sides: list[dict[str, Any]], compare: bool) -> dict[str, Any]:
    """The JSON report: one side (looptrace.profile/1) or both with their comparison rows."""
    if is_comparison(sides, compare):
        return {
            "schema": "looptrace.compare/1",
            "a": _jsonable(sides[0]),
            "b": _jsonable(sides[1]),
            "decode_comparison": comparison(sides),
            "prefill_comparison": comparison(sides, "prefill"),
        }
    return {"schema": "looptrace.profile/1", **_jsonable(sides[0])}


def _jsonable(side: dict[str, Any]) -> dict[str, Any]:
    """The side without live objects: header, per-window engine counters and the report dicts."""
    windows = {name: {"engine": w["engine"], **w["report"]} for name, w in side["windows"].items()}
    return {k: v for k, v in side.items() if k != "windows"} | {"windows": windows}


def comparison(sides: list[dict[str, Any]], window: str = "decode") -> list[dict[str, Any]] | None:
    """Per-counter B vs A rows of one window (None: a side lacks it, e.g. after a Ctrl-C there)."""
    if not all(window in s["windows"] for s in sides):
        return None
    a, b = (s["windows"][window]["analysis"].counters for s in sides)
    return compare_rows(a, b)
