"""Running and waiting requests, one row each: stage and loop (depth reached for the token in flight)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from looptrace.tui.model import DashboardModel

# (name, width) after the request id, whose column takes the width left (its id's tail, ID_MIN to ID_MAX
# cells). "prompt" is the first to go when the panel is narrow (80 columns).
COLUMNS = (("stage", 9), ("loop", 5), ("tokens", 7), ("prompt", 6), ("age", 6))
OPTIONAL = "prompt"
ID_MIN, ID_MAX = 10, 24
CELL_PADDING = 1  # DataTable's, each side of every cell
SCROLLBAR = 2  # the vertical scrollbar's width, kept free: more requests than rows is the usual case
MAX_ROWS = 40


def fit_columns(width: int) -> list[tuple[str, int]]:
    """The table's columns for a panel `width` cells wide, so that no column is cut and no horizontal
    scrollbar takes the place of a request row."""

    def id_width(columns) -> int:
        taken = sum(w + 2 * CELL_PADDING for _, w in columns) + 2 * CELL_PADDING + SCROLLBAR
        return width - taken

    columns = list(COLUMNS)
    if id_width(columns) < ID_MIN:
        columns = [c for c in columns if c[0] != OPTIONAL]
    return [("request", max(ID_MIN, min(ID_MAX, id_width(columns)))), *columns]


class RequestsPanel(Vertical, can_focus=True):
    DEFAULT_CSS = """
    RequestsPanel > .requests-summary { height: 1; }
    RequestsPanel > DataTable { height: 1fr; overflow-x: hidden; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = "Requests"
        self.columns: list[tuple[str, int]] = []

    def compose(self) -> ComposeResult:
        yield Static("", classes="requests-summary")
        table = DataTable(show_cursor=False, zebra_stripes=True, cell_padding=CELL_PADDING)
        table.can_focus = False
        yield table

    def _set_columns(self, table: DataTable) -> None:
        columns = fit_columns(self.content_region.width)
        if columns != self.columns:
            table.clear(columns=True)
            for name, width in columns:
                table.add_column(name, width=width, key=name)
            self.columns = columns

    def show(self, model: DashboardModel) -> None:
        reqs = model.section("requests") or {}
        rows = model.sorted_requests()
        summary = (
            f"[b]{reqs.get('running', 0)}[/] running  [b]{reqs.get('waiting', 0)}[/] waiting"
            f"   sort: [b]{model.sort_key}[/]"
        )
        self.query_one(".requests-summary", Static).update(summary)
        table = self.query_one(DataTable)
        self._set_columns(table)
        table.clear()
        if rows is None:
            table.add_row(Text("per-request detail n/a for this source"), *[""] * (len(self.columns) - 1))
            return
        id_width = self.columns[0][1]
        for r in rows[:MAX_ROWS]:
            ml = r.get("max_loops") or "?"
            stage = str(r.get("stage", "?"))
            loop = f"{r.get('loop', 0)}/{ml}" if stage in ("recurrent", "coda", "prelude") else "-"
            cells = {
                "request": str(r.get("id", "?"))[-id_width:],
                "stage": stage,
                "loop": loop,
                "tokens": f"{r.get('tokens', 0)}/{r.get('max_tokens', '?')}",
                "prompt": str(r.get("prompt_tokens", "")),
                "age": f"{float(r.get('age_s', 0)):.1f}s",
            }
            # Text, not str: DataTable reads a str cell as markup, and a request id is the client's text
            table.add_row(*(Text(cells[name]) for name, _ in self.columns))
