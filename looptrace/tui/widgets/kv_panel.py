"""KV pool: blocks held by requests, by the prefix cache only, free; live vs dead slots per depth plane."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from looptrace.tui.model import DashboardModel

BAR_WIDTH = 24


def _count(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else f"{int(n)}"


class KVPanel(Static, can_focus=True):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, classes="panel")
        self.border_title = "KV pool"

    def show(self, model: DashboardModel) -> None:
        kv = model.section("kv")
        if not kv:
            self.update(Text("n/a for this source", style="dim"))
            return
        usage = float(kv.get("usage") or 0.0)
        filled = round(BAR_WIDTH * min(1.0, max(0.0, usage)))
        bar = Text("█" * filled, style="bold magenta") + Text("░" * (BAR_WIDTH - filled), style="dim")
        parts: list = [Text(f"usage {100 * usage:.1f} %  ") + bar]
        if "num_blocks" in kv:
            parts.append(
                Text(
                    f"blocks: {kv.get('request_blocks', 0)} used  {kv.get('cached_blocks', 0)} cached  "
                    f"{kv.get('free_blocks', 0)} free / {kv.get('num_blocks', 0)}"
                )
            )
        planes = kv.get("planes") or []
        if planes:
            t = Table(box=None, padding=(0, 1), show_edge=False)
            t.add_column("plane")
            t.add_column("live", justify="right")
            t.add_column("dead", justify="right")
            for p in planes[:8]:
                t.add_row(str(p["plane"]), _count(p["live_slots"]), _count(p["dead_slots"]))
            if len(planes) > 8:
                t.add_row(f"+{len(planes) - 8}", "", "")
            parts.append(t)
        self.update(Group(*parts))
