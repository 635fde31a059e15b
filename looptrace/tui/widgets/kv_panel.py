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


def usage_bar(usage: float, width: int) -> Text:
    filled = round(width * min(1.0, max(0.0, usage)))
    return Text("█" * filled, style="bold magenta") + Text("░" * (width - filled), style="dim")


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
        label = Text(f"usage {100 * usage:.1f} %  ")
        width = self.content_region.width
        if width - label.cell_len >= 8:  # the bar beside the figure, as wide as the panel allows
            parts: list = [label + usage_bar(usage, min(BAR_WIDTH, width - label.cell_len))]
        else:  # a narrow panel: the bar on a line of its own
            parts = [label, usage_bar(usage, min(BAR_WIDTH, max(1, width)))]
        if "num_blocks" in kv:
            # "request blocks", not "used": the server's used_blocks also counts the blocks held only by
            # the prefix cache. One count a line, so that a narrow panel (80 columns) breaks no number.
            counts = [
                ("blocks in requests", kv.get("request_blocks", 0)),
                ("cached only", kv.get("cached_blocks", 0)),
                ("free", kv.get("free_blocks", 0)),
                ("total", kv.get("num_blocks", 0)),
            ]
            widest = max(len(str(n)) for _, n in counts)
            blocks = Table.grid(padding=(0, 1), expand=True)
            # a label may lose its end ("…"), a count never
            blocks.add_column(no_wrap=True, overflow="ellipsis", max_width=max(1, width - widest - 1))
            blocks.add_column(justify="right", no_wrap=True, min_width=widest)
            for name, n in counts:
                blocks.add_row(name, str(n))
            parts.append(blocks)
        planes = kv.get("planes") or []
        if planes:
            t = Table(box=None, padding=(0, 1), show_edge=False)
            t.add_column("plane")
            t.add_column("live", justify="right")
            t.add_column("dead", justify="right")
            for p in planes[:8]:
                t.add_row(Text(str(p["plane"])), _count(p["live_slots"]), _count(p["dead_slots"]))
            if len(planes) > 8:
                t.add_row(f"+{len(planes) - 8}", "", "")
            parts.append(t)
        self.update(Group(*parts))
