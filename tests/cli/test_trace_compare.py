"""`looptrace trace compare A B` on the real traces in ../shared/traces and on saved reports."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looptrace.cli.main import app
from looptrace.probes.compare import SCHEMA, compare_reports

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
SGLANG = TRACES / "sglang_prefilldecode" / "sglang_Qwen3-8B_prefilldecode.json.gz"
H100 = TRACES / "h100_qwen1.5_0.5b" / "trace.json.gz"
runner = CliRunner()


def _need(*paths: Path) -> None:
    for p in paths:
        if not p.exists():
            pytest.skip(f"{p} not present (shared real traces)")


def invoke(*args: object):
    return runner.invoke(app, ["trace", "compare", *map(str, args)])


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def sglang_self() -> dict:
    _need(SGLANG)
    result = invoke(SGLANG, SGLANG, "--format", "json", "--top", "0")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_trace_against_itself_gives_ratio_one_everywhere(sglang_self):
    data = sglang_self
    assert data["schema"] == SCHEMA and data["labels"] == ["A", "B"]
    assert [r["source"] for r in data["runs"]] == ["trace", "trace"]
    for section in ("totals", "categories", "ops"):
        rows = data[section]
        assert rows, section
        for r in rows:
            assert r["a_per_token"] == r["b_per_token"]
            # exactly 1.0 where A has time; null only where both sides are 0
            assert r["ratio"] == 1.0 if r["a_per_token"] else r["ratio"] is None, r
    totals = {r["key"]: r for r in data["totals"]}
    assert totals["kernels"]["a_total"] > 0 and totals["kernels"]["ratio"] == 1.0


def test_saved_report_compares_like_its_trace(sglang_self, tmp_path):
    report = tmp_path / "sglang_report.json"
    analyzed = runner.invoke(app, ["trace", "analyze", str(SGLANG), "--format", "json", "-o", str(report)])
    assert analyzed.exit_code == 0, analyzed.output
    result = invoke(report, SGLANG, "--format", "json", "--top", "0")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [r["source"] for r in data["runs"]] == ["report", "trace"]
    for section in ("totals", "categories", "ops"):
        assert [(r["key"], r["ratio"]) for r in data[section]] == [
            (r["key"], r["ratio"]) for r in sglang_self[section]
        ]


def test_two_different_real_traces(tmp_path):
    _need(SGLANG, H100)
    out = tmp_path / "cmp.csv"
    result = invoke(SGLANG, H100, "--labels", "sglang,hf", "-o", out)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    sections = {r["section"] for r in rows}
    assert sections == {"totals", "categories", "ops"}
    kernels = next(r for r in rows if r["section"] == "totals" and r["key"] == "kernels")
    a, b = float(kernels["a_per_token"]), float(kernels["b_per_token"])
    assert a > 0 and b > 0 and float(kernels["ratio"]) == pytest.approx(b / a)
    # the table names both labels and the B/A column
    table = invoke(SGLANG, H100, "--labels", "sglang,hf", "--top", "5")
    assert table.exit_code == 0, table.output
    assert "hf vs sglang" in table.stdout and "B/A" in table.stdout


def test_rows_present_on_one_side_only():
    a = {
        "tokens": 2,
        "totals": {"kernels": 10},
        "categories": [{"category": "GEMM", "gpu_us": 8.0}],
        "ops": [],
    }
    b = {
        "tokens": 4,
        "totals": {"kernels": 40},
        "categories": [{"category": "GEMM", "gpu_us": 8.0}, {"category": "MoE", "gpu_us": 4.0}],
        "ops": [{"category": "MoE", "op": "vllm::moe_forward", "layer": 3, "calls": 2, "gpu_us": 4.0}],
    }
    data = compare_reports(a, b, ("a", "b"), (Path("a"), Path("b")), by_layer=True)
    totals = {r["key"]: r for r in data["totals"]}
    assert totals["kernels"]["ratio"] == 2.0  # 10/2 per token vs 40/4
    cats = {r["key"]: r for r in data["categories"]}
    assert cats["GEMM"]["ratio"] == 0.5 and cats["MoE"]["ratio"] is None and cats["MoE"]["b_per_token"] == 1.0
    (op,) = data["ops"]
    assert op["layer"] == "3" and op["a_calls"] == 0 and op["b_calls"] == 2
    # by default an op's layers are summed into one row
    b["ops"].append({"category": "MoE", "op": "vllm::moe_forward", "layer": 4, "calls": 2, "gpu_us": 6.0,
                     "pct_of_peak": 50.0})  # fmt: skip
    (merged,) = compare_reports(a, b, ("a", "b"), (Path("a"), Path("b")))["ops"]
    assert merged["layer"] is None and merged["b_calls"] == 4 and merged["b_total"] == 10.0
    assert merged["b_pct_of_peak"] == pytest.approx(100 * 3.0 / 10.0)  # the floor summed over the time summed


def test_vllm_graph_replay_is_attributed_through_the_capture_folder_beside_it():
    replay = TRACES / "vllm_decode_full" / "graph_execution.json.gz"
    _need(replay)
    result = invoke(replay, replay, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    cats = {r["key"]: r for r in data["categories"]}
    assert cats["MoE"]["a_share"] > 50 and cats["MoE"]["ratio"] == 1.0  # TraceLens: MoE 67 %
    # each GEMM shape is its own row, at its own place on the roofline
    gemms = {r["op"]: r["a_pct_of_peak"] for r in data["ops"] if r["op"].startswith("aten::addmm")}
    assert set(gemms) == {f"aten::addmm [{s}]" for s in ("32×5120×2880", "32×2880×4096", "32×32×2880")}
    assert abs(gemms["aten::addmm [32×5120×2880]"] - 35.2) <= 1.0
    assert data["runs"][0]["device"] == "AMD Instinct MI300X"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"this is not json", "invalid JSON"),
        (b'{"hello": 1}', "not a Chrome trace"),
        (b'{"schema": "looptrace.profile/1", "tokens": 1}', "no 'totals'"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert_one_line_error(invoke(bad, bad), needle)


def test_missing_file_truncated_gzip_and_bad_options(tmp_path):
    assert_one_line_error(invoke(tmp_path / "nope.json", tmp_path / "nope.json"), "nope.json")
    gz = tmp_path / "cut.json.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00truncated")
    assert_one_line_error(invoke(gz, gz), "cut.json.gz")
    ok = tmp_path / "ok.json"
    ok.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 1}]}')
    assert_one_line_error(invoke(ok, ok, "--labels", "onlyone"), "--labels")
    assert_one_line_error(invoke(ok, ok, "--device", "tpu-v9"), "unknown device")
    assert_one_line_error(invoke(ok, ok, "-o", ok), "ok.json")  # the output would replace input A
    assert_one_line_error(invoke(ok, ok, "--capture-a", tmp_path), "execution_details.json")


def _phased(phase: str, unit: str, tokens: int, gpu_us: float, source: str) -> dict:
    return {
        "tokens": tokens,
        "tokens_source": source,
        "totals": {"kernels": 100, "gpu_us": gpu_us},
        "categories": [{"category": "GEMM", "gpu_us": gpu_us}],
        "ops": [],
        "phases": [
            {
                "phase": phase,
                "steps": 1,
                "tokens": tokens,
                "unit": unit,
                "gpu_us": gpu_us,
                "per_token_us": gpu_us / tokens,
            }
        ],  # fmt: skip
    }


def test_different_token_units_are_said_and_phases_compare_like_with_like():
    """A prefill (per prompt token) against a decode (per output token): the ratios divide different
    things, which the comparison says; a decode against a decode compares like with like."""
    prefill = _phased("prefill", "prompt token", 512, 5_000.0, "… 512 prompt tokens (context rows) …")
    decode = _phased("decode", "output token", 32, 1_000.0, "… 32 output tokens (generation rows) …")
    paths = (Path("a"), Path("b"))
    data = compare_reports(decode, prefill, ("dec", "pre"), paths)
    assert data["same_unit"] is False
    assert [r["token_unit"] for r in data["runs"]] == ["output token", "prompt token"]
    assert data["notes"][0].startswith(
        "WARNING: per-token units differ (dec: per output token, pre: per prompt"
    )
    assert data["phases"] == []  # no phase on both sides
    other = _phased("decode", "output token", 64, 4_000.0, "… 64 output tokens (generation rows) …")
    other["phases"].append({"phase": "prefill", "steps": 1, "tokens": 10, "unit": "prompt token",
                            "gpu_us": 100.0, "per_token_us": 10.0})  # fmt: skip
    like = compare_reports(decode, other, ("a", "b"), paths)
    assert like["same_unit"] is False  # a decode-only window against prefill + decode steps
    (phase,) = like["phases"]
    assert (phase["key"], phase["unit"], phase["a_per_token"], phase["b_per_token"]) == (
        "decode", "output token", 1_000.0 / 32, 4_000.0 / 64)  # fmt: skip
    assert phase["ratio"] == pytest.approx(2.0)
    same = compare_reports(decode, _phased("decode", "output token", 8, 80.0, "x"), ("a", "b"), paths)
    assert same["same_unit"] is True and not any(n.startswith("WARNING") for n in same["notes"])


def test_real_decode_against_prefill_warns():
    replay = TRACES / "vllm_decode_full" / "graph_execution.json.gz"
    _need(replay, SGLANG)
    result = invoke(replay, SGLANG, "--top", "3")
    assert result.exit_code == 0, result.output
    assert "per-token units differ" in result.stdout
    assert "A: per output token, B: per prompt token" in " ".join(result.stdout.split())
