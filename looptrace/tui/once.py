"""`looptrace top --once`: one snapshot as a Rich table (for scripts and CI logs). No Textual import."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from looptrace.tui.model import fmt_ms, fmt_num, window_label


def snapshot_table(snap: dict[str, Any], label: str, throughput: float | None = None) -> Table:
    t = Table(title=Text(f"looptrace top: {label}"), title_justify="left", show_header=True)
    t.add_column("panel")
    t.add_column("metric")
    t.add_column("value", justify="right")

    def row(panel: str, metric: str, value: str) -> None:
        t.add_row(panel, Text(metric), Text(value))  # Text: a cache name or a server note is not markup

    tokens = snap.get("tokens") or {}
    row("throughput", "output tokens/s", fmt_num(throughput))
    row("throughput", "generation tokens (total)", fmt_num(tokens.get("generation_total"), 0))
    row("throughput", "prompt tokens (total)", fmt_num(tokens.get("prompt_total"), 0))
    lat = snap.get("latency") or {}
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        d = lat.get(key) or {}
        window = window_label(d)
        metric = f"{name} p50 / p99" + (f" ({window})" if window else "")
        row("latency", metric, f"{fmt_ms(d.get('p50'))} / {fmt_ms(d.get('p99'))}")
    reqs = snap.get("requests") or {}
    row("requests", "running / waiting", f"{reqs.get('running', 0)} / {reqs.get('waiting', 0)}")
    kv = snap.get("kv")
    if kv:
        row("kv", "usage", f"{100 * float(kv.get('usage') or 0):.1f} %")
        if "num_blocks" in kv:
            row(
                "kv",
                "blocks in requests / cached only / free",
                f"{kv.get('request_blocks', 0)} / {kv.get('cached_blocks', 0)} / {kv.get('free_blocks', 0)}",
            )
    else:
        row("kv", "usage", "n/a")
    eng = snap.get("engine")
    if eng:
        row("engine", "steps / token", fmt_num(eng.get("steps_per_token"), 2))
        row("engine", "submissions / token", fmt_num(eng.get("submissions_per_token"), 2))
    probe = snap.get("probe") or {}
    if probe.get("note"):
        row("probe", "state", probe["note"])
    for k, v in (probe.get("per_token") or {}).items():
        row("probe", f"{k} / token", fmt_num(v, 2))
    graphs = snap.get("graphs")
    if graphs is not None:
        caches = graphs.get("caches") or {}
        if not caches:
            row("cuda graphs", "caches", "disabled")
        for name, c in caches.items():
            row(
                "cuda graphs",
                name,
                f"{c.get('graphs', 0)} graphs, {c.get('replays', 0)} hits, "
                f"{c.get('evictions', 0)} evictions, {c.get('fallbacks', 0)} fallbacks",
            )
    prefix = snap.get("prefix") or {}
    hr = prefix.get("hit_rate")
    row("prefix cache", "hit rate", "n/a" if hr is None else f"{100 * hr:.1f} %")
    depth = snap.get("prefill_depth")
    row("prefill", "depth P", "n/a" if depth is None else f"{depth:g}")
    return t
