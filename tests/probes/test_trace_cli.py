"""`looptrace trace analyze` through Typer's CliRunner, and the report renderers behind it."""

from __future__ import annotations

import csv
import io
import json

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from looptrace.cli.trace_cmd import trace_app
from looptrace.probes.counters import Counters, analyze
from looptrace.probes.events import parse_chrome_trace
from looptrace.probes.report import (
    COMPARE_SCHEMA,
    SCHEMA,
    compare_rows,
    compare_table,
    compare_to_dict,
    compare_to_json,
    counters_table,
    render_compare,
    render_report,
    to_csv,
    to_dict,
    to_json,
)
from tests.cli.test_output_files import char_device

app = typer.Typer()
app.add_typer(trace_app, name="trace")
runner = CliRunner()


@pytest.fixture
def decode_path(decode_kt, tmp_path):
    return decode_kt.write(tmp_path / "decode.json")


def run(*args: str):
    return runner.invoke(app, ["trace", "analyze", *map(str, args)])


# --- CLI ------------------------------------------------------------------------------------------------


def test_table_output(decode_path) -> None:
    result = run(decode_path)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Per-token counters" in out
    assert "lt.window/decode" in out
    assert "norm: 3 kernels × 2 norm calls × 2 layers × 2 loops = 24 kernels/token (50 %)" in out
    assert "WARNING: 1 pageable memcpy in the window" in out
    assert "Top kernels by Instances" in out
    assert result.stderr == ""


def test_json_output(decode_path) -> None:
    result = run(decode_path, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema"] == SCHEMA
    assert (data["mode"], data["tokens"], data["steps"], data["step_marker"]) == ("gpu", 2, 2, "lt.step#")
    assert data["header"]["trace"] == str(decode_path)
    assert (data["totals"]["kernels"], data["per_token"]["kernels"], data["per_step"]["kernels"]) == (
        96,
        48,
        48,
    )
    assert data["syncs_by_kind"]["stream_wait"] == 1
    assert data["breakdown"]["by_op"][0] == {
        "op": "norm", "kernels": 48, "kernels_per_token": 24.0, "share_pct": 50.0, "gpu_us": 96.0
    }  # fmt: skip
    assert data["breakdown"]["by_op_role"][0]["role"] == "core"
    assert data["top_kernels"]["by_time"][0]["count"] == 8


def test_tokens_step_marker_and_window_options(decode_path) -> None:
    def per_token_kernels(*args: str) -> float:
        result = run(decode_path, "--format", "json", *args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["per_token"]["kernels"]

    assert per_token_kernels("--tokens", "4") == 24.0
    assert per_token_kernels("--step-marker", "lt.op/norm") == 6.0  # 16 norm ranges stand for 16 "steps"
    assert per_token_kernels("--window", "prefill") == 5.0
    assert per_token_kernels("--window", "all", "--tokens", "1") == 103.0


def test_csv_output(decode_path) -> None:
    result = run(decode_path, "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == ["section", "key", "metric", "value"]
    lookup = {(r["section"], r["key"], r["metric"]): r["value"] for r in rows}
    assert lookup[("meta", "schema", "value")] == SCHEMA
    assert lookup[("counters", "kernels", "per_token")] == "48.0"
    assert lookup[("counters", "pageable", "totals")] == "1"
    assert lookup[("by_op_role", "norm/core", "kernels")] == "48"
    assert lookup[("formula", "mlp", "text")].startswith("mlp: 1 kernel × 1 mlp call")


def test_output_file(decode_path, tmp_path) -> None:
    out = tmp_path / "report.json"
    result = run(decode_path, "--format", "json", "--output", out)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert f"wrote {out}" in result.stderr
    assert json.loads(out.read_text())["totals"]["kernels"] == 96
    table = tmp_path / "report.txt"
    assert run(decode_path, "-o", table).exit_code == 0
    text = table.read_text()
    assert "Per-token counters" in text
    assert "\x1b[" not in text  # plain text in files


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (None, [], "no such file"),
        ('{"traceEvents": [', [], "invalid JSON"),
        ("[]", [], "no complete ('ph': 'X') events"),
        ('{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0}]}', [], "no complete"),
        ('[{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]', ["--window", "prefill"],
         "no 'lt.window/prefill' range"),
    ],
)  # fmt: skip
def test_errors_are_one_line_exit_2(tmp_path, content: str | None, extra: list[str], message: str) -> None:
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    result = run(path, *extra)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")
    assert message in result.stderr
    assert result.stderr.count("\n") == 1


def assert_one_line_exit_2(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_step_marker_matching_nothing_is_an_error(decode_path, tmp_path) -> None:
    out = tmp_path / "r.json"
    result = run(decode_path, "--step-marker", "execute_model", "-o", out)
    assert_one_line_exit_2(result, "step marker 'execute_model' matches no user_annotation", "lt.step#")
    assert not out.exists()
    with_tokens = run(decode_path, "--step-marker", "execute_model", "--tokens", "4")
    assert_one_line_exit_2(with_tokens, "execute_model")


def test_step_marker_only_outside_the_window_is_an_error(kt, tmp_path) -> None:
    with kt.range("execute_model"):
        kt.cpu_op("aten::mm", kt.tick(), 1.0)
    with kt.range("lt.window/decode"):
        kt.cpu_op("aten::mm", kt.tick(), 1.0)
    path = kt.write(tmp_path / "t.json")
    assert_one_line_exit_2(run(path, "--step-marker", "execute_model"), "1 instance(s), none in the window")


def test_token_markers_are_the_default_divisor(kt, tmp_path) -> None:
    """looptrace's own traces: lt.tokens/<n> markers give the tokens, not the (more numerous) steps."""
    with kt.range("lt.window/decode"):
        for step in range(6):  # 3 steps per token, 2 rows: 2 tokens at every 3rd step
            with kt.range(f"lt.step#{step}"):
                kt.cpu_op("aten::mm", kt.tick(), 1.0)
            if step % 3 == 2:
                kt.annotation("lt.tokens/2", kt.tick(), 0.0)
    kt.annotation("lt.tokens/7", kt.tick(), 0.0)  # outside the window: not counted
    path = kt.write(tmp_path / "t.json")
    data = json.loads(run(path, "--format", "json").stdout)
    assert (data["tokens"], data["steps"], data["per_token"]["kernels"]) == (4, 6, 1.5)
    assert data["tokens_source"].startswith("looptrace token markers")
    given = json.loads(run(path, "--format", "json", "--tokens", "6").stdout)
    assert given["tokens"] == 6  # --tokens still wins
    marker = json.loads(run(path, "--format", "json", "--step-marker", "lt.step#").stdout)
    assert marker["tokens"] == 6  # and so does an explicit --step-marker


@pytest.mark.parametrize(
    "target, needle",
    [("/proc/x", "cannot create files in /proc"), ("DEVICE", ""), (".", "a directory")],
)
def test_unwritable_output_is_one_line_exit_2(decode_path, target, needle, tmp_path) -> None:
    if target == "DEVICE":  # like `-o /dev/full` as root, on a private node
        target, needle = char_device(tmp_path)
    assert_one_line_exit_2(run(decode_path, "-o", target), f"--output {target}", needle)


def test_usage_errors_exit_2(decode_path) -> None:
    assert run(decode_path, "--format", "xml").exit_code == 2
    assert run(decode_path, "--tokens", "0").exit_code == 2


def test_help_has_examples() -> None:
    result = runner.invoke(app, ["trace", "analyze", "--help"])
    assert result.exit_code == 0
    assert "EXAMPLES" in result.stdout
    assert "--step-marker" in result.stdout


# --- report renderers -----------------------------------------------------------------------------------


@pytest.fixture
def analysis(decode_kt):
    return analyze(parse_chrome_trace(decode_kt.to_dict()), tokens=2)


def test_pageable_is_a_warning_row_not_hidden(analysis) -> None:
    clean = Counters(tokens=1, steps=1, window="w", mode="gpu", kernels=10)
    table = counters_table([("base", analysis.counters), ("clean", clean)])
    assert [row.style for row in table.rows] == ["bold yellow", None]
    console = Console(record=True, width=200)
    console.print(table)
    text = console.export_text()
    assert "base" in text and "clean" in text and "pageable" in text


def test_render_report_with_header(analysis) -> None:
    console = Console(record=True, width=200)
    render_report(analysis, {"model": "ouro-1.4b", "device": "H200", "recipe": "base"}, console)
    text = console.export_text()
    for needle in (
        "ouro-1.4b",
        "Kernels by stage",
        "Kernels by op and layer role",
        "recurrent",
        "GPU µs/tok",
    ):
        assert needle in text
    assert "│ base " in text  # the recipe labels the Table A4 row


def test_to_json_round_trip(analysis) -> None:
    data = json.loads(to_json(analysis, {"model": "m"}))
    assert data == json.loads(json.dumps(to_dict(analysis, {"model": "m"})))
    assert data["tool"]["name"] == "looptrace"
    assert data["notes"] == analysis.notes
    assert to_csv(analysis, {"model": "m"}).splitlines()[0] == "section,key,metric,value"


def test_compare_ratios() -> None:
    a = Counters(tokens=2, steps=2, window="w", mode="gpu", kernels=100, dtoh=2, pageable=0)
    b = Counters(tokens=2, steps=2, window="w", mode="gpu", kernels=50, dtoh=0, pageable=3, memset=4)
    rows = {r["counter"]: r for r in compare_rows(a, b)}
    assert (rows["kernels"]["a_per_token"], rows["kernels"]["b_per_token"], rows["kernels"]["ratio"]) == (
        50.0, 25.0, 0.5
    )  # fmt: skip
    assert rows["dtoh"]["ratio"] == 0.0
    assert rows["memset"]["ratio"] is None  # A is 0
    assert rows["htod"]["ratio"] is None
    table = compare_table(a, b, ("base", "exact"))
    console = Console(record=True, width=120)
    console.print(table)
    text = console.export_text()
    assert "0.50×" in text and "inf" in text and "–" in text
    pageable_row = [r["counter"] for r in compare_rows(a, b)].index("pageable")
    assert table.rows[pageable_row].style == "bold yellow"
    data = json.loads(compare_to_json(a, b, ("base", "exact"), {"model": "m"}))
    assert data["schema"] == COMPARE_SCHEMA
    assert data["labels"] == ["base", "exact"]
    assert data == json.loads(json.dumps(compare_to_dict(a, b, ("base", "exact"), {"model": "m"})))
    render_compare(a, b, ("base", "exact"), Console(record=True, width=160), header={"model": "m"})


def test_unknown_device_is_one_line_exit_2(decode_path) -> None:
    assert_one_line_exit_2(run(decode_path, "--device", "no-such-gpu"), "--device", "no-such-gpu")


def test_old_vllm_step_marker_is_a_default(kt, tmp_path) -> None:
    for _ in range(3):
        with kt.range("execute_model"):
            kt.launch("gemm", kt.tick(), 1.0)
    data = json.loads(run(kt.write(tmp_path / "t.json"), "--format", "json").stdout)
    assert (data["step_marker"], data["steps"], data["tokens"]) == ("execute_model", 3, 3)
