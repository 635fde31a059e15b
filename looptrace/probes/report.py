"""Rendering of an `Analysis`: Rich tables (Table A4 shape first), JSON (`looptrace.profile/1`) and CSV.

Numbers are right-aligned with fixed decimals and units in the headers; a pageable copy in the window is
shown as a warning row, never filtered out (conventions §2).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

import looptrace
from looptrace.probes.counters import NONE, Analysis, Counters, GroupStat, KernelStat
from looptrace.probes.findings import Finding, find
from looptrace.probes.opstats import OpRow

SCHEMA = "looptrace.profile/1"
COMPARE_SCHEMA = "looptrace.compare/1"
WARN = "bold yellow"
NAME_WIDTH = 72

# Table A4 columns: (header, counter, scale, decimals, per token?). `pageable` is a window count there.
A4_COLUMNS: tuple[tuple[str, str, float, int, bool], ...] = (
    ("H2D\n/tok", "htod", 1.0, 2, True),
    ("D2H\n/tok", "dtoh", 1.0, 2, True),
    ("D2H B\n/tok", "dtoh_bytes", 1.0, 1, True),
    ("pageable\n(window)", "pageable", 1.0, 0, False),
    ("syncs\n/tok", "syncs", 1.0, 2, True),
    ("copy kern.\n/tok", "copy_kernels", 1.0, 1, True),
    ("kernels\n/tok", "kernels", 1.0, 1, True),
    ("launches\n/tok", "eager_launches", 1.0, 1, True),
    ("graph launches\n/tok", "graph_launches", 1.0, 2, True),
    ("GPU\nms/tok", "gpu_us", 1e-3, 3, True),
    ("host\nms/tok", "host_us", 1e-3, 3, True),
)

# Every counter with the label and unit shown in the detail and comparison tables.
COUNTER_LABELS = {
    "kernels": "kernels",
    "eager_launches": "eager launches",
    "graph_launches": "graph launches",
    "graph_kernels": "graph kernels",
    "htod": "memcpy H2D",
    "dtoh": "memcpy D2H",
    "dtod": "memcpy D2D",
    "memcpy_other": "memcpy other",
    "htod_bytes": "H2D bytes (B)",
    "dtoh_bytes": "D2H bytes (B)",
    "dtod_bytes": "D2D bytes (B)",
    "pageable": "pageable memcpy",
    "pinned": "pinned memcpy",
    "memset": "memset",
    "syncs": "blocking syncs",
    "sync_stream": "  stream sync",
    "sync_device": "  device sync",
    "sync_event": "  event sync",
    "sync_memcpy": "  synchronous memcpy",
    "sync_unknown": "  unknown sync",
    "stream_wait": "stream waits (not blocking)",
    "event_query": "event queries (polls, not blocking)",
    "scalar_reads": "host scalar reads",
    "copy_kernels": "copy/cast kernels",
    "gpu_us": "GPU time (µs)",
    "host_us": "host time (µs)",
    "submissions": "submissions",
    "gpu_busy_us": "GPU busy, union (µs)",
    "graph_gap_us": "GPU idle inside graph replays (µs)",
    "gpu_idle_us": "GPU idle in the window (µs)",
    "wall_us": "wall, GPU timeline (µs)",
}
OPS_SHOWN = 15  # op rows in the table (the JSON has them all, per layer)


def tool_version() -> str:
    return getattr(looptrace, "__version__", "0+unknown")


def _fmt(value: float, decimals: int) -> str:
    return f"{value:,.{decimals}f}"


def _is_warning(name: str, value: float) -> bool:
    return name == "pageable" and value > 0


def _time_header(mode: str) -> str:
    return "GPU" if mode == "gpu" else "CPU op"


TIME_MEASURED = {
    "gpu": "GPU time: kernels, memcpy and memset on the device timeline",
    "cpu": "CPU op time: leaf CPU ops (the trace has no kernel events)",
}
# JSON keys that hold the measured time. They say `gpu_` whatever the mode; in CPU mode each also gets a
# `cpu_op_` twin with the same value, and the `gpu_` one stays for one release (see README, JSON output).
_GPU_TIME_KEYS = ("gpu_us", "gpu_us_per_token")


def label_time_keys(data: Any, mode: str) -> Any:
    """`data` (dicts and lists, in place) with a `cpu_op_us` twin beside every `gpu_us` key (and
    `cpu_op_us_per_token` beside `gpu_us_per_token`) when the time measured is CPU op time."""
    if mode == "gpu":
        return data
    if isinstance(data, dict):
        for key in [k for k in data if k in _GPU_TIME_KEYS]:
            data[key.replace("gpu_", "cpu_op_", 1)] = data[key]
        for value in data.values():
            label_time_keys(value, mode)
    elif isinstance(data, list):
        for item in data:
            label_time_keys(item, mode)
    return data


# --- tables ---------------------------------------------------------------------------------------------


def header_table(header: dict[str, Any]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in header.items():
        grid.add_row(str(key), str(value))
    return grid


def counters_table(rows: Sequence[tuple[str, Counters]], title: str = "Per-token counters") -> Table:
    """Table A4 shape: one row per (label, Counters)."""
    table = Table(title=title, title_justify="left")
    table.add_column("run", overflow="fold")
    gpu = any(c.mode == "gpu" for _, c in rows)
    for header, *_ in A4_COLUMNS:
        table.add_column(header if gpu else header.replace("GPU", "CPU op"), justify="right")
    for label, c in rows:
        totals, per_token = c.totals(), c.per_token()
        cells = []
        for _, key, scale, decimals, per_tok in A4_COLUMNS:
            value = (per_token if per_tok else totals)[key] * scale
            text = _fmt(value, decimals)
            cells.append(Text(text, style="bold red") if _is_warning(key, value) else text)
        warn = c.pageable > 0
        table.add_row(label, *cells, style=WARN if warn else None)
    return table


def timeline_table(rows: Sequence[tuple[str, Counters]], title: str = "Wall time per token") -> Table | None:
    """Where each run's window wall time goes on the GPU timeline (GPU traces only): GPU busy, idle
    between the kernels of a graph replay, and idle outside replays (the GPU waiting for the host: launches,
    syncs, scheduling). Shares of the wall time in brackets."""
    rows = [(label, c) for label, c in rows if c.gpu_busy_us is not None]
    if not rows:
        return None
    table = Table(title=f"{title}: GPU busy vs idle", title_justify="left")
    table.add_column("run", overflow="fold")
    for header in (
        "wall\nms/tok",
        "GPU busy\nms/tok",
        "idle inside graph\nreplays ms/tok",
        "idle, waiting\non host ms/tok",
    ):
        table.add_column(header, justify="right")
    for label, c in rows:
        wall = c.wall_us if c.wall_us is not None else c.host_us
        gaps = min(c.graph_gap_us or 0.0, c.gpu_idle_us or 0.0)
        parts = (c.gpu_busy_us or 0.0, gaps, (c.gpu_idle_us or 0.0) - gaps)
        share = [f" ({100 * us / wall:.0f}%)" if wall else "" for us in parts]
        cells = [_fmt(us / 1e3 / c.tokens, 3) + s for us, s in zip(parts, share, strict=True)]
        table.add_row(label, _fmt(wall / 1e3 / c.tokens, 3), *cells)
    return table


def op_compare_table(
    a: Analysis, b: Analysis, labels: tuple[str, str], title: str = "Kernels by op, per token"
) -> Table:
    """Both runs' kernels and GPU time per token by op, side by side (ops of either run)."""
    table = Table(title=title, title_justify="left")
    table.add_column("op")
    for label in labels:
        table.add_column(f"{label}\nkernels/tok", justify="right")
        table.add_column(f"{label}\n{_time_header(a.counters.mode)} µs/tok", justify="right")
    by_op = [{s.key[0]: s for s in x.breakdown.by_op} for x in (a, b)]
    ops = sorted(
        set(by_op[0]) | set(by_op[1]), key=lambda op: -max(d[op].gpu_us if op in d else 0 for d in by_op)
    )
    for op in ops:
        cells = []
        for stats, x in zip(by_op, (a, b), strict=True):
            s = stats.get(op)
            tokens = x.counters.tokens
            cells += [_fmt(s.kernels / tokens, 1), _fmt(s.gpu_us / tokens, 1)] if s else ["–", "–"]
        table.add_row(op, *cells)
    return table


def detail_table(c: Counters) -> Table:
    """Every counter: window total, per token, per step."""
    table = Table(title=f"Counters ({c.window}; tokens={c.tokens}, steps={c.steps})", title_justify="left")
    table.add_column("counter")
    for header in ("total", "/tok", "/step"):
        table.add_column(header, justify="right")
    per_token, per_step = c.per_token(), c.per_step()
    for key, total in c.totals().items():
        label = COUNTER_LABELS.get(key, key).replace("GPU", _time_header(c.mode))
        decimals = 1 if isinstance(total, float) else 0
        step = _fmt(per_step[key], 2) if per_step else "–"
        style = WARN if _is_warning(key, total) else None
        table.add_row(label, _fmt(total, decimals), _fmt(per_token[key], 2), step, style=style)
    return table


def group_table(title: str, columns: Sequence[str], stats: Sequence[GroupStat], c: Counters) -> Table:
    """Kernel attribution table: key columns, then Instances, /tok, share and time per token."""
    table = Table(title=title, title_justify="left")
    for name in columns:
        table.add_column(name)
    table.add_column("Instances", justify="right")
    table.add_column("kernels /tok", justify="right")
    table.add_column("share %", justify="right")
    table.add_column(f"{_time_header(c.mode)} µs/tok", justify="right")
    for s in stats:
        share = 100.0 * s.kernels / c.kernels if c.kernels else 0.0
        table.add_row(
            *s.key,
            f"{s.kernels:,}",
            _fmt(s.kernels / c.tokens, 2),
            _fmt(share, 1),
            _fmt(s.gpu_us / c.tokens, 1),
        )
    return table


def kernels_table(title: str, stats: Sequence[KernelStat], c: Counters) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("name", max_width=NAME_WIDTH, overflow="ellipsis", no_wrap=True)
    for header in ("Instances", "/tok", "Total (µs)", "Avg (µs)"):
        table.add_column(header, justify="right")
    for s in stats:
        table.add_row(
            s.name, f"{s.count:,}", _fmt(s.count / c.tokens, 2), _fmt(s.total_us, 1), _fmt(s.avg_us, 2)
        )
    return table


def sites_table(analysis: Analysis) -> Table:
    """Where syncs and copies come from: API call x stage x op (hidden syncs show up here)."""
    c = analysis.counters
    table = Table(title="Syncs and copies by site", title_justify="left")
    for col in ("what", "API call", "stage", "op"):
        table.add_column(col)
    table.add_column("Count", justify="right")
    table.add_column("/tok", justify="right")
    for site in analysis.sites:
        polls = ("wait", "query")
        warn = "pageable" in site.what or (
            site.what.startswith("sync") and not any(p in site.what for p in polls)
        )
        table.add_row(
            site.what,
            site.api,
            site.stage,
            site.op,
            f"{site.count:,}",
            _fmt(site.count / c.tokens, 2),
            style=WARN if warn else None,
        )
    return table


def category_table(analysis: Analysis) -> Table | None:
    """Device time per op category, share and per token. Kernel rows count kernels (they add up to the
    kernels counter); memcpy and memset rows count those operations; the title says what it holds."""
    if not analysis.categories:
        return None
    c = analysis.counters
    kernels = sum(r.kernels for r in analysis.categories)
    held = [f"{kernels:,} {'kernels' if c.mode == 'gpu' else 'leaf CPU ops'}"]
    held += [
        f"{r.events:,} {r.category}{'s' if r.events != 1 else ''}"
        for r in analysis.categories
        if r.category in ("memcpy", "memset")
    ]
    title = f"{_time_header(c.mode)} time by op category ({' + '.join(held)})"
    table = Table(title=title, title_justify="left")
    table.add_column("category")
    for header in ("Instances", "share %", f"{_time_header(c.mode)} µs", "µs/tok"):
        table.add_column(header, justify="right")
    for r in analysis.categories:
        table.add_row(
            r.category,
            f"{r.events or r.kernels:,}",
            _fmt(r.share, 1),
            _fmt(r.gpu_us, 1),
            _fmt(r.per_token_us, 2),
        )
    return table


def phase_table(analysis: Analysis) -> Table | None:
    """Engine steps per phase: decode per output token, prefill per prompt token."""
    if not analysis.phases:
        return None
    table = Table(title="Engine steps by phase", title_justify="left")
    table.add_column("phase")
    time = _time_header(analysis.counters.mode)
    for header in ("steps", "tokens", "unit", f"{time} ms", f"{time} µs/token"):
        table.add_column(header, justify="right")
    for p in analysis.phases:
        per = _fmt(p.per_token_us, 2) if p.per_token_us is not None else "–"
        table.add_row(p.phase, f"{p.steps:,}", f"{p.tokens:,}", p.unit, _fmt(p.gpu_us / 1e3, 3), per)
    return table


def structure_text(analysis: Analysis) -> Text | None:
    """One line on a looped model's structure (`Analysis.structure`), e.g. "Loop structure: prelude 2
    layers · 4 layers × 32 loops · coda 2 layers (inferred; 99.6 % of GPU time attributed)"."""
    s = analysis.structure
    if s is None:
        return None
    parts = [f"prelude {s.prelude_layers} layers"] if s.prelude_layers else []
    parts.append(f"{s.layers_per_loop} layers × {s.loops} loops")
    parts += [f"coda {s.coda_layers} layers"] if s.coda_layers else []
    time = _time_header(analysis.counters.mode)
    text = Text("Loop structure: ", style="bold")
    text.append(" · ".join(parts) + f" ({s.source}; {100 * s.coverage:.1f} % of {time} time attributed)")
    return text


def _sum_opt(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v or 0.0 for v in values)


def ops_by_name(rows: Sequence[OpRow]) -> list[dict[str, Any]]:
    """Op rows summed over layers (the table's view): time, calls, layers, and the roofline position of
    the summed cost where every layer's row has one."""
    groups: dict[tuple[str, str, str | None], list[OpRow]] = {}
    for r in rows:
        groups.setdefault((r.category, r.op, r.shape), []).append(r)
    out = []
    for (category, op, shape), rs in groups.items():
        us = sum(r.gpu_us for r in rs)
        nbytes, flops = _sum_opt([r.bytes for r in rs]), _sum_opt([r.flops for r in rs])
        pcts = [r.pct_of_peak for r in rs]
        pct = (
            None
            if any(p is None for p in pcts)
            else sum((p or 0) * r.gpu_us for p, r in zip(pcts, rs, strict=True)) / (us or 1)
        )
        out.append({
            "category": category, "op": op, "shape": shape,
            "layers": len({r.layer for r in rs if r.layer is not None}),
            "calls": sum(r.calls for r in rs), "kernels": sum(r.kernels for r in rs), "gpu_us": us,
            "bytes": nbytes, "flops": flops,
            "achieved_tbps": nbytes / us / 1e6 if nbytes is not None and us else None,
            "achieved_tflops": flops / us / 1e6 if flops is not None and us else None,
            "pct_of_peak": pct, "bound": rs[0].bound,
        })  # fmt: skip
    return sorted(out, key=lambda d: -d["gpu_us"])


def ops_table(analysis: Analysis) -> Table | None:
    """The ops with the most device time (summed over layers), with bytes, FLOPs and roofline share."""
    if not analysis.ops:
        return None
    c = analysis.counters
    title = f"Top ops by {_time_header(c.mode)} time" + (
        f" (roofline: {analysis.device})" if analysis.device else ""
    )
    table = Table(title=title, title_justify="left")
    table.add_column("category")
    table.add_column("op", max_width=48, overflow="ellipsis", no_wrap=True)
    table.add_column("shape", max_width=20, overflow="ellipsis", no_wrap=True)
    for header in (
        "layers",
        "calls",
        "µs/tok",
        "MB/call",
        "GFLOP/call",
        "TB/s",
        "TFLOP/s",
        "% peak",
        "bound",
    ):
        table.add_column(header, justify="right")
    for d in ops_by_name(analysis.ops)[:OPS_SHOWN]:
        calls = d["calls"] or 1
        table.add_row(
            d["category"], d["op"], d["shape"] or "", str(d["layers"] or "–"), f"{d['calls']:,}",
            _fmt(d["gpu_us"] / c.tokens, 2), _opt(d["bytes"], 1e-6 / calls, 2),
            _opt(d["flops"], 1e-9 / calls, 2), _opt(d["achieved_tbps"], 1, 2),
            _opt(d["achieved_tflops"], 1, 1), _opt(d["pct_of_peak"], 1, 0), d["bound"] or "–",
        )  # fmt: skip
    return table


def _opt(value: float | None, scale: float, decimals: int) -> str:
    return "–" if value is None else _fmt(value * scale, decimals)


def findings_text(found: Sequence[Finding]) -> Group:
    """The findings, largest saving first: the cost, where, evidence, the fix and its estimated saving."""
    lines: list[Text] = [Text("Findings (largest estimated saving first)", style="italic")]
    if not found:
        lines.append(
            Text(
                "none: no cost in this window reaches the thresholds of `looptrace.probes.findings`",
                style="dim",
            )
        )
    for i, f in enumerate(found, 1):
        lines.append(Text(f"{i}. {f.kind}: {f.cost}", style="bold"))
        lines.append(Text(f"   where: {f.where}"))
        lines.append(Text(f"   evidence: {f.evidence}"))
        lines.append(Text(f"   fix: {f.remedy}"))
        saving = f"{f.saving_us_per_token / 1e3:,.3f} ms/token ({f.saving_pct_of_wall:.0f} % of the wall)"
        lines.append(Text(f"   saving: ~{saving}; estimated as {f.estimate}", style="dim"))
    return Group(*lines)


def report_renderables(analysis: Analysis, header: dict[str, Any]) -> list[Any]:
    c, b = analysis.counters, analysis.breakdown
    label = str(header.get("label") or header.get("recipe") or c.window.split(" ")[0])
    formulas = Text("\n".join(b.formulas)) if b.formulas else Text("no kernels in the window", style="dim")
    notes = Text()
    for note in analysis.notes:
        notes.append(f"• {note}\n", style=WARN if note.startswith("WARNING") else "dim")
    timeline = timeline_table([(label, c)])
    optional = (phase_table(analysis), category_table(analysis), ops_table(analysis))
    return [
        header_table(header),
        counters_table([(label, c)]),
        *([timeline] if timeline is not None else []),
        *(t for t in optional if t is not None),
        *([structure] if (structure := structure_text(analysis)) is not None else []),
        detail_table(c),
        sites_table(analysis),
        group_table("Kernels by stage", ["stage"], b.by_stage, c),
        group_table("Kernels by op", ["op"], b.by_op, c),
        Group(Text("Kernels per token by op", style="italic"), formulas),
        group_table("Kernels by op and layer role", ["op", "role"], b.by_op_role, c),
        *([group_table("Kernels by op and loop", ["op", "loop"], b.by_loop, c)] if b.has_loops else []),
        kernels_table("Top kernels by Instances", analysis.top_by_count, c),
        kernels_table("Top kernels by total time", analysis.top_by_time, c),
        findings_text(find(analysis)),
        notes,
    ]


def render_report(analysis: Analysis, header: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    for item in report_renderables(analysis, header):
        console.print(item)
        console.print()


# --- machine output -------------------------------------------------------------------------------------


def _group_dicts(columns: Sequence[str], stats: Sequence[GroupStat], c: Counters) -> list[dict[str, Any]]:
    return [
        dict(zip(columns, s.key, strict=True))
        | {
            "kernels": s.kernels,
            "kernels_per_token": s.kernels / c.tokens,
            "share_pct": 100.0 * s.kernels / c.kernels if c.kernels else 0.0,
            "gpu_us": s.gpu_us,
        }
        for s in stats
    ]


def _loop_dicts(columns: Sequence[str], stats: Sequence[GroupStat], c: Counters) -> list[dict[str, Any]]:
    """`_group_dicts` with the loop as an int (null outside loops) and the layer null outside layers."""
    rows = _group_dicts(columns, stats, c)
    for row in rows:
        row["loop"] = None if row["loop"] == NONE else int(row["loop"])
        if "layer" in row and row["layer"] == NONE:
            row["layer"] = None
    return rows


def _kernel_dicts(stats: Sequence[KernelStat]) -> list[dict[str, Any]]:
    return [{"name": s.name, "count": s.count, "total_us": s.total_us, "avg_us": s.avg_us} for s in stats]


def to_dict(analysis: Analysis, header: dict[str, Any]) -> dict[str, Any]:
    c, b = analysis.counters, analysis.breakdown
    data = {
        "schema": SCHEMA,
        "tool": {"name": "looptrace", "version": tool_version()},
        "header": header,
        "mode": c.mode,
        "window": c.window,
        "tokens": c.tokens,
        "tokens_source": analysis.tokens_source,
        "steps": c.steps,
        "step_marker": analysis.step_marker,
        "totals": c.totals(),
        "per_token": c.per_token(),
        "per_step": c.per_step(),
        "syncs_by_kind": c.syncs_by_kind,
        "breakdown": {
            "by_op": _group_dicts(["op"], b.by_op, c),
            "by_stage": _group_dicts(["stage"], b.by_stage, c),
            "by_op_role": _group_dicts(["op", "role"], b.by_op_role, c),
            "formulas": b.formulas,
            "by_loop": _loop_dicts(["op", "loop"], b.by_loop, c),
            "by_op_layer_loop": _loop_dicts(["op", "layer", "loop"], b.by_op_layer_loop, c),
        },
        "top_kernels": {
            "by_count": _kernel_dicts(analysis.top_by_count),
            "by_time": _kernel_dicts(analysis.top_by_time),
        },
        "sites": [
            {
                "what": x.what,
                "api": x.api,
                "stage": x.stage,
                "op": x.op,
                "count": x.count,
                "per_token": x.count / c.tokens,
            }
            for x in analysis.sites
        ],
        "device": analysis.device,
        "structure": dataclasses.asdict(analysis.structure) if analysis.structure is not None else None,
        "phases": [
            {"phase": p.phase, "steps": p.steps, "tokens": p.tokens, "unit": p.unit, "gpu_us": p.gpu_us,
             "per_token_us": p.per_token_us}
            for p in analysis.phases
        ],
        "categories": [
            {"category": r.category, "kernels": r.kernels, "events": r.events, "gpu_us": r.gpu_us,
             "share": r.share, "per_token_us": r.per_token_us}
            for r in analysis.categories
        ],
        "ops": [dataclasses.asdict(r) for r in analysis.ops],
        "graph_replays": _replay_dict(analysis),
        "findings": [f.to_dict() for f in find(analysis)],
        "notes": analysis.notes,
    }  # fmt: skip
    data["time_measured"] = TIME_MEASURED.get(c.mode, c.mode)
    return label_time_keys(data, c.mode)


def _replay_dict(analysis: Analysis) -> dict[str, Any] | None:
    r = analysis.replays
    if r is None:
        return None
    return {"kernels": r.kernels, "gpu_us": r.gpu_us, "attributed_us": r.attributed_us,
            "attributed_share": r.attributed_share}  # fmt: skip


def to_json(analysis: Analysis, header: dict[str, Any], indent: int | None = 2) -> str:
    return json.dumps(to_dict(analysis, header), indent=indent, default=str)


def to_csv(analysis: Analysis, header: dict[str, Any]) -> str:
    """Long format, one value per row: `section,key,metric,value` (loads straight into a dataframe)."""
    d = to_dict(analysis, header)
    rows: list[tuple[str, str, str, Any]] = [("meta", "schema", "value", SCHEMA)]
    rows += [("header", str(k), "value", v) for k, v in header.items()]
    rows += [("meta", k, "value", d[k]) for k in ("mode", "window", "tokens", "tokens_source", "steps")]
    for metric in ("totals", "per_token", "per_step"):
        rows += [("counters", k, metric, v) for k, v in (d[metric] or {}).items()]
    sections = (
        ("by_op", ["op"]), ("by_stage", ["stage"]), ("by_op_role", ["op", "role"]),
        ("by_loop", ["op", "loop"]), ("by_op_layer_loop", ["op", "layer", "loop"]),
    )  # fmt: skip
    for section, cols in sections:
        for item in d["breakdown"][section]:
            key = "/".join(NONE if item[col] is None else str(item[col]) for col in cols)
            rows += [(section, key, m, v) for m, v in item.items() if m not in cols]
    rows += [("formula", line.split(":", 1)[0], "text", line) for line in d["breakdown"]["formulas"]]
    for item in d["categories"]:
        rows += [("category", item["category"], m, v) for m, v in item.items() if m != "category"]
    for item in d["ops"]:
        key = "/".join(str(item[k]) for k in ("category", "op", "layer"))
        rows += [("op", key, m, v) for m, v in item.items() if m not in ("category", "op", "layer")]
    for item in d["findings"]:
        rows += [("finding", item["kind"], m, v) for m, v in item.items() if m != "kind"]
    for section in ("by_count", "by_time"):
        for item in d["top_kernels"][section]:
            rows += [(f"top_{section}", item["name"], m, v) for m, v in item.items() if m != "name"]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(("section", "key", "metric", "value"))
    writer.writerows(rows)
    return buf.getvalue()


# --- comparison (profile --compare) ---------------------------------------------------------------------


def _ratio(a: float, b: float) -> float | None:
    return b / a if a else None


def compare_rows(a: Counters, b: Counters) -> list[dict[str, Any]]:
    """Per counter: totals and per-token values of both runs and the per-token ratio B/A (None if A is 0)."""
    ta, tb, pa, pb = a.totals(), b.totals(), a.per_token(), b.per_token()
    return [
        {
            "counter": key,
            "a_total": ta.get(key, 0),
            "b_total": tb.get(key, 0),
            "a_per_token": pa.get(key, 0.0),
            "b_per_token": pb.get(key, 0.0),
            "ratio": _ratio(pa.get(key, 0.0), pb.get(key, 0.0)),
        }
        for key in [*ta, *(k for k in tb if k not in ta)]
    ]


def _ratio_text(row: dict[str, Any]) -> str:
    if row["ratio"] is not None:
        return f"{row['ratio']:.2f}×"
    return "–" if row["b_per_token"] == 0 else "inf"


def compare_table(
    a: Counters, b: Counters, labels: tuple[str, str] = ("A", "B"), title: str = "per token"
) -> Table:
    table = Table(title=f"{labels[1]} vs {labels[0]} ({title})", title_justify="left")
    table.add_column("counter")
    table.add_column(f"{labels[0]} /tok", justify="right")
    table.add_column(f"{labels[1]} /tok", justify="right")
    table.add_column("B/A", justify="right")
    for row in compare_rows(a, b):
        key = row["counter"]
        warn = _is_warning(key, row["a_total"]) or _is_warning(key, row["b_total"])
        label = COUNTER_LABELS.get(key, key)
        if a.mode == b.mode == "cpu":
            label = label.replace("GPU", _time_header("cpu"))
        table.add_row(
            label,
            _fmt(row["a_per_token"], 2),
            _fmt(row["b_per_token"], 2),
            _ratio_text(row),
            style=WARN if warn else None,
        )
    return table


def render_compare(
    a: Counters,
    b: Counters,
    labels: tuple[str, str] = ("A", "B"),
    console: Console | None = None,
    header: dict[str, Any] | None = None,
) -> None:
    console = console or Console()
    if header:
        console.print(header_table(header))
        console.print()
    console.print(counters_table([(labels[0], a), (labels[1], b)]))
    timeline = timeline_table([(labels[0], a), (labels[1], b)])
    if timeline is not None:
        console.print(timeline)
    console.print()
    console.print(compare_table(a, b, labels))


def compare_to_dict(
    a: Counters, b: Counters, labels: tuple[str, str] = ("A", "B"), header: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "schema": COMPARE_SCHEMA,
        "tool": {"name": "looptrace", "version": tool_version()},
        "header": header or {},
        "labels": list(labels),
        "runs": [
            {"label": lbl, "mode": c.mode, "window": c.window, "tokens": c.tokens, "steps": c.steps}
            for lbl, c in zip(labels, (a, b), strict=True)
        ],
        "rows": compare_rows(a, b),  # ratio is null where A is 0
    }


def compare_to_json(
    a: Counters, b: Counters, labels: tuple[str, str] = ("A", "B"), header: dict[str, Any] | None = None
) -> str:
    return json.dumps(compare_to_dict(a, b, labels, header), indent=2, default=str)
