"""The key map (`?`), as a modal over the current screen."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = (
    ("q", "quit"),
    ("?", "this help (Esc closes)"),
    ("p", "pause / resume drawing (sampling and recording go on)"),
    ("r", "start / stop recording to a session file (replay with --replay FILE)"),
    ("s", "sort requests: arrival, stage, loop, tokens"),
    ("d", "diff screen: two token streams, first divergence highlighted"),
    ("Tab / Shift+Tab", "move between panels"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]

    def compose(self) -> ComposeResult:
        lines = "\n".join(f"[b]{k:>16}[/]  {what}" for k, what in KEYS)
        with Vertical(id="help-box"):
            yield Static("[b]looptrace top[/] keys\n\n" + lines, id="help-text")

    def action_dismiss(self) -> None:
        self.dismiss(None)
