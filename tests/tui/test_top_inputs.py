"""`looptrace top` on bad numbers, malformed snapshots, user text that looks like markup, a refused API key,
and the `--once` extras (`--record`, `--format json`)."""

from __future__ import annotations

import json

import pytest
from textual.widgets import DataTable
from typer.testing import CliRunner

from looptrace.cli.main import app as cli
from looptrace.tui.app import LooptraceTop
from looptrace.tui.snapshot_schema import SnapshotError, check_snapshot
from looptrace.tui.sources import ReplaySource, load_session
from tests.tui.conftest import SESSION, session_variant
from tests.tui.test_app import text_of

runner = CliRunner()


def assert_one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--interval", "nan"], "'--interval': 'nan'"),  # cli/options.py: every float finite
        (["--interval", "inf"], "'--interval': 'inf'"),
        (["--interval", "0"], "--interval 0"),
        (["--speed", "nan"], "'--speed': 'nan'"),
    ],
)
def test_non_finite_numbers_are_exit_2(args: list[str], needle: str) -> None:
    r = runner.invoke(cli, ["top", "--replay", str(SESSION), "--once", *args])
    assert_one_line_error(r, needle, "finite")


@pytest.mark.parametrize("once", [True, False])
@pytest.mark.parametrize(
    "name, change, field",
    [
        (
            "nan",
            lambda s: s["latency"]["ttft"].update(p50=float("nan")),
            "latency.ttft.p50: expected a finite",
        ),
        ("abc", lambda s: s.update(requests="abc"), "requests: expected an object, got 'abc'"),
        ("rows", lambda s: s["requests"].update(list=[["r0"]]), "requests.list[0]: expected an object"),
    ],
)
def test_malformed_snapshot_is_one_line_exit_2(tmp_path, once: bool, name: str, change, field: str) -> None:
    """The dashboard (not only --once) refuses the file before it starts: it used to crash inside a widget
    and exit 0."""
    path = session_variant(tmp_path, name, change)
    r = runner.invoke(cli, ["top", "--replay", str(path), *(["--once"] if once else [])])
    assert_one_line_error(r, f"{path}:2: {field}")


def test_snapshot_schema_accepts_every_recorded_frame() -> None:
    _, frames = load_session(SESSION)  # load_session checks each frame
    for _, snap in frames:
        check_snapshot(snap)
    with pytest.raises(SnapshotError, match=r"kv\.usage: expected a finite number, got inf"):
        check_snapshot(frames[0][1] | {"kv": {"usage": float("inf")}})


def _markup_ids(snap: dict) -> None:
    snap["requests"]["list"][0]["id"] = "[/]"
    snap["requests"]["list"][1]["id"] = "[bold]x"


async def test_markup_in_a_request_id_is_shown_as_text(tmp_path) -> None:
    path = session_variant(tmp_path, "markup", _markup_ids)
    top = LooptraceTop(ReplaySource(path), speed=0)
    async with top.run_test(size=(120, 40)) as pilot:
        await top.source_done.wait()
        await pilot.pause()
        table = top.screen.query_one("#requests DataTable", DataTable)
        ids = {str(table.get_row_at(i)[0]) for i in range(table.row_count)}
        assert {"[/]", "[bold]x"} <= ids
    r = runner.invoke(cli, ["top", "--replay", str(path), "--once"])
    assert r.exit_code == 0, r.output


async def test_a_malformed_live_snapshot_shows_in_the_status_line() -> None:
    """After the first snapshot, a bad one does not stop the dashboard: the status line names it."""
    from looptrace.tui.sources import InProcessSource

    _, frames = load_session(SESSION)
    served = [frames[0][1], frames[1][1] | {"requests": "abc"}]
    top = LooptraceTop(InProcessSource(lambda: served[min(top.received, 1)]), interval=0.05)
    async with top.run_test(size=(120, 40)) as pilot:
        while top.last_error is None:
            await pilot.pause(0.02)
        top.redraw(force=True)
        await pilot.pause()
        assert top.received == 1 and top.model.latest == served[0]
        status = text_of(top.screen.query_one("#status-line"))
        assert "snapshot skipped: requests: expected an object, got 'abc'" in status


@pytest.mark.parametrize("key", [None, "wrong"])
def test_refused_key_names_the_variable(stats_endpoint, monkeypatch, key: str | None) -> None:
    url, answer = stats_endpoint
    answer["status"], answer["body"] = 401, {"detail": "missing or invalid API key"}
    if key is None:
        monkeypatch.delenv("LOOPTRACE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("LOOPTRACE_API_KEY", key)
    r = runner.invoke(cli, ["top", url, "--once"])
    line = assert_one_line_error(r, "HTTP 401", "LOOPTRACE_API_KEY")
    assert ("refused the key" in line) == (key is not None)


def test_once_record_writes_the_snapshots_it_read(tmp_path) -> None:
    out = tmp_path / "r.jsonl"
    r = runner.invoke(cli, ["top", "--replay", str(SESSION), "--once", "--record", str(out)])
    assert r.exit_code == 0, r.output
    _, recorded = load_session(out)
    _, frames = load_session(SESSION)
    assert [snap for _, snap in recorded] == [snap for _, snap in frames]
    assert [t for t, _ in recorded] == pytest.approx([t - frames[0][0] for t, _ in frames], abs=1e-3)


def test_once_format_json(tmp_path) -> None:
    r = runner.invoke(cli, ["top", "--replay", str(SESSION), "--once", "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    _, frames = load_session(SESSION)
    assert doc["snapshot"] == frames[-1][1] and doc["output_tokens_per_s"] > 0
    assert doc["source"].startswith("replay of session.jsonl")
    r = runner.invoke(cli, ["top", "--replay", str(SESSION), "--format", "json"])
    assert_one_line_error(r, "--format applies to --once")


@pytest.mark.parametrize("url", ["[/]\ud800", "http://127.0.0.1:1/\udfff"])
def test_url_with_a_lone_surrogate_is_one_line_exit_2(url: str) -> None:
    """httpx raised UnicodeEncodeError (a traceback, exit 1) while percent-encoding such a URL."""
    r = runner.invoke(cli, ["top", url, "--once"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.exc_info[0] is SystemExit
    assert "not a URL" in r.output
