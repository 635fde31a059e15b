"""`looptrace profile` on the tiny Ouro preset (CPU: kernels are leaf ATen ops), --compare, and the
consistency of its Chrome trace with `looptrace trace analyze`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looptrace.cli.main import app
from tests.cli.test_output_files import char_device

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
    """One profile run: the JSON report in -o (the terminal gets the table), and its Chrome trace. No
    --format: the `.json` suffix of -o selects JSON. (data, report file, trace file, CLI result)."""
    tmp = tmp_path_factory.mktemp("profile")
    trace, out = tmp / "t.json", tmp / "p.json"
    result = invoke(*FAST, "--trace", trace, "-o", out)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), out, trace, result


def test_default_profile_in_subprocess() -> None:
    """The README's main command, as a user runs it (its wall time is measured, not asserted: a test
    asserts behaviour; speed belongs to bench scripts)."""
    proc = subprocess.run(
        [sys.executable, "-m", "looptrace", "profile", "--model", "ouro"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"KINETO_LOG_LEVEL": "5"},
    )
    assert proc.returncode == 0, proc.stderr
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
    data, out, _, _ = profiled
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
    assert data["header"]["loop_routes"] == {}  # base has no persistent loop op
    assert json.loads(out.read_text()) == data


def test_json_output_file_prints_the_table_not_the_json(profiled) -> None:
    data, out, trace, result = profiled
    stdout = result.stdout
    assert "{" not in stdout  # not one line of the JSON report
    assert "per token" in stdout.lower() and data["header"]["model_preset"] in stdout  # the table
    lines = len(out.read_text().splitlines())
    assert stdout.rstrip().splitlines()[-1] == f"wrote {out} (json, {lines} lines)"
    assert "higher than the TPOT of an unprofiled" in stdout  # the profiler's overhead, said
    next_step = " ".join(result.stderr.split())  # where to look at the trace
    assert f"next: open {trace} in Perfetto (ui.perfetto.dev)" in next_step
    assert f"looptrace trace analyze {trace}" in next_step


def test_trace_file_is_chrome_json_with_decode_window(profiled) -> None:
    _, _, trace, _ = profiled
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "lt.window/decode" for e in events)


def test_trace_analyze_agrees_with_profile_given_tokens(profiled) -> None:
    data, _, trace, _ = profiled
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


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One --compare run: its JSON report in -o, its table on stdout. (data, stdout)."""
    out = tmp_path_factory.mktemp("compare") / "compare.json"
    result = invoke(*COMPARE, "-o", out)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.stdout


def test_compare_json_fewer_loops_fewer_kernels(compared) -> None:
    data, _ = compared
    assert data["schema"] == "looptrace.compare/1"
    assert data["a"]["header"]["label"] == "base"
    assert data["b"]["header"]["label"] == "base + exit.max_loops=2"
    rows = {r["counter"]: r for r in data["decode_comparison"]}
    assert 0 < rows["kernels"]["ratio"] < 1
    assert rows["kernels"]["b_per_token"] < rows["kernels"]["a_per_token"]
    prefill = {r["counter"]: r for r in data["prefill_comparison"]}  # prefill runs 2 loops, not 4
    assert 0 < prefill["kernels"]["b_per_token"] < prefill["kernels"]["a_per_token"]


def test_compare_table_shows_both_labels(compared) -> None:
    _, out = compared
    assert "Decode window, per output token" in out
    assert "Engine counters: base" in out and "Engine counters: base + exit.max_loops=2" in out
    assert "base + exit.max_loops=2 vs base (per token)" in out
    assert "Prefill window, per prompt token" in out
    assert "base + exit.max_loops=2 vs base (prefill, per prompt token)" in out
    head = out.split("Decode window, per output token")[0]  # a header before the tables
    for needle in ("model", "ouro-tiny", "device", "CPU", "versions", "torch", "A: base", "B: base + exit"):
        assert needle in head, needle
    assert "no effect here" not in out  # exit.max_loops acts on a CPU
    assert "higher than the TPOT of an unprofiled" in out


def test_compare_names_a_setting_with_no_effect_here() -> None:
    """As `diff` does: a setting that differs but does nothing on this device leaves the sides equal."""
    from looptrace.engine import EngineConfig, LLMEngine
    from looptrace.probes.profile_report import no_effect_notes

    inactive = LLMEngine.from_preset("ouro-tiny", EngineConfig(), device="cpu").inactive_settings
    config = {"cuda_graphs": {"enabled": True}, "exit": {"max_loops": None}}
    b_config = {"cuda_graphs": {"enabled": False}, "exit": {"max_loops": 2}}
    sides = [{"header": {"config": c, "inactive_settings": inactive}} for c in (config, b_config)]
    why = inactive["cuda_graphs"]
    assert no_effect_notes(sides) == [
        f"note: cuda_graphs.enabled differs between A and B but has no effect here ({why}): "
        "its effect is untested"
    ]


def test_the_header_says_how_the_loop_op_ran_each_row_count() -> None:
    """`fast` at 8 rows runs exactloop's kernels: the header says the ring took one-row loops only, and
    why not the others (a --compare prints side B's line under the shared header)."""
    from looptrace.probes.profile_report import _display_header, loop_routes_text, side_b_loop_routes

    routes = {"1": "one launch per loop (TMA ring)", "8": "layer by layer (8 rows: the ring takes one)"}
    text = "1 row: one launch per loop (TMA ring); 8 rows: layer by layer (8 rows: the ring takes one)"
    assert loop_routes_text(routes) == text
    header = dict(model_preset="ouro-1.4b", family="ouro", loops=4, weights="random", device="H100",
                  dtype="bfloat16", versions={"looptrace": "0"}, label="fast", concurrency=8, prompt_len=512,
                  level="op", preset_note="", loop_routes=routes)  # fmt: skip
    side = {"header": header, "windows": {"decode": {"engine": {"steps": 8, "tokens": 64}}}}
    assert _display_header(side)["loop op"] == text
    plain = {**side, "header": {**header, "loop_routes": {}}}
    assert "loop op" not in _display_header(plain)
    assert side_b_loop_routes([plain, side], "fast") == [f"loop op (fast): {text}"]
    assert side_b_loop_routes([side, plain], "exactloop") == []  # side A's is in the shared header


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
    "trace in /proc": (["--trace", "/proc/t.json"], ["--trace /proc/t.json", "cannot create files in /proc"]),
    "negative seed": (["--seed", "-1"], ["--seed -1"]),
    "prompt longer than context": (["--prompt-len", "5000"], ["5000", "4096"]),
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


def test_trace_onto_a_device_is_refused(tmp_path) -> None:
    node, kind = char_device(tmp_path)  # a private /dev/null twin
    assert_one_line_error(invoke("--prompt-len", "8", "--trace", node), f"--trace {node}", kind)
    assert not stat.S_ISREG(os.stat(node).st_mode)


@pytest.mark.parametrize("content", [None, "keep"], ids=["empty dir", "non-empty dir"])
def test_trace_onto_a_directory_is_refused_and_left_alone(tmp_path, content) -> None:
    target = tmp_path / "traces"
    target.mkdir()
    if content:
        (target / "keep.json").write_text(content)
    assert_one_line_error(invoke("--prompt-len", "8", "--trace", target), "--trace", "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["traces"]  # no traces.tmp
    assert [p.read_text() for p in target.iterdir()] == ([content] if content else [])


# --- profile and trace analyze of the same trace agree, for every family ----------------------------------
@pytest.mark.parametrize("family", ["ouro", "huginn", "olmo"])
def test_trace_analyze_reports_the_same_tokens_as_profile(family, tmp_path) -> None:
    """No --tokens: `trace analyze` reads the lt.tokens markers of profile's own trace, so Huginn's 10 steps
    per token no longer turn into 10 "tokens". The trace is written through a symlink."""
    real = tmp_path / "store" / "trace.json"
    real.parent.mkdir()
    link = tmp_path / "t.json"
    link.symlink_to(real)
    report = tmp_path / "p.json"
    result = invoke("--model", family, "--prompt-len", "8", "--decode-steps", "20", "--level", "loop",
                    "--trace", link, "-o", report)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and real.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "store", "t.json"]
    profiled = json.loads(report.read_text())["windows"]
    for window in ("decode", "prefill"):
        analyzed = runner.invoke(app, ["trace", "analyze", str(link), "--window", window, "--format", "json"])
        assert analyzed.exit_code == 0, analyzed.output
        a, p = json.loads(analyzed.stdout), profiled[window]
        assert a["tokens"] == p["tokens"] == p["engine"]["tokens"], window
        assert a["steps"] == p["steps"]
        assert a["per_token"]["kernels"] == pytest.approx(p["per_token"]["kernels"]), window
        assert a["tokens_source"].startswith("looptrace token markers")
    decode = profiled["decode"]
    assert decode["steps"] > decode["tokens"] >= 2  # several engine steps per token: the old bug's trigger


# --- Ctrl-C -------------------------------------------------------------------------------------------------
def ctrl_c_in(monkeypatch, burst: int) -> None:
    """Ctrl-C at the first engine step after the `burst`-th request burst (1: warm-up, 2: prefill window)."""
    from looptrace.engine.llm_engine import LLMEngine
    from looptrace.probes import session

    state = {"bursts": 0}
    real_burst, real_step = session._burst, LLMEngine.step

    def counting_burst(*args, **kwargs):
        state["bursts"] += 1
        return real_burst(*args, **kwargs)

    def step(self):
        if state["bursts"] >= burst:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(session, "_burst", counting_burst)
    monkeypatch.setattr(LLMEngine, "step", step)


def test_ctrl_c_in_prefill_window_reports_the_decode_window(monkeypatch, tmp_path) -> None:
    ctrl_c_in(monkeypatch, burst=2)
    trace, out = tmp_path / "t.json", tmp_path / "p.json"
    result = invoke(*FAST, "--trace", trace, "-o", out)
    assert result.exit_code == 130, result.output
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and list(data["windows"]) == ["decode"]
    assert data["windows"]["decode"]["engine"]["tokens"] == 4
    assert "interrupted" in result.stderr and "Traceback" not in result.output
    analyzed = runner.invoke(app, ["trace", "analyze", str(trace), "--format", "json"])
    assert json.loads(analyzed.stdout)["tokens"] == 4  # the trace of the finished window is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "t.json"]


def test_ctrl_c_before_any_window_writes_nothing(monkeypatch, tmp_path) -> None:
    ctrl_c_in(monkeypatch, burst=1)
    result = invoke(*FAST, "--trace", tmp_path / "t.json", "-o", tmp_path / "p.json")
    assert result.exit_code == 130, result.output
    assert "no report written" in result.stderr and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []  # no trace, no report, no temp file


def test_compare_shows_the_gate_readback_of_the_base_exit_policy(tmp_path) -> None:
    """The base engine's `gate` policy reads Ouro's gate logits back after every loop; `fixed` does not.
    On CPU the readback is one copy op per recurrent step: 4 more copy kernels per token (4 loops); the
    base's async gate readback also keeps each row's pre-loop state (one index_copy per loop) for a late
    exit's rollback: 4 more kernels."""
    out = tmp_path / "cmp.json"  # FAST: a 4-token decode window (the default is 8): the same counts per token
    result = invoke("--compare", "base", "base", "--b-set", "exit.policy=fixed", *FAST, "-o", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    gate, fixed = (data[arm]["windows"]["decode"]["per_token"] for arm in ("a", "b"))
    assert gate["copy_kernels"] - fixed["copy_kernels"] == 4
    assert gate["kernels"] - fixed["kernels"] == 8
    out = tmp_path / "sync.json"
    args = [
        "--a-set",
        "scheduler.async_gate=false",
        "--b-set",
        "exit.policy=fixed",
        *FAST,
        "-o",
        out,
    ]
    assert invoke("--compare", "base", "base", *args).exit_code == 0
    data = json.loads(out.read_text())
    sync, fixed = (data[arm]["windows"]["decode"]["per_token"] for arm in ("a", "b"))
    assert sync["kernels"] - fixed["kernels"] == 4  # the synchronous readback alone


def test_compare_csv_has_both_windows() -> None:
    result = invoke(*COMPARE, "--format", "csv")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "window,counter,a_per_token,b_per_token,ratio_b_over_a"
    rows = {tuple(line.split(",")[:2]): line.split(",") for line in lines[1:]}
    for window in ("decode", "prefill"):
        a, b = float(rows[window, "kernels"][2]), float(rows[window, "kernels"][3])
        assert 0 < b < a  # 2 loops instead of 4, in decode and in prefill


def test_cpu_profile_json_labels_cpu_op_time(profiled) -> None:
    """On CPU the measured time is CPU op time: every `gpu_us` has a `cpu_op_us` twin (kept for one
    release), the roofline's per-token time too, and the report says what it measured."""
    data, _, _, _ = profiled
    decode = data["windows"]["decode"]
    assert decode["mode"] == "cpu" and decode["time_measured"].startswith("CPU op time")
    assert decode["totals"]["cpu_op_us"] == decode["totals"]["gpu_us"] > 0
    rows = decode["roofline"]["rows"]
    assert rows and all(r["cpu_op_us_per_token"] == r["gpu_us_per_token"] for r in rows)


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_status_line_on_a_terminal_but_not_under_json(monkeypatch, fmt: str) -> None:
    """A status line on stderr while profiling (45 s of blank screen at real shape on a CPU), drawn only on
    a terminal and not when stdout carries JSON."""
    import io

    from rich.console import Console

    from looptrace.cli import common

    terminal = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=terminal, force_terminal=True, stderr=True))
    result = invoke("--model", "ouro", "--prompt-len", "8", "--decode-steps", "6", "--format", fmt)
    assert result.exit_code == 0, result.output
    # Which stages get drawn depends on the spinner's refresh timing (a fast machine finishes the warm-up
    # between two refreshes); the stop always draws the last one, so look for the side's name.
    assert ("base: " in terminal.getvalue()) == (fmt == "table")
