"""`looptrace bench`'s report as text: the table, the CSV, the JSON and the speedup plot.

No CLI here: the renderers take the report data of `bench_run.report_data` (or a merged saved report) and
return text or write a figure; a bad --plot is a `BenchInputError`, a missing matplotlib a
`PlotUnavailableError` (the CLI: exit 2 and 3).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from looptrace.drive.paired import METRIC_NAMES, BenchInputError
from looptrace.output_files import atomic_path

PLOT_FORMATS = (".svg", ".png", ".pdf")


class PlotUnavailableError(RuntimeError):
    """--plot without matplotlib installed (the CLI: exit code 3)."""


def check_plot(plot: Path) -> None:
    """--plot names a figure format and matplotlib is there (checked before anything runs)."""
    if plot.suffix.lower() not in PLOT_FORMATS:
        raise BenchInputError(
            f"--plot {plot}: expected a {', '.join(PLOT_FORMATS)} file (the suffix picks the format)"
        )
    try:
        # deferred: optional plotting library
        import matplotlib  # noqa: F401  (only checked here; drawn after the runs)
    except ImportError:
        raise PlotUnavailableError(
            "--plot needs matplotlib: pip install 'looptrace[plot]' (or matplotlib), or leave --plot out"
        ) from None


def cell_line(result) -> str:
    """One measured cell (a `paired.CellResult`) as the progress line on stderr."""
    st, ratio = result.stats(), result.ratios()["output_tok_s"]
    a, b = st["a"]["output_tok_s"].mean, st["b"]["output_tok_s"].mean
    return f"{result.cell.label}: A {a:.1f} tok/s, B {b:.1f} tok/s, B/A {_num(ratio['mean'], 2)}"


def render(data: dict[str, Any], fmt: str) -> str:
    """The report as `fmt` text: table, json or csv (an `OutputFormat` compares equal to its name)."""
    if fmt == "json":
        return json.dumps(data, indent=2, default=str)
    if fmt == "csv":
        return csv_text(data)
    console = Console(width=160, record=True, file=io.StringIO(), force_terminal=False)
    console.print(Group(*table(data)))
    return console.export_text().rstrip()


def _num(value, digits: int = 1) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and not math.isfinite(value))
        else f"{value:.{digits}f}"
    )


def _spread(s: dict, digits: int = 1) -> str:
    sp = s["spread"]
    return f"{_num(s['mean'], digits)} [{_num(sp['min'], digits)}-{_num(sp['max'], digits)}]"


def arm_text(arm: dict) -> str:
    return arm["recipe"] + (f" + {', '.join(arm['overrides'])}" if arm["overrides"] else "")


def table(data: dict[str, Any]) -> list:
    """The report as Rich renderables: the header panel, the cells' table, interrupted and failed lines."""
    h = data["header"]
    out: list = [Panel(_head(h), title="looptrace bench", expand=False)]
    if h["interrupted"]:
        out.append(
            f"[bold yellow]INTERRUPTED[/]: {len(data['cells'])} of {len(h['cells_planned'])} cells completed"
        )
    refs = any(c["reference"] for c in data["cells"])
    title = "Output throughput (tok/s), TTFT p50 and TPOT p50 (ms)" + (
        "; [dim]paper[/]: Table 2, base / ExactLoop on a GH200" if refs else ""
    )
    t = Table(title=title, title_justify="left")
    for col in ("cell", "A tok/s", "B tok/s", escape("B/A [per round]"), "TTFT A / B", "TPOT A / B"):
        t.add_column(col, justify="left" if col == "cell" else "right")
    for c in data["cells"]:
        t.add_row(*_row(c))
    out.append(t)
    failed = [c["cell"] for c in data["cells"] if any(run.get("failed") for run in c["runs"])]
    if failed:
        out.append(f"[bold red]failed requests[/] in {', '.join(failed)} (see the JSON runs)")
    return out


def _head(h: dict[str, Any]) -> str:
    kept = h["runs"] - h["dropped_runs_per_arm"]
    arm_a, arm_b = (escape(arm_text(h["arms"][arm])) for arm in ("a", "b"))
    return (
        f"A = [bold]{arm_a}[/]   B = [bold]{arm_b}[/]\n"
        f"device {escape(h['device'])}  dtype {h['dtype']}  looptrace {h['versions']['looptrace']}  "
        f"torch {h['versions']['torch']}\n"
        f"{h['runs']} runs per arm, interleaved A,B; each arm's first run dropped; "
        f"{escape('mean [min-max]')} of the other {kept}\n"
        + "\n".join(f"[dim]{escape(cmd)}[/]" for cmd in h.get("commands", [h["command"]]))
    )


def _row(c: dict[str, Any]) -> list[str]:
    """One cell's table row; the paper's number under the measured one, same units, where it has one."""
    sa, sb, r = c["stats"]["a"], c["stats"]["b"], c["ratio"]["output_tok_s"]
    row = [
        c["cell"],
        _spread(sa["output_tok_s"]),
        _spread(sb["output_tok_s"]),
        f"{_num(r['mean'], 2)} [{_num(r['min'], 2)}-{_num(r['max'], 2)}]",
        f"{_num(sa['ttft_p50_ms']['mean'])} / {_num(sb['ttft_p50_ms']['mean'])}",
        f"{_num(sa['tpot_p50_ms']['mean'], 2)} / {_num(sb['tpot_p50_ms']['mean'], 2)}",
    ]
    ref = c["reference"]
    if not ref:
        return row
    tok, ttft, tpot = ref["output_tok_s"], ref["ttft_p50_ms"], ref["tpot_p50_ms"]
    paper = [
        "",
        f"{tok['a']:.1f}",
        f"{tok['b']:.1f}",
        f"{tok['ratio']:.2f}",
        f"{ttft['a']:.1f} / {ttft['b']:.1f}",
        f"{tpot['a']:.2f} / {tpot['b']:.2f}",
    ]
    return [m if not p else f"{m}\n[dim]paper {p}[/]" for m, p in zip(row, paper)]


CSV_COLUMNS = (
    "cell", "model", "prompt_len", "output_len", "concurrency", "metric",
    "a_mean", "a_min", "a_max", "a_std", "b_mean", "b_min", "b_max", "b_std",
    "ratio", "ratio_min", "ratio_max", "kept_runs", "paper_a", "paper_b", "paper_ratio",
)  # fmt: skip


def csv_text(data: dict[str, Any]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for c in data["cells"]:
        for name in METRIC_NAMES:
            a, b, r = c["stats"]["a"][name], c["stats"]["b"][name], c["ratio"][name]
            ref = (c["reference"] or {}).get(name, {})
            writer.writerow([
                c["cell"], c["model"], c["prompt_len"], c["output_len"], c["concurrency"], name,
                a["mean"], a["spread"]["min"], a["spread"]["max"], a["spread"]["std"],
                b["mean"], b["spread"]["min"], b["spread"]["max"], b["spread"]["std"],
                r["mean"], r["min"], r["max"], a["n"],
                ref.get("a", ""), ref.get("b", ""), ref.get("ratio", ""),
            ])  # fmt: skip
    return buf.getvalue().rstrip()


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# Plot ---------------------------------------------------------------------------------------------------
def write_plot(data: dict[str, Any], path: Path) -> None:
    """Speedup B/A (output tok/s) vs C, one series per model and shape; the paper's ratios, where a cell
    has one, as hollow markers on a dashed line. matplotlib (not plotext, which draws only in the
    terminal): the file is a figure for the committed results. Figure() draws without pyplot's global
    state or a GUI backend."""
    # deferred: optional plotting library
    from matplotlib.figure import Figure

    h = data["header"]
    series: dict[str, list[dict]] = {}
    for c in data["cells"]:
        series.setdefault(f"{c['model']} {c['prompt_len']}/{c['output_len']}", []).append(c)
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    ax.axhline(1.0, color="0.6", linewidth=0.8)
    xs_all: set[int] = set()
    for i, (name, cs) in enumerate(series.items()):
        xs_all.update(_plot_series(ax, name, sorted(cs, key=lambda c: c["concurrency"]), f"C{i % 10}"))
    ax.set_xscale("log", base=2)
    if xs_all:
        ax.set_xticks(sorted(xs_all), [str(x) for x in sorted(xs_all)])
    ax.set_xlabel("concurrent requests C")
    ax.set_ylabel("speedup B/A (output tok/s)")
    arms = [_shorten(f"{arm.upper()} = {arm_text(h['arms'][arm])}", 60) for arm in ("b", "a")]
    ax.set_title(f"{arms[0]}  vs  {arms[1]}\n{h['device']}", fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fmt = path.suffix.lower().lstrip(".")
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt)  # reproducible files
    with atomic_path(path, "--plot") as tmp:
        fig.savefig(tmp, format=fmt, metadata=metadata)


def _plot_series(ax, name: str, cs: list[dict], color: str) -> set[int]:
    """One model and shape: the measured ratios with their per-round range, the paper's as a dashed line;
    the concurrencies drawn."""
    xs_all: set[int] = set()
    pts = [(c["concurrency"], c["ratio"]["output_tok_s"]) for c in cs if c["ratio"]["output_tok_s"]["mean"]]
    if pts:
        xs = [x for x, _ in pts]
        ys = [r["mean"] for _, r in pts]
        lo = [max(0.0, y - (r["min"] if r["min"] is not None else y)) for y, (_, r) in zip(ys, pts)]
        hi = [max(0.0, (r["max"] if r["max"] is not None else y) - y) for y, (_, r) in zip(ys, pts)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", color=color, capsize=3, label=f"{name} measured")
        xs_all.update(xs)
    refs = [(c["concurrency"], c["reference"]["output_tok_s"]["ratio"]) for c in cs if c["reference"]]
    if refs:
        ax.plot(
            *zip(*refs),
            linestyle="--",
            marker="o",
            markerfacecolor="none",
            color=color,
            label=f"{name} paper (GH200)",
        )
        xs_all.update(x for x, _ in refs)
    return xs_all
