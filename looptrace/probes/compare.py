"""Two traces (any engine) or saved `trace analyze` reports side by side: the `trace compare` data.

Each side is reduced to the `trace analyze --format json` shape (`looptrace.probes.report.to_dict`), so a
saved report and a raw trace compare the same way. Rows: the totals, the op categories and the ops (category
× op × layer), per token of each side, with the ratio B/A of the per-token values (null where A is 0).

Like with like: each side's per-token divisor has a unit (`token_unit`: output tokens of decode steps,
prompt tokens of prefill steps, tokens of mixed steps, steps, or none). Where the units differ, the B/A
ratios divide different things (a prefill's per-prompt-token time against a decode's per-output-token
time): the comparison says so in a WARNING note and in `same_unit`, and the `phases` rows compare what is
alike, each engine phase per its own token, where both sides have that phase.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import gzip
import io
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

import looptrace
from looptrace.input_files import InputError, check_regular_file, read_json
from looptrace.probes import events
from looptrace.probes.capture import find_capture_dir, load_captures
from looptrace.probes.counters import analyze
from looptrace.probes.events import TraceError
from looptrace.probes.report import to_dict

SCHEMA = "looptrace.trace_compare/1"
REPORT_SCHEMA_PREFIX = "looptrace.profile/"
# totals shown first, in this order; any other numeric total follows (the table shows only these)
TOTALS_ORDER = (
    "wall_us", "gpu_busy_us", "gpu_idle_us", "gpu_us", "host_us", "kernels", "eager_launches",
    "graph_launches", "syncs", "copy_kernels", "htod", "dtoh", "memset",
)  # fmt: skip
CSV_FIELDS = (
    "section",
    "key",
    "category",
    "op",
    "layer",
    "a_total",
    "b_total",
    "a_per_token",
    "b_per_token",
    "ratio",
    "a_calls",
    "b_calls",
    "a_pct_of_peak",
    "b_pct_of_peak",
)


# --- loading -----------------------------------------------------------------------------------------


def _peek(path: Path, n: int = 4096) -> str:
    """The first characters of a (possibly gzipped) file; "" when unreadable (the loader then says why)."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
            return fh.read(n)
    except (OSError, EOFError, zlib.error):  # zlib.error: a corrupt gzip stream
        return ""


def _load_report(path: Path) -> dict[str, Any]:
    try:
        data = read_json(path)
    except InputError as exc:
        raise TraceError(str(exc)) from None
    if not isinstance(data, dict) or not isinstance(data.get("totals"), dict):
        raise TraceError(f"{path}: not a `trace analyze --format json` report (no 'totals' object)")
    return data


def load_side(
    path: Path, window: str, device: str | None, capture: Path | None = None
) -> tuple[dict[str, Any], str]:
    """A trace or a saved report as the `to_dict` report shape, and which it was ("trace" | "report");
    raises TraceError. A trace's graph replays are attributed through `capture`, else the
    capture_traces/ folder beside it (as `trace analyze` does)."""
    try:  # before the peek: a fifo would block it, a device never end it
        check_regular_file(path)
    except InputError as exc:
        raise TraceError(str(exc)) from None
    if REPORT_SCHEMA_PREFIX in _peek(path):  # a saved report names its schema in its first line
        return _load_report(path), "report"
    result, header, _ = analyze_file(path, capture, window=window, device=device)
    return to_dict(result, header), "trace"


def analyze_file(path: Path, capture: Path | None, **options: Any) -> tuple[Any, dict[str, Any], list | None]:
    """`trace analyze` of the trace at `path` (`options`: looptrace.probes.counters.analyze's): the
    analysis, its header and the capture graphs used (None: none); raises TraceError."""
    with _collector_paused():
        trace = events.load_chrome_trace(path)  # a module attribute: tests swap it
        if not trace.events:
            raise TraceError(f"{path}: no complete ('ph': 'X') events in the trace")
        captures = trace_captures(path, capture)
        result = analyze(trace, captures=captures, **options)
    header = {"trace": str(path), "window": result.counters.window, "mode": result.counters.mode}
    return result, header, captures


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a trace is read and analysed. Why: the analysis holds
    millions of live objects (an 11 MB Huginn trace: 388k events and their contexts) and builds few
    cycles, so every full collection walks the whole heap for nothing: 16.4 s -> 9.9 s on that trace
    (2 cores), the same output and peak memory. Reference counting still frees everything as usual."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def trace_captures(path: Path, folder: Path | None) -> list[Any] | None:
    """Graphs of the given capture folder, else of the one beside the trace (a broken one is an error
    either way: it was meant for this trace)."""
    folder = folder or find_capture_dir(path)
    return load_captures(folder) if folder is not None else None


# --- comparison rows ---------------------------------------------------------------------------------


def _tokens(report: dict[str, Any]) -> float:
    tokens = report.get("tokens") or 1
    return float(tokens) if tokens > 0 else 1.0


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def totals_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    ta, tb = a.get("totals") or {}, b.get("totals") or {}
    keys = [k for k in TOTALS_ORDER if k in ta or k in tb]
    keys += [
        k
        for k in [*ta, *tb]
        if k not in keys and (_num(ta.get(k)) is not None or _num(tb.get(k)) is not None)
    ]
    keys = list(dict.fromkeys(keys))
    na, nb = _tokens(a), _tokens(b)
    rows = []
    for k in keys:
        va, vb = _num(ta.get(k)) or 0.0, _num(tb.get(k)) or 0.0
        pa, pb = va / na, vb / nb
        rows.append(
            {
                "section": "totals",
                "key": k,
                "a_total": va,
                "b_total": vb,
                "a_per_token": pa,
                "b_per_token": pb,
                "ratio": _ratio(pa, pb),
            }
        )
    return rows


def _category_items(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """category -> {gpu_us, per_token_us, share}: the report's `categories`, else its by-op breakdown
    (looptrace's own ops, from the lt ranges) so that older reports still compare."""
    tokens = _tokens(report)
    items: dict[str, dict[str, Any]] = {}
    rows = report.get("categories")
    if not isinstance(rows, list):
        rows = [
            {"category": r.get("op"), "gpu_us": r.get("gpu_us")}
            for r in (report.get("breakdown") or {}).get("by_op", [])
        ]
    total = sum(_num(r.get("gpu_us")) or 0.0 for r in rows)
    for r in rows:
        name = str(r.get("category"))
        us = _num(r.get("gpu_us")) or 0.0
        per_tok = _num(r.get("per_token_us"))
        share = _num(r.get("share"))
        item = items.setdefault(name, {"gpu_us": 0.0, "per_token_us": 0.0, "share": 0.0})
        item["gpu_us"] += us
        item["per_token_us"] += per_tok if per_tok is not None else us / tokens
        item["share"] += share if share is not None else (100.0 * us / total if total else 0.0)
    return items


def _by_time(a: dict[Any, dict[str, Any]], b: dict[Any, dict[str, Any]]) -> list[Any]:
    """Keys of both sides, the larger per-token time of the two first (ties by key, for a stable order)."""

    def larger(k: Any) -> float:
        return max(a.get(k, {}).get("per_token_us", 0.0), b.get(k, {}).get("per_token_us", 0.0))

    return sorted(dict.fromkeys([*a, *b]), key=lambda k: (-larger(k), str(k)))


def category_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    ca, cb = _category_items(a), _category_items(b)
    order = _by_time(ca, cb)
    rows = []
    for k in order:
        ia, ib = ca.get(k, {}), cb.get(k, {})
        pa, pb = ia.get("per_token_us", 0.0), ib.get("per_token_us", 0.0)
        rows.append(
            {
                "section": "categories",
                "key": k,
                "category": k,
                "a_total": ia.get("gpu_us", 0.0),
                "b_total": ib.get("gpu_us", 0.0),
                "a_per_token": pa,
                "b_per_token": pb,
                "ratio": _ratio(pa, pb),
                "a_share": ia.get("share", 0.0),
                "b_share": ib.get("share", 0.0),
            }
        )
    return rows


def _op_items(report: dict[str, Any], by_layer: bool = False) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(category, op, layer) -> summed row: the report's `ops`, else its top kernels by time. Without
    `by_layer` the layers of an op are summed (layer "")."""
    rows = report.get("ops")
    if not isinstance(rows, list):
        rows = [
            {"category": "kernel", "op": r.get("name"), "calls": r.get("count"), "gpu_us": r.get("total_us")}
            for r in (report.get("top_kernels") or {}).get("by_time", [])
        ]
    items: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        layer = r.get("layer") if by_layer else None
        op = str(r.get("op")) + (f" [{r['shape']}]" if r.get("shape") else "")  # GEMM/attention shapes apart
        key = (str(r.get("category")), op, "" if layer is None else str(layer))
        item = items.setdefault(key, {"gpu_us": 0.0, "calls": 0, "floor_us": 0.0, "pct_of_peak": None})
        item["gpu_us"] += _num(r.get("gpu_us")) or 0.0
        item["calls"] += int(_num(r.get("calls")) or 0)
        pct = _num(r.get("pct_of_peak"))
        if pct is not None:  # summed rows: the share of the summed floor in the summed time
            item["floor_us"] += pct / 100.0 * (_num(r.get("gpu_us")) or 0.0)
            item["pct_of_peak"] = 100.0 * item["floor_us"] / item["gpu_us"] if item["gpu_us"] else None
    return items


def op_rows(
    a: dict[str, Any], b: dict[str, Any], top: int | None = None, by_layer: bool = False
) -> list[dict[str, Any]]:
    oa, ob = _op_items(a, by_layer), _op_items(b, by_layer)
    na, nb = _tokens(a), _tokens(b)
    for items, n in ((oa, na), (ob, nb)):
        for item in items.values():
            item["per_token_us"] = item["gpu_us"] / n
    keys = _by_time(oa, ob)
    rows = []
    for k in keys[:top] if top else keys:
        ia, ib = oa.get(k, {}), ob.get(k, {})
        pa, pb = ia.get("gpu_us", 0.0) / na, ib.get("gpu_us", 0.0) / nb
        rows.append(
            {
                "section": "ops",
                "key": "/".join(k),
                "category": k[0],
                "op": k[1],
                "layer": k[2] or None,
                "a_total": ia.get("gpu_us", 0.0),
                "b_total": ib.get("gpu_us", 0.0),
                "a_per_token": pa,
                "b_per_token": pb,
                "ratio": _ratio(pa, pb),
                "a_calls": ia.get("calls", 0),
                "b_calls": ib.get("calls", 0),
                "a_pct_of_peak": ia.get("pct_of_peak"),
                "b_pct_of_peak": ib.get("pct_of_peak"),
            }
        )
    return rows


OUTPUT_TOKEN, PROMPT_TOKEN, MIXED_TOKEN = "output token", "prompt token", "token of mixed steps"
STEP, WINDOW = "step", "window (no token count)"


def token_unit(report: dict[str, Any]) -> str:
    """What one "token" of a report's per-token values is: from its engine phases where it has them,
    else from where its token count came from (`tokens_source`) and its window."""
    window = str(report.get("window") or "").lower()
    # A window of forwards (a trace without step annotations) is one phase; its phases cover every forward.
    if window.startswith(("decode forwards", "prefill forwards")):
        return OUTPUT_TOKEN if window.startswith("decode") else PROMPT_TOKEN
    phases = {p.get("phase") for p in report.get("phases") or [] if isinstance(p, dict) and p.get("steps")}
    if phases == {"decode"}:
        return OUTPUT_TOKEN
    if phases == {"prefill"}:
        return PROMPT_TOKEN
    if phases:
        return MIXED_TOKEN
    source = str(report.get("tokens_source") or "").lower()
    if "output tokens" in source:
        return OUTPUT_TOKEN
    if "prompt tokens" in source:
        return PROMPT_TOKEN
    if "token markers" in source:
        return PROMPT_TOKEN if "prefill" in window else OUTPUT_TOKEN
    if "step-marker" in source:
        return STEP
    if source.startswith("given"):
        return "token (given)"
    return WINDOW


def phase_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Like with like: each engine phase both sides have, device time per token of that phase's unit."""

    def by_phase(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {p["phase"]: p for p in report.get("phases") or [] if isinstance(p, dict) and "phase" in p}

    pa, pb = by_phase(a), by_phase(b)
    rows = []
    for phase in (k for k in pa if k in pb):
        ia, ib = pa[phase], pb[phase]
        va, vb = _num(ia.get("per_token_us")), _num(ib.get("per_token_us"))
        rows.append(
            {
                "section": "phases",
                "key": phase,
                "unit": ia.get("unit"),
                "a_total": _num(ia.get("gpu_us")) or 0.0,
                "b_total": _num(ib.get("gpu_us")) or 0.0,
                "a_per_token": va,
                "b_per_token": vb,
                "ratio": _ratio(va, vb),
            }
        )
    return rows


def _run_info(label: str, path: Path, report: dict[str, Any], source: str) -> dict[str, Any]:
    device = report.get("device")
    return {
        "label": label,
        "path": str(path),
        "source": source,
        "tokens": report.get("tokens"),
        "token_unit": token_unit(report),
        "tokens_source": report.get("tokens_source"),
        "mode": report.get("mode"),
        "window": report.get("window"),
        "device": device.get("name") if isinstance(device, dict) else device,
    }


def compare_reports(
    a: dict[str, Any],
    b: dict[str, Any],
    labels: tuple[str, str],
    paths: tuple[Path, Path],
    top: int | None = None,
    sources: tuple[str, str] = ("report", "report"),
    by_layer: bool = False,
) -> dict[str, Any]:
    notes = []
    for label, report in zip(labels, (a, b)):
        if not isinstance(report.get("categories"), list):
            notes.append(f"{label}: no 'categories' rows in its report; its by-op breakdown stands in")
        if not isinstance(report.get("ops"), list):
            notes.append(f"{label}: no 'ops' rows in its report; its top kernels by time stand in")
    units = (token_unit(a), token_unit(b))
    same_unit = units[0] == units[1]
    phases = phase_rows(a, b)
    if not same_unit:
        like = "; the phases rows compare like with like" if phases else ""
        notes.insert(
            0,
            f"WARNING: per-token units differ ({labels[0]}: per {units[0]}, {labels[1]}: per {units[1]}): "
            f"the B/A ratios divide different things{like}",
        )
    return {
        "schema": SCHEMA,
        "tool": {"name": "looptrace", "version": looptrace.__version__},
        "labels": list(labels),
        "runs": [_run_info(*run) for run in zip(labels, paths, (a, b), sources)],
        "same_unit": same_unit,
        "totals": totals_rows(a, b),
        "categories": category_rows(a, b),
        "ops": op_rows(a, b, top, by_layer),
        "phases": phases,
        "notes": notes,
    }


# --- rendering ---------------------------------------------------------------------------------------


def _ratio_text(row: dict[str, Any]) -> str:
    ratio = row["ratio"]
    if ratio is not None:
        return f"{ratio:.2f}×" if ratio >= 0.1 or ratio == 0 else f"{ratio:.2g}×"  # 0.0031×, not 0.00×
    return "–" if not row["b_per_token"] else "new"


def _v(x: float | None, decimals: int = 2) -> str:
    return "–" if x is None else f"{x:,.{decimals}f}"


def render_tables(data: dict[str, Any], console: Any) -> None:
    """The comparison as Rich tables: runs, totals, op categories and ops, then the notes."""
    la, lb = data["labels"]
    console.print(_runs_table(data["runs"]))
    console.print(_totals_table(data["totals"], la, lb, data.get("same_unit", True)))
    console.print(_categories_table(data["categories"], la, lb))
    console.print(_ops_table(data["ops"], la, lb))
    if data.get("phases"):
        console.print(_phases_table(data["phases"], la, lb))
    for note in data["notes"]:
        style = "bold yellow" if note.startswith("WARNING") else None
        console.print(f"note: {escape(note)}", style=style)


def _runs_table(runs: list[dict[str, Any]]) -> Any:
    table = Table(title="runs", title_justify="left")
    for col in ("", "path", "tokens", "per", "tokens from", "window", "device"):
        table.add_column(col)
    for r in runs:
        table.add_row(
            r["label"],
            r["path"],
            str(r["tokens"]),
            str(r.get("token_unit") or "–"),
            str(r["tokens_source"] or "–"),
            str(r["window"] or "–"),
            str(r["device"] or "–"),
        )
    return table


def _totals_table(rows: list[dict[str, Any]], la: str, lb: str, same_unit: bool = True) -> Any:
    units = "" if same_unit else " (per-token units differ: see the note)"
    table = Table(title=f"{lb} vs {la}: totals per token{units}", title_justify="left")
    for col, just in (
        ("counter", "left"),
        (f"{la} /tok", "right"),
        (f"{lb} /tok", "right"),
        ("B/A", "right"),
    ):
        table.add_column(col, justify=just)
    for r in (r for r in rows if r["key"] in TOTALS_ORDER):
        table.add_row(r["key"], _v(r["a_per_token"]), _v(r["b_per_token"]), _ratio_text(r))
    return table


def _categories_table(rows: list[dict[str, Any]], la: str, lb: str) -> Any:
    table = Table(title=f"{lb} vs {la}: GPU time per token by op category", title_justify="left")
    for col in ("category", f"{la} µs/tok", f"{la} %", f"{lb} µs/tok", f"{lb} %", "B/A"):
        table.add_column(col, justify="left" if col == "category" else "right")
    for r in rows:
        table.add_row(
            r["category"],
            _v(r["a_per_token"]),
            _v(r["a_share"], 1),
            _v(r["b_per_token"]),
            _v(r["b_share"], 1),
            _ratio_text(r),
        )
    return table


def _phases_table(rows: list[dict[str, Any]], la: str, lb: str) -> Any:
    table = Table(title=f"{lb} vs {la}: engine phases, like with like", title_justify="left")
    for col in ("phase", "per", f"{la} µs/tok", f"{lb} µs/tok", "B/A"):
        table.add_column(col, justify="left" if col in ("phase", "per") else "right")
    for r in rows:
        table.add_row(
            r["key"], str(r["unit"] or "–"), _v(r["a_per_token"]), _v(r["b_per_token"]), _ratio_text(r)
        )
    return table


def _ops_table(rows: list[dict[str, Any]], la: str, lb: str) -> Any:
    table = Table(title=f"{lb} vs {la}: ops per token (by GPU time)", title_justify="left")
    for col in ("category", "op", "layer"):
        table.add_column(col, no_wrap=True, overflow="ellipsis", max_width=60 if col == "op" else None)
    numbers = (
        f"{la} calls",
        f"{lb} calls",
        f"{la} µs/tok",
        f"{lb} µs/tok",
        "B/A",
        f"{la} %peak",
        f"{lb} %peak",
    )
    for col in numbers:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["category"],
            r["op"],
            r["layer"] or "",
            str(r["a_calls"]),
            str(r["b_calls"]),
            _v(r["a_per_token"]),
            _v(r["b_per_token"]),
            _ratio_text(r),
            _v(r["a_pct_of_peak"], 1),
            _v(r["b_pct_of_peak"], 1),
        )
    return table


def to_csv(data: dict[str, Any]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for section in ("totals", "categories", "ops", "phases"):
        writer.writerows(data.get(section) or [])
    return buf.getvalue()
