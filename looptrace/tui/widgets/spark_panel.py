"""A titled sparkline with its current value and p50/p99 (throughput, TTFT, TPOT, prefill depth)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static


def pack(pieces: Sequence[str], width: int, max_lines: int = 2) -> str:
    """The value line's `pieces` (Rich markup, such as "p99 [b]738 ms[/]") joined two spaces apart into at
    most `max_lines` lines of `width` cells. A piece is never split (a number keeps its unit); pieces that
    do not fit are left out, the last first, so the first ones (the current value) always show."""
    lines: list[list[str]] = [[]]
    used = 0
    for piece in pieces:
        size = Text.from_markup(piece).cell_len
        if lines[-1] and used + 2 + size > width:
            if len(lines) == max_lines:
                break
            lines.append([])
            used = 0
        lines[-1].append(piece)
        used += size + (2 if len(lines[-1]) > 1 else 0)
    return "\n".join("  ".join(line) for line in lines)


class SparkPanel(Vertical, can_focus=True):
    DEFAULT_CSS = """
    SparkPanel > Sparkline { height: 1fr; min-height: 1; }
    SparkPanel > .spark-value { height: auto; max-height: 2; }
    """

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = title

    def compose(self) -> ComposeResult:
        yield Static("n/a", classes="spark-value")
        yield Sparkline([], summary_function=max)

    def show(self, values: Sequence[float], pieces: Sequence[str]) -> None:
        value = self.query_one(".spark-value", Static)
        value.update(pack(pieces, max(1, self.content_region.width)))
        # No samples yet: an empty sparkline draws its baseline (a [0.0] placeholder would draw full bars).
        self.query_one(Sparkline).data = list(values)
