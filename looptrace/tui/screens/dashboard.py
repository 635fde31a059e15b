"""The live dashboard: every panel, redrawn from the `DashboardModel` by `refresh_from()`."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from looptrace.tui.model import DashboardModel, fmt_ms, fmt_num, window_label
from looptrace.tui.widgets.cache_panel import CachePanel
from looptrace.tui.widgets.graphs_panel import GraphsPanel
from looptrace.tui.widgets.kv_panel import KVPanel
from looptrace.tui.widgets.probe_panel import ProbePanel
from looptrace.tui.widgets.requests_panel import RequestsPanel
from looptrace.tui.widgets.spark_panel import SparkPanel

TOP_ROWS, BOTTOM_ROWS = 7, 11  # the panels' full heights (borders included), as in looptrace.tcss
REQUESTS_MIN_ROWS = 3
CHROME_ROWS = 3  # header, status line, footer


def grid_rows(height: int) -> str:
    """The dashboard's `grid-rows` for a screen `height` lines high."""
    middle = 2 + 1 + 1 + REQUESTS_MIN_ROWS  # borders, summary, table header, rows
    spare = height - CHROME_ROWS - middle
    deficit = max(0, TOP_ROWS + BOTTOM_ROWS - spare)  # taken half from the top row, half from the bottom
    top = max(4, TOP_ROWS - deficit // 2)  # 4: a panel keeps its border and two lines
    bottom = max(4, BOTTOM_ROWS - (deficit - deficit // 2))
    return f"{top} 1fr {bottom}"


class DashboardScreen(Screen[None]):
    BINDINGS = [Binding("tab", "app.focus_next", "Panel", key_display="Tab")]

    def compose(self) -> ComposeResult:
        yield Header()
        with Grid(id="dashboard"):
            yield SparkPanel("Output tokens/s", id="throughput")
            yield SparkPanel("TTFT", id="ttft")
            yield SparkPanel("TPOT", id="tpot")
            yield RequestsPanel(id="requests")
            yield ProbePanel(id="probe")
            yield KVPanel(id="kv")
            yield GraphsPanel(id="graphs")
            yield CachePanel(id="cache")
        yield Static("", id="status-line")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#throughput").focus()

    def on_resize(self) -> None:
        """Small terminals (80x24): shrink the top and bottom rows before the requests panel, which keeps
        its summary, the table header and at least REQUESTS_MIN_ROWS requests."""
        self.query_one("#dashboard", Grid).set_styles(f"grid-rows: {grid_rows(self.size.height)};")

    def refresh_from(self, model: DashboardModel, status: str) -> None:
        tp = list(model.throughput)
        cur = tp[-1] if tp else None
        peak = max(tp) if tp else None
        self.query_one("#throughput", SparkPanel).show(
            tp, [f"[b]{fmt_num(cur)}[/] tok/s", f"peak {fmt_num(peak)}"]
        )
        lat = model.section("latency") or {}
        for key, p50s in (("ttft", model.ttft_p50), ("tpot", model.tpot_p50)):
            d = lat.get(key) or {}
            pieces = [f"p50 [b]{fmt_ms(d.get('p50'))}[/]", f"p99 [b]{fmt_ms(d.get('p99'))}[/]"]
            window = window_label(d)
            pieces.append(f"n={d.get('n', 0)}" + (f" ({window})" if window else ""))
            self.query_one(f"#{key}", SparkPanel).show(list(p50s), pieces)
        self.query_one(RequestsPanel).show(model)
        self.query_one(ProbePanel).show(model)
        self.query_one(KVPanel).show(model)
        self.query_one(GraphsPanel).show(model)
        self.query_one(CachePanel).show(model)
        self.query_one("#status-line", Static).update(status)
