"""`looptrace top` from the command line: --once tables, and bad input as one line with exit code 2."""

from __future__ import annotations

import socket

from typer.testing import CliRunner

from looptrace.cli.main import app
from tests.tui.conftest import SESSION

runner = CliRunner()


def test_once_on_a_replay_prints_a_table():
    result = runner.invoke(app, ["top", "--replay", str(SESSION), "--once"])
    assert result.exit_code == 0, result.output
    assert "output tokens/s" in result.output and "TTFT p50 / p99" in result.output
    assert "depth P" in result.output and "n/a" in result.output


def test_once_on_a_vllm_endpoint(vllm_endpoint):
    url, _ = vllm_endpoint
    result = runner.invoke(app, ["top", "--prometheus", url, "--once", "--interval", "0.05"])
    assert result.exit_code == 0, result.output
    # the second of the two scrapes (tokens/s needs two): test_top_panels checks the rate itself
    assert "16 / 5" in result.output  # running / waiting
    assert "30.5 %" in result.output  # vllm:kv_cache_usage_perc


def test_unreachable_url_is_exit_2():
    # A port bound but never listening refuses connections, and stays ours while the test runs (a port
    # closed before the call could be taken by a server of a test running in parallel: pytest -n 2).
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        result = runner.invoke(app, ["top", f"http://127.0.0.1:{port}", "--once"])
    assert result.exit_code == 2
    assert "cannot connect" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_malformed_replay_is_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"schema": "looptrace.top-session/1"}\n{"t": 0, "snapshot": [1]}\n')
    result = runner.invoke(app, ["top", "--replay", str(bad)])
    assert result.exit_code == 2 and f"{bad}:2:" in result.output.replace("\n", "")
    result = runner.invoke(app, ["top", "--replay", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2 and "no such file" in result.output


def test_conflicting_sources_and_bad_diff_are_exit_2(tmp_path):
    result = runner.invoke(app, ["top", "http://127.0.0.1:1", "--replay", str(SESSION)])
    assert result.exit_code == 2
    bad = tmp_path / "d.json"
    bad.write_text("[]")
    result = runner.invoke(app, ["top", "--replay", str(SESSION), "--diff", str(bad), "--once"])
    assert result.exit_code == 2 and "requests" in result.output
