"""CUDA graph cache per graph cache: graphs held, hits (replays), captures, evictions, fallbacks."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from looptrace.tui.model import DashboardModel


class GraphsPanel(Static, can_focus=True):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, classes="panel")
        self.border_title = "CUDA graphs"

    def show(self, model: DashboardModel) -> None:
        graphs = model.section("graphs")
        if graphs is None:
            self.update(Text("n/a for this source", style="dim"))
            return
        caches = graphs.get("caches") or {}
        if not caches:
            self.update(Text("disabled (CPU, or graphs off in the recipe)", style="dim"))
            return
        t = Table(box=None, padding=(0, 1), show_edge=False)
        for col in ("cache", "graphs", "hits", "captures", "evict", "fallbacks"):
            t.add_column(col, justify="left" if col == "cache" else "right")
        reasons: dict[str, int] = {}
        for name, c in caches.items():
            style = "bold yellow" if c.get("fallbacks") else None
            t.add_row(
                Text(name),
                str(c.get("graphs", 0)),
                str(c.get("replays", 0)),
                str(c.get("captures", 0)),
                str(c.get("evictions", 0)),
                str(c.get("fallbacks", 0)),
                style=style,
            )
            for k, v in (c.get("fallback_reasons") or {}).items():
                reasons[k] = reasons.get(k, 0) + v
        if reasons:
            t.add_row("reasons", Text(", ".join(f"{k} {v}" for k, v in reasons.items())), "", "", "", "")
        self.update(t)
