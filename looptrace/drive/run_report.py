"""`looptrace run`'s report as text: JSON, CSV rows or the vLLM-style tables (serving, latency, engine
and KV, CUDA graphs)."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table


def render(data: dict[str, Any], fmt: str) -> str:
    """The report as JSON, CSV (section, metric, value) or the tables (fmt: json, csv or table)."""
    if fmt == "json":
        return json.dumps(data, indent=2, default=str)
    if fmt == "csv":
        return _csv(data)
    console = Console(width=120, record=True, file=io.StringIO(), force_terminal=False)
    console.print(Group(*summary_renderables(data)))
    return console.export_text().rstrip()


def _csv(data: dict[str, Any]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["section", "metric", "value"])
    for section in ("metrics", "engine", "kv"):
        for key, value in data[section].items():
            if not isinstance(value, (dict, list)):
                writer.writerow([section, key, value])
    for name, counters in data["cuda_graphs"].items():
        for key, value in counters.items():
            writer.writerow([f"cuda_graphs.{name}", key, value])
    return buf.getvalue().rstrip()


def _workload_text(workload: Any) -> str:
    """`burst (concurrency 8, prompt_len 64, ...)` from the header's workload dict."""
    if not isinstance(workload, dict):
        return str(workload or "")
    items = ", ".join(f"{k} {v}" for k, v in workload.items() if k != "kind" and v is not None)
    return f"{workload.get('kind', '?')} ({items})"


def summary_renderables(data: dict[str, Any]) -> list:
    h, m = data["header"], data["metrics"]
    out: list = [_head_panel(h)]
    if m.get("interrupted"):
        out.append(
            f"[bold yellow]INTERRUPTED[/]: {m['interrupted_requests']} request(s) in flight were stopped "
            f"(incomplete, not failed), {m['unsubmitted_requests']} never submitted; latency and throughput "
            "cover the completed requests"
        )
    out += [_serving_table(m), _latency_table(m), _engine_kv_table(data["engine"], data["kv"])]
    if data["cuda_graphs"]:
        out.append(_graphs_table(data["cuda_graphs"]))
    return out


def _head_panel(h: dict[str, Any]) -> Panel:
    q = {k: escape(str(v)) for k, v in h.items() if isinstance(v, (str, int))}  # paths, names: not markup
    head = (
        f"[bold]{q['model_preset']}[/] ({q['family']}, {q['loops']} loops, weights: {q['weights']})  "
        f"device {q['device']}  dtype {q['dtype']}\nrecipe [bold]{q['recipe']}[/]"
        + (f" + {escape(', '.join(h['overrides']))}" if h["overrides"] else "")
        + f"   workload {escape(_workload_text(h.get('workload')))}\n[dim]{q['preset_note']}[/]"
    )
    return Panel(head, title="looptrace run", expand=False)


def _serving_table(m: dict[str, Any]) -> Table:
    t = Table(title="Serving", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("Completed / failed requests", f"{m['completed']} / {m['failed']}"),
        (
            "Output tokens: completed requests / all sampled",
            f"{m['total_output_tokens']} / {m['tokens_sampled']}",
        ),
        ("Duration (s)", f"{m['duration']:.2f}"),
        ("Output throughput (tok/s)", f"{m['output_throughput']:.1f}"),
        ("Total throughput (tok/s)", f"{m['total_token_throughput']:.1f}"),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Engine steps / output token", f"{m['steps_per_output_token']:.2f}"),
        ("Submissions / output token", f"{m['submissions_per_output_token']:.2f}"),
        ("Peak KV usage", f"{100 * m['peak_kv_usage']:.1f} %"),
    ]
    for r in rows:
        t.add_row(*r)
    return t


def _latency_table(m: dict[str, Any]) -> Table:
    lat = Table(title="Latency (ms)", title_justify="left")
    lat.add_column("metric")
    for col in ("Mean", "P50", "P90", "P99"):
        lat.add_column(col, justify="right")
    names = {"ttft": "TTFT", "tpot": "TPOT (excl. 1st token)", "itl": "ITL", "e2el": "E2EL"}
    for key, label in names.items():
        lat.add_row(label, *(f"{m[f'{p}_{key}_ms']:.2f}" for p in ("mean", "median", "p90", "p99")))
    return lat


def _engine_kv_table(e: dict[str, Any], kv: dict[str, Any]) -> Table:
    eng = Table(title="Engine and KV", title_justify="left")
    eng.add_column("item")
    eng.add_column("value", justify="right")
    eng.add_row("Steps by stage", ", ".join(f"{k} {v}" for k, v in sorted(e["steps_by_stage"].items())))
    eng.add_row("KV layout / planes", f"{kv['layout']} / {kv['planes']}")
    eng.add_row("KV pool capacity (tokens)", f"{kv['capacity_tokens']:,}")
    eng.add_row(
        "KV slots per token: reserved / live / dead",
        f"{kv['reserved_slots_per_token']} / {kv['live_slots_per_token']} / {kv['dead_slots_per_token']}",
    )
    eng.add_row(
        "KV bytes per token: reserved / live",
        f"{kv['reserved_bytes_per_token']:,} / {kv['live_bytes_per_token']:,}",
    )
    pc = kv["prefix_cache"]
    if kv["prefix_caching"]:
        eng.add_row(
            "Prefix cache hit tokens / queried", f"{pc['prefix_hit_tokens']} / {pc['prefix_query_tokens']}"
        )
    return eng


def _graphs_table(graphs: dict[str, Any]) -> Table:
    g = Table(title="CUDA graphs", title_justify="left")
    for col in ("graph", "captures", "replays", "fallbacks", "reasons"):
        g.add_column(col, justify="right" if col in ("captures", "replays", "fallbacks") else "left")
    for name, c in graphs.items():
        reasons = ", ".join(f"{k} {v}" for k, v in c["fallback_reasons"].items()) or "-"
        style = "bold yellow" if c["fallbacks"] else None
        g.add_row(name, str(c["captures"]), str(c["replays"]), str(c["fallbacks"]), reasons, style=style)
    return g
