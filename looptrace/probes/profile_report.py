"""`looptrace profile`'s text and CSV reports: one side (counters, engine counters, roofline, prefill,
the profiler cross-check) or a --compare of two sides (B vs A per window, top kernels, roofline)."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from looptrace.analysis.diff import inactive_reason
from looptrace.probes.profile_run import comparison, is_comparison
from looptrace.probes.report import (
    compare_table,
    counters_table,
    group_table,
    header_table,
    kernels_table,
    op_compare_table,
    report_renderables,
    timeline_table,
    to_csv,
)
from looptrace.probes.roofline_report import ring_clock_table, roofline_table

# Printed under every profile report: its host time sits beside `run`'s and `bench`'s TPOT in the README.
PROFILER_OVERHEAD_NOTE = (
    "note: host ms/tok is measured under torch.profiler, which records every op and kernel launch: it is "
    "higher than the TPOT of an unprofiled `looptrace run` or `looptrace bench`. Compare counts with "
    "those, not times."
)


def _engine_table(side: dict[str, Any]) -> Table:
    t = Table(title="Engine counters in each window", title_justify="left")
    for col in (
        "window",
        "tokens",
        "steps",
        "submissions",
        "steps/tok",
        "graph replays",
        "graph captures",
        "eager fallbacks",
        "fallback reasons",
    ):
        t.add_column(col, justify="left" if col in ("window", "fallback reasons") else "right")
    for name, w in side["windows"].items():
        run = w["engine"]
        g = run["graph"]
        replays = sum(v["replays"] for v in g.values())
        captures = sum(v["captures"] for v in g.values())
        fallbacks = sum(v["fallbacks"] for v in g.values())
        reasons = ", ".join(f"{k}: {n}" for v in g.values() for k, n in v["fallback_reasons"].items()) or "-"
        style = "bold yellow" if fallbacks else None
        t.add_row(
            f"{name} (per {run['token_unit']})",
            f"{run['tokens']}",
            f"{run['steps']}",
            f"{run['submissions']}",
            f"{run['steps'] / max(run['tokens'], 1):.2f}",
            str(replays) if g else "n/a (no graphs)",
            str(captures) if g else "-",
            str(fallbacks) if g else "-",
            reasons,
            style=style,
        )
    return t


def render(sides: list[dict[str, Any]], fmt: str, compare: bool) -> str:
    """The text report (a --compare cut short before side B's decode window finished: side A alone)."""
    return render_compare(sides, fmt) if is_comparison(sides, compare) else render_single(sides[0], fmt)


def render_single(side: dict[str, Any], fmt: str) -> str:
    if fmt == "csv":
        return "\n".join(
            to_csv(w["analysis"], {"window": name, **_flat(side["header"])})
            for name, w in side["windows"].items()
        )
    if fmt == "json":
        return ""
    console = Console(width=140, record=True, file=io.StringIO(), force_terminal=False)
    decode = side["windows"]["decode"]["analysis"]
    for item in report_renderables(decode, _display_header(side)):
        console.print(item)
    console.print(_engine_table(side))
    _print_roofline(console, side)
    if "prefill" in side["windows"]:  # absent after a Ctrl-C in the prefill window
        prefill = side["windows"]["prefill"]["analysis"]
        console.print(
            counters_table(
                [(escape(side["header"]["label"]), prefill.counters)],
                title="Prefill window, per prompt token",
            )
        )
        console.print(group_table("Prefill kernels by op", ["op"], prefill.breakdown.by_op, prefill.counters))
    raw, ours = side["raw_profiler_counts"], side["trace_counts"]
    checks = ", ".join(f"{k} {raw[k]}/{ours[k]}" + ("" if raw[k] == ours[k] else " (differ)") for k in raw)
    console.print(f"cross-check, whole profiler session, profiler events / exported trace events: {checks}")
    console.print(PROFILER_OVERHEAD_NOTE, markup=False)
    return console.export_text().rstrip()


def _flat(header: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in header.items() if not isinstance(v, (dict, list))}


def _display_header(side: dict[str, Any], recipe: str | None = None) -> dict[str, Any]:
    h = side["header"]
    decode = side["windows"]["decode"]["engine"]
    keep = {
        "model": f"{h['model_preset']} ({h['family']}, {h['loops']} loops, weights {h['weights']})",
        "device": f"{h['device']}  dtype {h['dtype']}",
        "versions": ", ".join(f"{k} {v}" for k, v in h["versions"].items()),
        "recipe": recipe or h["label"],
        "window": f"decode: {decode['steps']} steps, {decode['tokens']} tokens "
        f"at concurrency {h['concurrency']}"
        f" (prompt {h['prompt_len']})",
        "ranges": h["level"],
        "note": h["preset_note"],
    }
    if "trace" in h:
        keep["trace"] = h["trace"]
    if h.get("loop_routes"):
        keep["loop op"] = loop_routes_text(h["loop_routes"])
    return {k: escape(str(v)) for k, v in keep.items()}  # paths and recipe names, not markup


def side_b_loop_routes(sides: list[dict[str, Any]], label: str) -> list[str]:
    """The shared header of a --compare is side A's: side B's loop op, if it has one, gets a line."""
    routes = sides[1]["header"].get("loop_routes")
    return [f"loop op ({label}): {loop_routes_text(routes)}"] if routes else []


def loop_routes_text(routes: dict[str, str]) -> str:
    """How the persistent loop op ran each decode row count: "1 row: one launch per loop (TMA ring); 8 rows:
    layer by layer (8 rows: the ring takes one)"."""
    return "; ".join(f"{rows} row{'' if rows == '1' else 's'}: {how}" for rows, how in routes.items())


def render_compare(sides: list[dict[str, Any]], fmt: str) -> str:
    if fmt == "json":
        return ""
    labels = tuple(escape(s["header"]["label"]) for s in sides)
    if labels[0] == labels[1]:
        labels = (f"A: {labels[0]}", f"B: {labels[1]}")
    if fmt == "csv":
        lines = ["window,counter,a_per_token,b_per_token,ratio_b_over_a"]
        for window in ("decode", "prefill"):
            for r in comparison(sides, window) or []:
                ratio = r["ratio"] if r["ratio"] is not None else ""
                lines.append(f"{window},{r['counter']},{r['a_per_token']},{r['b_per_token']},{ratio}")
        return "\n".join(lines)
    console = Console(width=140, record=True, file=io.StringIO(), force_terminal=False)
    # Model, device and versions are shared by both sides (one --model/--device); the window is side A's.
    both = f"A: {sides[0]['header']['label']}  vs  B: {sides[1]['header']['label']}"
    console.print(header_table(_display_header(sides[0], both)))
    for line in side_b_loop_routes(sides, sides[1]["header"]["label"]):
        console.print(line, markup=False)
    console.print()
    for window, unit in (("decode", "output"), ("prefill", "prompt")):
        if window == "prefill" and comparison(sides, "prefill") is None:
            continue  # absent after a Ctrl-C in the prefill window
        _print_window_comparison(console, sides, labels, window, unit)
    for s, label in zip(sides, labels):
        t = _engine_table(s)
        t.title = f"Engine counters: {label}"
        console.print(t)
    for s, label in zip(sides, labels):
        _print_roofline(console, s, f"Decode roofline per op: {label}")
    for note in no_effect_notes(sides):
        console.print(note, markup=False)
    console.print(PROFILER_OVERHEAD_NOTE, markup=False)
    return console.export_text().rstrip()


def no_effect_notes(sides: list[dict[str, Any]]) -> list[str]:
    """A setting that differs between A and B but does nothing on this device (CUDA graphs on a CPU):
    the two sides ran the same code for it, so equal counters say nothing about it (`diff`'s rule)."""
    a, b = (_flat_config(s["header"].get("config") or {}) for s in sides)
    inactive = {
        **sides[0]["header"].get("inactive_settings", {}),
        **sides[1]["header"].get("inactive_settings", {}),
    }
    notes = []
    for path in sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)):
        why = inactive_reason(path, inactive)
        if why is not None:
            notes.append(
                f"note: {path} differs between A and B but has no effect here ({why}): its effect is untested"
            )
    return notes


def _flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"cuda_graphs": {"enabled": true}} -> {"cuda_graphs.enabled": true}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= _flat_config(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat


def _print_window_comparison(
    console: Console, sides, labels: tuple[str, ...], window: str, unit: str
) -> None:
    xa, xb = (s["windows"][window]["analysis"] for s in sides)
    a, b = xa.counters, xb.counters
    title = f"{window.capitalize()} window, per {unit} token"
    console.print(counters_table([(labels[0], a), (labels[1], b)], title=title))
    timeline = timeline_table([(labels[0], a), (labels[1], b)], title=title)
    if timeline is not None:
        console.print(timeline)
    console.print(
        compare_table(a, b, labels, title="per token" if window == "decode" else "prefill, per prompt token")
    )
    console.print(op_compare_table(xa, xb, labels, title=f"{title}: kernels by op"))
    if window == "decode":  # replayed kernels carry no op range: their names say where the time goes
        for x, label in ((xa, labels[0]), (xb, labels[1])):
            console.print(
                kernels_table(f"Decode top kernels by total time: {label}", x.top_by_time, x.counters)
            )


def _print_roofline(console: Console, side: dict[str, Any], title: str = "Decode roofline per op") -> None:
    block = side["windows"].get("decode", {}).get("report", {}).get("roofline")
    if block:
        console.print(roofline_table(block, title))
        for anatomy in block.get("ring_clock") or []:  # the persistent loop's launch, stage by stage
            console.print(ring_clock_table(anatomy))
