"""Prefix-cache hit rate and the prefill depth P over time ("n/a" until the engine reports P)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from looptrace.tui.model import DashboardModel


class CachePanel(Vertical, can_focus=True):
    DEFAULT_CSS = """
    CachePanel > Static { height: auto; }
    CachePanel > Sparkline { height: 1fr; min-height: 1; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = "Prefix, depth P"

    def compose(self) -> ComposeResult:
        yield Static("", id="prefix-line")
        yield Static("", id="depth-line")
        yield Sparkline([], summary_function=max)

    def show(self, model: DashboardModel) -> None:
        prefix = model.section("prefix")
        if prefix and prefix.get("hit_rate") is not None:
            line = f"prefix hit rate [b]{100 * prefix['hit_rate']:.1f} %[/]"
            if prefix.get("query_tokens") is not None:
                # a line of its own: a narrow panel would part the numbers from their unit
                line += f"\n{int(prefix.get('hit_tokens') or 0)} / {int(prefix['query_tokens'])} tokens hit"
        elif prefix and not prefix.get("enabled", True):
            line = "prefix cache off"
        else:
            line = "prefix hit rate [dim]n/a[/]"
        self.query_one("#prefix-line", Static).update(line)
        depth = model.section("prefill_depth")
        text = (
            f"prefill depth P [b]{depth:g}[/]"
            if isinstance(depth, (int, float))
            else "prefill depth P [dim]n/a[/]"
        )
        self.query_one("#depth-line", Static).update(text)
        spark = self.query_one(Sparkline)
        spark.display = bool(model.depth)
        spark.data = list(model.depth)
