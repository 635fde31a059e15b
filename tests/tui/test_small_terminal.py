"""The dashboard at 80x24, read off the screen as the terminal shows it: three request rows, every number
with its unit, no word broken across lines, and empty sparklines drawn empty."""

from __future__ import annotations

import re

import pytest
from textual.widgets import Sparkline

from looptrace.tui.app import LooptraceTop
from looptrace.tui.model import fmt_ms
from looptrace.tui.sources import ReplaySource, load_session
from looptrace.tui.widgets.requests_panel import fit_columns
from looptrace.tui.widgets.spark_panel import pack
from tests.tui.conftest import SESSION


def screen_text(app) -> list[str]:
    """Every line of the screen as plain text (the compositor's own output, as sent to the terminal)."""
    return [strip.text for strip in app.screen._compositor.render_strips()]


@pytest.fixture(scope="module")
def last_frame() -> dict:
    return load_session(SESSION)[1][-1][1]


async def test_80x24_shows_three_requests_and_whole_numbers(last_frame) -> None:
    top = LooptraceTop(ReplaySource(SESSION), speed=0)
    async with top.run_test(size=(80, 24)) as pilot:
        await top.source_done.wait()
        await pilot.pause()
        lines = screen_text(top)
    screen = "\n".join(lines)
    rows = [line for line in lines if "recurrent" in line or "coda" in line]
    assert len(rows) >= 3, screen  # the third row used to sit under a horizontal scrollbar
    assert all(re.search(r" \d+\.\ds( |$)", line.split("│")[1]) for line in rows), screen  # age, whole
    for key in ("ttft", "tpot"):  # "p99 738" without its "ms" was the old cut
        lat = last_frame["latency"][key]
        assert f"p50 {fmt_ms(lat['p50'])}" in screen and f"p99 {fmt_ms(lat['p99'])}" in screen, screen
    kv = last_frame["kv"]
    for count in ("request_blocks", "free_blocks", "num_blocks"):
        assert any(line.split("│")[1].rstrip().endswith(f" {kv[count]}") for line in lines if "│" in line)
    assert "enabled=fa" not in screen and "replays\n" not in screen  # no word broken onto the next line


async def test_empty_sparklines_draw_nothing() -> None:
    top = LooptraceTop(None)  # no source: nothing measured yet
    async with top.run_test(size=(80, 24)) as pilot:
        top.redraw(force=True)
        await pilot.pause()
        for spark in top.screen.query(Sparkline):
            assert list(spark.data or []) == []
        assert "█" not in "\n".join(screen_text(top))  # a [0.0] placeholder drew every bar full


def test_value_pieces_are_never_split() -> None:
    pieces = ["p50 [b]78.5 ms[/]", "p99 [b]99.4 ms[/]", "n=30"]
    assert pack(pieces, 80) == "p50 [b]78.5 ms[/]  p99 [b]99.4 ms[/]  n=30"
    assert pack(pieces, 22) == "p50 [b]78.5 ms[/]\np99 [b]99.4 ms[/]  n=30"
    assert pack(pieces, 11) == "p50 [b]78.5 ms[/]\np99 [b]99.4 ms[/]"  # the rest is left out, not cut


@pytest.mark.parametrize("width", [49, 56, 57, 104])  # 49: the requests panel at 80 columns
def test_request_columns_fit_the_panel(width: int) -> None:
    columns = fit_columns(width)
    assert sum(w + 2 for _, w in columns) + 2 <= width  # cells, padding, scrollbar: no horizontal scroll
    assert columns[0][0] == "request" and 10 <= columns[0][1] <= 24
    assert ("prompt" in dict(columns)) == (width >= 57)  # the first column to go when narrow
