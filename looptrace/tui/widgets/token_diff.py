"""Two token streams side by side; the first divergence is highlighted, later tokens are dimmed."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from looptrace.tui.diff_data import DiffRequest

DIVERGENCE_STYLE = "bold white on red"
COMMON_STYLE = "green"
AFTER_STYLE = "dim"


def stream_text(tokens: list[int], pieces: list[str] | None, divergence: int | None) -> Text:
    text = Text()
    for i, tok in enumerate(tokens):
        label = repr(pieces[i])[1:-1] if pieces and i < len(pieces) else str(tok)
        if divergence is None or i < divergence:
            style = COMMON_STYLE
        elif i == divergence:
            style = DIVERGENCE_STYLE
        else:
            style = AFTER_STYLE
        text.append(label, style=style)
        text.append(" ")
    if divergence is not None and divergence >= len(tokens):
        text.append("<end>", style=DIVERGENCE_STYLE)
    return text


class TokenDiff(Static):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id)
        self.request: DiffRequest | None = None

    def show(self, req: DiffRequest | None) -> None:
        self.request = req
        if req is None:
            self.update(Text("no request selected", style="dim"))
            return
        fd = req.first_divergence
        head = (
            Text(f"{req.id}: identical ({len(req.a_tokens)} tokens)", style="bold green")
            if fd is None
            else Text(f"{req.id}: first divergence at token {fd}", style="bold red")
        )
        t = Table(expand=True, show_lines=False, title=head, title_justify="left")
        t.add_column(f"A ({len(req.a_tokens)} tokens)", ratio=1)
        t.add_column(f"B ({len(req.b_tokens)} tokens)", ratio=1)
        t.add_row(stream_text(req.a_tokens, req.a_text, fd), stream_text(req.b_tokens, req.b_text, fd))
        self.update(t)
