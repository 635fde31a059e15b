"""Running and waiting requests, one row each: stage and loop (depth reached for the token in flight)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from looptrace.tui.model import DashboardModel

COLUMNS = (("request", 18), ("stage", 9), ("loop", 5), ("tokens", 8), ("prompt", 6), ("age", 7))
MAX_ROWS = 40


class RequestsPanel(Vertical, can_focus=True):
    DEFAULT_CSS = """
    RequestsPanel > .requests-summary { height: 1; }
    RequestsPanel > DataTable { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = "Requests"

    def compose(self) -> ComposeResult:
        yield Static("", classes="requests-summary")
        table = DataTable(show_cursor=False, zebra_stripes=True)
        table.can_focus = False
        yield table

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for name, width in COLUMNS:
            table.add_column(name, width=width)

    def show(self, model: DashboardModel) -> None:
        reqs = model.section("requests") or {}
        rows = model.sorted_requests()
        summary = (
            f"[b]{reqs.get('running', 0)}[/] running  [b]{reqs.get('waiting', 0)}[/] waiting"
            f"   sort: [b]{model.sort_key}[/]"
        )
        self.query_one(".requests-summary", Static).update(summary)
        table = self.query_one(DataTable)
        table.clear()
        if rows is None:
            table.add_row("per-request detail n/a for this source", "", "", "", "", "")
            return
        for r in rows[:MAX_ROWS]:
            ml = r.get("max_loops") or "?"
            stage = r.get("stage", "?")
            loop = f"{r.get('loop', 0)}/{ml}" if stage in ("recurrent", "coda", "prelude") else "-"
            table.add_row(
                str(r.get("id", "?"))[-18:],
                stage,
                loop,
                f"{r.get('tokens', 0)}/{r.get('max_tokens', '?')}",
                str(r.get("prompt_tokens", "")),
                f"{float(r.get('age_s', 0)):.1f}s",
            )
