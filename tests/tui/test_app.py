"""Textual Pilot tests over a replayed session, a vLLM Prometheus endpoint and diff data."""

from __future__ import annotations

import copy
import io

from rich.console import Console
from textual.widgets import DataTable, Static

from looptrace.tui.app import LooptraceTop
from looptrace.tui.diff_data import load_diff
from looptrace.tui.messages import SnapshotReceived
from looptrace.tui.screens.dashboard import DashboardScreen
from looptrace.tui.screens.diff import DiffScreen
from looptrace.tui.screens.help import HelpScreen
from looptrace.tui.sources import PrometheusSource, ReplaySource, load_session
from looptrace.tui.widgets.token_diff import DIVERGENCE_STYLE, TokenDiff
from tests.tui.conftest import DIFF, SESSION

SIZE = (120, 40)


def text_of(widget: Static) -> str:
    """What the widget shows, as plain text (Rich renderables printed the way a terminal would)."""
    visual = widget.render()
    renderable = getattr(visual, "_renderable", None)
    if renderable is None:
        return str(visual)
    console = Console(width=200, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def value_line(app, panel: str) -> str:
    return text_of(app.screen.query_one(f"#{panel} .spark-value", Static))


async def test_replay_fills_every_panel():
    _, frames = load_session(SESSION)
    last = frames[-1][1]
    app = LooptraceTop(ReplaySource(SESSION), speed=0)
    async with app.run_test(size=SIZE) as pilot:
        await app.source_done.wait()
        await pilot.pause()
        assert app.received == len(frames)
        assert isinstance(app.screen, DashboardScreen)
        assert "tok/s" in value_line(app, "throughput") and "n/a" not in value_line(app, "throughput")
        assert "p50" in value_line(app, "ttft") and f"n={last['latency']['ttft']['n']}" in value_line(
            app, "ttft"
        )
        table = app.screen.query_one("#requests DataTable", DataTable)
        assert table.row_count == len(last["requests"]["list"])
        stages = {str(table.get_row_at(i)[1]) for i in range(table.row_count)}
        assert stages <= {"prefill", "prelude", "recurrent", "coda", "waiting"}
        probe = text_of(app.screen.query_one("#probe", Static))
        assert "ops (CPU)" in probe and "eager fallbacks" in probe
        kv = text_of(app.screen.query_one("#kv", Static))
        assert "usage" in kv and "blocks in requests" in kv and "cached only" in kv
        assert "disabled" in text_of(app.screen.query_one("#graphs", Static))
        cache = app.screen.query_one("#cache")
        assert "prefix hit rate" in text_of(cache.query_one("#prefix-line", Static))
        assert "n/a" in text_of(cache.query_one("#depth-line", Static))  # the engine does not emit P yet
        assert "replay finished" in text_of(app.screen.query_one("#status-line", Static))


async def test_keys_pause_sort_help_tab_diff_quit(tmp_path):
    _, frames = load_session(SESSION)
    app = LooptraceTop(ReplaySource(SESSION), speed=0, diff=load_diff(DIFF), record_path=None)
    async with app.run_test(size=SIZE) as pilot:
        await app.source_done.wait()
        await pilot.pause()
        # p: drawing freezes, sampling goes on
        await pilot.press("p")
        assert "PAUSED" in text_of(app.screen.query_one("#status-line", Static))
        before = value_line(app, "ttft")
        snap = copy.deepcopy(frames[-1][1])
        snap["time"] += 1.0
        snap["latency"]["ttft"] = {"p50": 9.0, "p99": 9.5, "n": 999}
        app.post_message(SnapshotReceived(snap))
        await pilot.pause()
        assert app.model.latest is snap and value_line(app, "ttft") == before
        await pilot.press("p")
        assert "n=999" in value_line(app, "ttft")
        # s: sort order cycles and is shown
        await pilot.press("s")
        assert app.model.sort_key == "stage"
        assert "sort: stage" in text_of(app.screen.query_one("#requests .requests-summary", Static))
        # Tab: next panel
        assert app.focused.id == "throughput"
        await pilot.press("tab")
        assert app.focused.id == "ttft"
        # ?: help, Esc closes
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, DashboardScreen)
        # d: diff screen opens on the first diverging request; d returns
        await pilot.press("d")
        assert isinstance(app.screen, DiffScreen)
        assert app.screen.query_one(TokenDiff).request.id == "req-1"
        await pilot.press("d")
        assert isinstance(app.screen, DashboardScreen)
        # the footer shows the keys
        footer_keys = {key for key, b in app.active_bindings.items() if b.binding.show}
        assert {"q", "question_mark", "p", "r", "s", "d", "tab"} <= footer_keys
        await pilot.press("q")
    assert not app.is_running


async def test_record_key_writes_a_replayable_session(tmp_path):
    out = tmp_path / "rec.jsonl"
    app = LooptraceTop(ReplaySource(SESSION), speed=0, record_path=out)
    async with app.run_test(size=SIZE) as pilot:
        await app.source_done.wait()
        await pilot.pause()
        assert app.recorder is not None  # --record starts recording at once
        await pilot.press("r")
        assert app.recorder is None
    rec = ReplaySource(out)
    assert len(rec.frames) == len(load_session(SESSION)[1])
    assert rec.frames[-1][1] == load_session(SESSION)[1][-1][1]


def view_table(view: TokenDiff):
    return view.render()._renderable


async def test_diff_screen_highlights_first_divergence():
    app = LooptraceTop(diff=load_diff(DIFF), start="diff")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, DiffScreen)
        view = screen.query_one(TokenDiff)
        assert view.request.first_divergence == 3
        table = view_table(view).columns  # rich Table: A and B columns
        a_text, b_text = table[0]._cells[0], table[1]._cells[0]
        for text, token in ((a_text, "4"), (b_text, "9")):
            marked = [text.plain[s.start : s.end] for s in text.spans if s.style == DIVERGENCE_STYLE]
            assert marked == [token]
        await pilot.press("down")  # the next request: B is longer, divergence at A's end
        assert view.request.id == "short"
        b_text = view_table(view).columns[1]._cells[0]
        assert [b_text.plain[s.start : s.end] for s in b_text.spans if s.style == DIVERGENCE_STYLE] == ["3"]
        await pilot.press("escape")
    assert not app.is_running


async def test_prometheus_panels_from_a_vllm_endpoint(vllm_endpoint):
    url, served = vllm_endpoint
    app = LooptraceTop(PrometheusSource(url), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        while served["n"] < 3:  # two distinct scrapes and one repeat: rates and interval percentiles
            await pilot.pause(0.05)
        app.redraw(force=True)
        await pilot.pause()
        summary = text_of(app.screen.query_one("#requests .requests-summary", Static))
        assert "16 running" in summary and "5 waiting" in summary
        assert "30.5 %" in text_of(app.screen.query_one("#kv", Static))
        assert "p50" in value_line(app, "ttft") and "n/a" not in value_line(app, "ttft")
        assert "n/a" in text_of(app.screen.query_one("#graphs", Static))
        assert "50.8 %" in text_of(app.screen.query_one("#cache #prefix-line", Static))
        table = app.screen.query_one("#requests DataTable", DataTable)
        assert "n/a" in str(table.get_row_at(0)[0])


async def test_diff_screen_shows_decoded_text_of_a_diff_result():
    """A `looptrace diff` result holds token ids and the run's weights: the screen decodes them."""
    from looptrace.assets import shipped_weights
    from looptrace.engine.tokenizer import load_tokenizer

    weights = shipped_weights("ouro-tiny")
    tokenizer = load_tokenizer(weights)
    a, b = tokenizer.encode("12+34=46"), tokenizer.encode("12+34=47")
    result = {"header": {"weights": str(weights)}, "requests": [{"id": "r0", "a_tokens": a, "b_tokens": b}]}
    requests = load_diff(result)
    assert "".join(requests[0].a_text) == "12+34=46" and "".join(requests[0].b_text) == "12+34=47"
    app = LooptraceTop(diff=requests, start="diff")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        shown = text_of(app.screen.query_one(TokenDiff))
        assert "4 6" in shown and "4 7" in shown and "first divergence at token 7" in shown
    assert load_diff({"requests": [{"id": "x", "a_tokens": a, "b_tokens": b}]})[0].a_text is None  # no header
