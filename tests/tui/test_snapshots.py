"""SVG snapshots at a fixed terminal size (pytest-textual-snapshot); refresh with --snapshot-update."""

from __future__ import annotations

from looptrace.tui.app import LooptraceTop
from looptrace.tui.diff_data import load_diff
from looptrace.tui.sources import ReplaySource
from tests.tui.conftest import DIFF, SESSION

SIZE = (120, 40)


async def _replayed(pilot) -> None:
    await pilot.app.source_done.wait()
    await pilot.pause()


def test_dashboard_after_replay(snap_compare):
    assert snap_compare(
        LooptraceTop(ReplaySource(SESSION), speed=0), terminal_size=SIZE, run_before=_replayed
    )


def test_help_over_dashboard(snap_compare):
    app = LooptraceTop(ReplaySource(SESSION), speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=_replayed, press=["question_mark"])


def test_diff_screen(snap_compare):
    assert snap_compare(LooptraceTop(diff=load_diff(DIFF), start="diff"), terminal_size=SIZE)


def test_dashboard_at_80x24(snap_compare):
    """The smallest usual terminal: three request rows, whole numbers, the prompt column left out."""
    assert snap_compare(
        LooptraceTop(ReplaySource(SESSION), speed=0), terminal_size=(80, 24), run_before=_replayed
    )
