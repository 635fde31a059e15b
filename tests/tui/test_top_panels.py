"""`looptrace top`: the requests panel at 80x24, the probe panel on a Prometheus source,
`--once` tokens/s from two snapshots, and `--record` checked before the dashboard starts."""

from __future__ import annotations

import pytest
from textual.widgets import DataTable, Static
from typer.testing import CliRunner

from looptrace.cli.main import app as cli
from looptrace.tui.app import LooptraceTop
from looptrace.tui.screens.dashboard import grid_rows
from looptrace.tui.sources import PrometheusSource, ReplaySource
from tests.tui.conftest import SESSION
from tests.tui.test_app import text_of

runner = CliRunner()


def test_grid_rows_keep_the_requests_panel() -> None:
    assert grid_rows(40) == grid_rows(28) == "7 1fr 11"  # the usual layout (and the 120x40 snapshots)
    assert grid_rows(24) == "5 1fr 9"  # 24 - 3 chrome - 5 - 9 = 7: borders, summary, header, 3 rows


async def test_requests_panel_at_80x24_shows_its_header_and_3_rows() -> None:
    top = LooptraceTop(ReplaySource(SESSION), speed=0)
    async with top.run_test(size=(80, 24)) as pilot:
        await top.source_done.wait()
        await pilot.pause()
        table = top.screen.query_one("#requests DataTable", DataTable)
        assert table.row_count >= 3
        assert table.content_region.height >= 1 + 3  # header and three rows visible
        summary = top.screen.query_one("#requests .requests-summary", Static)
        assert summary.region.height == 1 and "running" in text_of(summary)


async def test_prometheus_probe_panel_does_not_wait_for_a_window(vllm_endpoint) -> None:
    url, served = vllm_endpoint
    top = LooptraceTop(PrometheusSource(url), interval=0.05)
    async with top.run_test(size=(120, 40)) as pilot:
        while served["n"] < 2:
            await pilot.pause(0.05)
        top.redraw(force=True)
        await pilot.pause()
        probe = text_of(top.screen.query_one("#probe", Static))
        assert "no live probe for this source" in probe and "waiting" not in probe


def test_once_shows_tokens_per_second_from_two_snapshots(vllm_endpoint, monkeypatch) -> None:
    import looptrace.tui.sources as sources

    clock = iter([100.0, 102.0])  # the two scrapes, 2 s apart: 8000 -> 10500 generation tokens

    def fetch(self):
        return self.convert(sources._get(self.url, self.timeout).text, next(clock))

    monkeypatch.setattr(PrometheusSource, "fetch", fetch)
    url, served = vllm_endpoint
    r = runner.invoke(cli, ["top", "--prometheus", url, "--once", "--interval", "0.01"])
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if "output tokens/s" in line)
    assert "1,250" in row and served["n"] == 2


@pytest.mark.parametrize("path", ["/proc/x.jsonl", "/nonexistent-dir/x.jsonl"])
def test_record_path_is_checked_up_front(path: str) -> None:
    r = runner.invoke(cli, ["top", "--replay", str(SESSION), "--record", path])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --record ") and path in lines[0]
    assert "Traceback" not in r.output
