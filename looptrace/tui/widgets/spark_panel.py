"""A titled sparkline with its current value and p50/p99 (throughput, TTFT, TPOT, prefill depth)."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static


class SparkPanel(Vertical, can_focus=True):
    DEFAULT_CSS = """
    SparkPanel > Sparkline { height: 1fr; min-height: 2; }
    SparkPanel > .spark-value { height: 1; }
    """

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = title

    def compose(self) -> ComposeResult:
        yield Static("n/a", classes="spark-value")
        yield Sparkline([], summary_function=max)

    def show(self, values: Sequence[float], text: str) -> None:
        self.query_one(".spark-value", Static).update(text)
        self.query_one(Sparkline).data = list(values) or [0.0]
