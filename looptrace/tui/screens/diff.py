"""Diff view: requests on the left (with their first divergence), the selected streams on the right."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from looptrace.tui.diff_data import DiffRequest
from looptrace.tui.widgets.token_diff import TokenDiff


class DiffScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("d", "back", "Dashboard"),
    ]

    def __init__(self, requests: list[DiffRequest] | None, note: str | None = None) -> None:
        super().__init__()
        self.requests = requests or []
        self.note = note

    def compose(self) -> ComposeResult:
        yield Header()
        if not self.requests:
            yield Static(
                self.note or "no diff loaded: pass --diff RESULT.json (looptrace diff's JSON result)",
                id="diff-empty",
            )
        else:
            with Horizontal(id="diff-body"):
                table = DataTable(id="diff-list", cursor_type="row")
                table.border_title = "Requests"
                yield table
                with VerticalScroll(id="diff-view"):
                    yield TokenDiff(id="token-diff")
        yield Footer()

    def on_mount(self) -> None:
        if not self.requests:
            return
        table = self.query_one("#diff-list", DataTable)
        table.add_columns("request", "A", "B", "diverges at")
        for r in self.requests:
            fd = "-" if r.first_divergence is None else str(r.first_divergence)
            table.add_row(Text(r.id), str(len(r.a_tokens)), str(len(r.b_tokens)), fd, key=r.id)
        first = next((i for i, r in enumerate(self.requests) if r.first_divergence is not None), 0)
        table.move_cursor(row=first)
        table.focus()
        self.query_one(TokenDiff).show(self.requests[first])

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if 0 <= event.cursor_row < len(self.requests):
            self.query_one(TokenDiff).show(self.requests[event.cursor_row])

    def action_back(self) -> None:
        if len(self.app.screen_stack) > 2:
            self.app.pop_screen()
        else:
            self.app.exit()
