"""`looptrace profile` on the tiny Ouro preset (CPU: kernels are leaf ATen ops), --compare, and the
consistency of its Chrome trace with `looptrace trace analyze`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looptrace.cli.main import app

REPO = Path(__file__).resolve().parents[2]
# ouro-tiny at -c 1 takes 6 engine steps per token: 24 steps = 4 tokens.
FAST = ["--model", "ouro", "--prompt-len", "16", "--decode-steps", "24"]
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def quiet_kineto():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KINETO_LOG_LEVEL", "5")
        yield


def invoke(*args: str):
    return runner.invoke(app, ["profile", *map(str, args)])


def assert_one_line_error(result, *needles: str) -> None:
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, quiet_kineto):
    """One profile run: JSON on stdout, the same JSON in -o, and its Chrome trace."""
    tmp = tmp_path_factory.mktemp("profile")
    trace, out = tmp / "t.json", tmp / "p.json"
    result = invoke(*FAST, "--format", "json", "--trace", trace, "-o", out)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out, trace


def test_default_profile_in_subprocess_under_30s() -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "looptrace", "profile", "--model", "ouro"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"KINETO_LOG_LEVEL": "5"},
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert wall < 30, f"profile took {wall:.1f} s"
    out = proc.stdout
    for text in (
        "ouro-tiny",
        "Per-token counters",
        "Kernels per token by op",
        "Syncs and copies by site",
        "Engine counters in each window",
        "cross-check, whole profiler session",
        "mode cpu",
    ):
        assert text in out, text
    norm = [line for line in out.splitlines() if line.startswith("norm: ")]
    assert norm and "kernels/token" in norm[0] and " loops" in norm[0], norm
    assert "Traceback" not in proc.stderr


def test_json_report(profiled) -> None:
    data, out, _ = profiled
    assert data["schema"] == "looptrace.profile/1"
    assert data["header"]["model_preset"] == "ouro-tiny" and data["header"]["level"] == "op"
    decode = data["windows"]["decode"]
    assert decode["mode"] == "cpu"
    assert decode["per_token"]["kernels"] > 0
    assert "norm" in {row["op"] for row in decode["breakdown"]["by_op"]}
    engine = decode["engine"]
    assert engine["tokens"] == 4 and engine["steps"] == 6 * engine["tokens"]
    assert data["windows"]["prefill"]["engine"]["tokens"] == 16  # per prompt token, -c 1
    assert data["raw_profiler_counts"] == data["trace_counts"]  # the exported trace lost no event
    assert json.loads(out.read_text()) == data


def test_trace_file_is_chrome_json_with_decode_window(profiled) -> None:
    _, _, trace = profiled
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "lt.window/decode" for e in events)


def test_trace_analyze_agrees_with_profile(profiled) -> None:
    data, _, trace = profiled
    decode = data["windows"]["decode"]
    result = runner.invoke(
        app,
        [
            "trace",
            "analyze",
            str(trace),
            "--window",
            "decode",
            "--tokens",
            str(decode["tokens"]),
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    analyzed = json.loads(result.stdout)
    assert analyzed["mode"] == "cpu"
    assert analyzed["totals"]["kernels"] == decode["totals"]["kernels"]
    assert analyzed["per_token"]["kernels"] == decode["per_token"]["kernels"]
    by_op = {r["op"]: r["kernels"] for r in analyzed["breakdown"]["by_op"]}
    assert by_op == {r["op"]: r["kernels"] for r in decode["breakdown"]["by_op"]}


COMPARE = [*FAST[:4], "--decode-steps", "12", "--compare", "base", "base", "--b-set", "exit.max_loops=2"]


def test_compare_json_fewer_loops_fewer_kernels() -> None:
    result = invoke(*COMPARE, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema"] == "looptrace.compare/1"
    assert data["a"]["header"]["label"] == "base"
    assert data["b"]["header"]["label"] == "base + exit.max_loops=2"
    rows = {r["counter"]: r for r in data["decode_comparison"]}
    assert 0 < rows["kernels"]["ratio"] < 1
    assert rows["kernels"]["b_per_token"] < rows["kernels"]["a_per_token"]


def test_compare_table_shows_both_labels() -> None:
    result = invoke(*COMPARE)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Decode window, per output token" in out
    assert "Engine counters: base" in out and "Engine counters: base + exit.max_loops=2" in out
    assert "base + exit.max_loops=2 vs base" in out


def test_output_in_missing_directory_is_bad_input() -> None:
    assert_one_line_error(
        invoke("--prompt-len", "8", "--decode-steps", "6", "-o", "/nonexistent_dir/p.json"),
        "/nonexistent_dir",
    )


BAD_INPUTS = {
    "bad level": (["--level", "bogus"], ["--level 'bogus'", "step, loop, layer, op"]),
    "bad compare recipe": (["--compare", "nosuch", "base"], ["unknown recipe 'nosuch'"]),
    "a-set without compare": (["--a-set", "exit.max_loops=2"], ["--compare"]),
    "zero concurrency": (["-c", "0"], ["--concurrency"]),
    "trace in missing dir": (["--trace", "/nonexistent_dir/t.json"], ["/nonexistent_dir"]),
}


@pytest.mark.parametrize("args, needles", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_exit_2(args, needles, tmp_path) -> None:
    assert_one_line_error(invoke(*args, "-o", tmp_path / "out.txt"), *needles)
    assert list(tmp_path.iterdir()) == []


def test_compare_bad_b_recipe_fails_before_profiling(tmp_path) -> None:
    trace = tmp_path / "t.json"
    result = invoke(
        "--prompt-len", "8", "--decode-steps", "6", "--compare", "base", "nosuch", "--trace", trace
    )
    assert_one_line_error(result, "unknown recipe 'nosuch'")
    assert not trace.exists()
