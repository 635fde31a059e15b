"""Per-token counters from the live probe: kernels, copies, syncs, graph replays, eager fallbacks."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from looptrace.tui.model import DashboardModel, fmt_num


class ProbePanel(Static, can_focus=True):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, classes="panel")
        self.border_title = "Per token (probe)"

    def show(self, model: DashboardModel) -> None:
        probe = model.section("probe")
        engine = model.section("engine") or {}
        t = Table.grid(padding=(0, 1), expand=True)
        # no_wrap: a narrow panel (80 columns) shortens a label with "…", never wraps it onto a second row
        t.add_column(no_wrap=True, overflow="ellipsis")
        t.add_column(justify="right", no_wrap=True)
        if not probe or "per_token" not in probe:
            t.add_row("probe", Text(_no_window_note(model, probe), style="dim"))
            t.add_row("steps / token", fmt_num(engine.get("steps_per_token"), 2) if engine else "n/a")
            t.add_row(
                "submissions / token", fmt_num(engine.get("submissions_per_token"), 2) if engine else "n/a"
            )
            self.update(t)
            return
        pt = probe["per_token"]
        mode = probe.get("mode", "?")
        t.add_row("kernels" if mode == "gpu" else "ops (CPU)", fmt_num(pt.get("kernels")))
        t.add_row("copies", fmt_num(pt.get("copies")))
        t.add_row("syncs", fmt_num(pt.get("syncs"), 2))
        t.add_row("graph replays", fmt_num(pt.get("graph_replays"), 2))
        t.add_row("eager fallbacks", fmt_num(pt.get("eager_fallbacks"), 2))
        reasons = probe.get("fallback_reasons") or {}
        t.add_row("  reasons", Text(", ".join(f"{k} {v}" for k, v in reasons.items()) or "-"))
        t.add_row("steps / token", fmt_num(pt.get("steps"), 2))
        t.add_row("submissions / token", fmt_num(pt.get("submissions"), 2))
        w = probe.get("window") or {}
        t.add_row("[dim]window[/]", f"[dim]{w.get('steps', '?')} steps, {w.get('tokens', '?')} tok[/]")
        self.update(t)


def _no_window_note(model: DashboardModel, probe: dict | None) -> str:
    """Why there are no per-token counters: the server's own note, a source that has none (a Prometheus
    endpoint has no live probe: no window will ever come), or the first window still to come."""
    if probe and (probe.get("note") or probe.get("error")):
        return str(probe.get("note") or probe.get("error"))
    latest = model.latest
    if latest is None:
        return "waiting for the first snapshot"
    if latest.get("source") == "prometheus" or latest.get("engine") is None:
        return "no live probe for this source"
    return "waiting for the first window"
