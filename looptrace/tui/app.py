"""`looptrace top`: the Textual app. Bindings, the data-source workers and the sampling/drawing split.

Sampling: one thread worker per source (`group="source"`, exclusive) posts typed messages; threads never
touch widgets. Polled sources (Prometheus, in-process) fetch once per worker run and the app schedules the
next run when it handles the message (a self-rescheduling poll, so a slow scrape never piles up); the
looptrace server's SSE stats stream is read by one long-lived worker; a replay paces recorded frames.
Drawing: a timer redraws the current screen from the `DashboardModel` when something changed and the
view is not paused, so `p` freezes the picture while sampling and recording go on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from rich.markup import escape
from textual import work
from textual.app import App
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.worker import get_current_worker

from looptrace.tui.diff_data import DiffRequest, load_diff
from looptrace.tui.messages import SnapshotReceived, SourceFailed, SourceFinished
from looptrace.tui.model import DashboardModel
from looptrace.tui.screens.dashboard import DashboardScreen
from looptrace.tui.screens.diff import DiffScreen
from looptrace.tui.screens.help import HelpScreen
from looptrace.tui.snapshot_schema import SnapshotError, check_snapshot
from looptrace.tui.sources import Recorder, SourceError

RETRY_S = 2.0


class LooptraceTop(App[None]):
    CSS_PATH = "looptrace.tcss"
    TITLE = "looptrace top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("p", "pause", "Pause"),
        Binding("r", "record", "Record"),
        Binding("s", "sort", "Sort"),
        Binding("d", "diff", "Diff"),
        Binding("tab", "focus_next", "Panel", key_display="Tab"),
        Binding("shift+tab", "focus_previous", "Panel", show=False),
    ]

    def __init__(
        self,
        source: Any = None,
        *,
        interval: float = 1.0,
        speed: float = 1.0,
        record_path: Path | None = None,
        diff: list[DiffRequest] | None = None,
        diff_note: str | None = None,
        start: str = "dashboard",
        draw_interval: float = 0.25,
        screenshot: Path | None = None,
        screenshot_after: int = 4,
    ) -> None:
        super().__init__()
        self.source, self.interval, self.speed = source, interval, speed
        self.record_path = record_path
        self.diff_requests, self.diff_note, self.start_view = diff, diff_note, start
        self.draw_interval = draw_interval
        self.screenshot_path, self.screenshot_after = screenshot, screenshot_after
        self.model = DashboardModel()
        self.paused = False
        self.recorder: Recorder | None = None
        self.last_error: str | None = None
        self.received = 0
        self.source_done = asyncio.Event()
        self._dirty = False
        self._halt = threading.Event()  # wakes sleeping workers at exit
        self._polling = getattr(source, "kind", None) in ("prometheus", "in-process")

    # Lifecycle ------------------------------------------------------------------------------------------
    def on_mount(self) -> None:
        if self.source is not None:
            self.sub_title = self.source.label
        if self.start_view == "diff":
            self.push_screen(DiffScreen(self.diff_requests, self.diff_note))
            return
        self.push_screen(DashboardScreen())
        if self.record_path is not None:
            self._start_recording(self.record_path)
        self.set_interval(self.draw_interval, self.redraw)
        self._start_source()

    def on_unmount(self) -> None:
        self._halt.set()
        if self.recorder is not None:
            self.recorder.close()

    def _start_source(self) -> None:
        kind = getattr(self.source, "kind", None)
        if kind == "replay":
            self.replay_frames()
        elif kind == "looptrace":
            self.read_stream()
        elif kind is not None:
            self.poll_once()

    # Workers (threads: they only post messages) ---------------------------------------------------------
    @work(thread=True, exclusive=True, group="source")
    def poll_once(self) -> None:
        try:
            snap = self.source.fetch()
        except SourceError as exc:
            self.post_message(SourceFailed(str(exc)))
        else:
            self.post_message(SnapshotReceived(snap))

    @work(thread=True, exclusive=True, group="source")
    def read_stream(self) -> None:
        worker = get_current_worker()
        while not worker.is_cancelled and not self._halt.is_set():
            try:
                for snap in self.source.stream(
                    self.interval, lambda: worker.is_cancelled or self._halt.is_set()
                ):
                    self.post_message(SnapshotReceived(snap))
            except SourceError as exc:
                self.post_message(SourceFailed(str(exc)))
            if self._halt.wait(RETRY_S):  # reconnect pace; returns at once on exit
                return

    @work(thread=True, exclusive=True, group="source")
    def replay_frames(self) -> None:
        worker = get_current_worker()
        prev = None
        for t, snap in self.source.frames:
            if prev is not None and self.speed > 0 and self._halt.wait((t - prev) / self.speed):
                return  # replay pacing: the recorded gaps, scaled; exits at once on halt
            if worker.is_cancelled:
                return
            self.post_message(SnapshotReceived(snap))
            prev = t
        self.post_message(SourceFinished())

    # Messages -------------------------------------------------------------------------------------------
    def on_snapshot_received(self, message: SnapshotReceived) -> None:
        try:  # a malformed snapshot (any source, the in-process one included) is named, never drawn
            check_snapshot(message.snapshot)
        except SnapshotError as exc:
            self.on_source_failed(SourceFailed(f"snapshot skipped: {exc}"))
            return
        self.model.ingest(message.snapshot)
        self.received += 1
        self.last_error = None
        if self.recorder is not None:
            self.recorder.write(message.snapshot)
        self._dirty = True
        if self._polling:
            self.set_timer(self.interval, self.poll_once)
        if self.screenshot_path is not None and self.received == self.screenshot_after:
            self.redraw(force=True)
            self.call_after_refresh(self._take_screenshot)

    def on_source_failed(self, message: SourceFailed) -> None:
        self.last_error = message.error
        self._dirty = True
        if self._polling:
            self.set_timer(RETRY_S, self.poll_once)

    def on_source_finished(self, _message: SourceFinished) -> None:
        self.source_done.set()
        self.redraw(force=True)

    # Drawing --------------------------------------------------------------------------------------------
    def status_text(self) -> str:
        parts = [f"{self.received} snapshots"]
        if self.source_done.is_set():
            parts.append("replay finished")
        if self.recorder is not None:
            parts.append(f"[b red]● REC[/] {escape(self.recorder.path.name)} ({self.recorder.count})")
        if self.paused:
            parts.append("[b yellow]PAUSED[/] (p resumes)")
        if self.last_error:
            parts.append(f"[red]{escape(self.last_error)}[/]")
        return "  |  ".join(parts)

    def redraw(self, force: bool = False) -> None:
        if self.paused or not (self._dirty or force):
            return
        screen = self.screen
        if isinstance(screen, DashboardScreen):
            try:
                screen.refresh_from(self.model, self.status_text())
            except NoMatches:  # the screen is still composing: draw on the next tick
                return
            self._dirty = False

    def _take_screenshot(self) -> None:
        assert self.screenshot_path is not None
        self.save_screenshot(self.screenshot_path.name, str(self.screenshot_path.parent))
        self.exit()

    # Actions --------------------------------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        if isinstance(self.screen, DashboardScreen):
            # the status line is the one thing drawn while paused, so the pause is visible
            self.screen.query_one("#status-line").update(self.status_text())
        self.redraw(force=True)

    def action_sort(self) -> None:
        self.model.cycle_sort()
        self.redraw(force=True)

    def action_record(self) -> None:
        if self.recorder is not None:
            path = self.recorder.path
            self.recorder.close()
            self.recorder = None
            self.notify(f"recording saved to {path}")
        else:
            path = self.record_path or Path(time.strftime("looptrace-top-%Y%m%d-%H%M%S.jsonl"))
            self._start_recording(path)
        self.redraw(force=True)

    def _start_recording(self, path: Path) -> None:
        try:
            self.recorder = Recorder(path, getattr(self.source, "label", "?"))
        except OSError as exc:
            self.notify(f"cannot record to {path}: {exc}", severity="error")
            return
        if self.model.latest is not None:
            self.recorder.write(self.model.latest)

    def action_diff(self) -> None:
        if not isinstance(self.screen, DiffScreen):
            self.push_screen(DiffScreen(self.diff_requests, self.diff_note))


def run_diff(source: str | Path | dict) -> None:
    """Open the diff screen alone on a diff result (`{"requests": [...]}` file or dict); for `diff --tui`."""
    LooptraceTop(diff=load_diff(source), start="diff").run()
