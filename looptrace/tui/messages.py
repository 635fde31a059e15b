"""Typed messages the data workers post to the app (worker threads never touch widgets)."""

from __future__ import annotations

from typing import Any

from textual.message import Message


class SnapshotReceived(Message):
    """One stats snapshot from the source (server stream, Prometheus scrape, replay frame, in-process)."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        super().__init__()
        self.snapshot = snapshot


class SourceFailed(Message):
    """The source could not be read this time; the worker retries on its own schedule."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class SourceFinished(Message):
    """A finite source (a replay) has delivered its last snapshot."""
