"""`looptrace run` end to end on the tiny CPU presets: table/JSON/CSV output, workloads, bad input."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import looptrace
from looptrace.cli.main import app

REPO = Path(__file__).resolve().parents[2]
FAST = ["--max-tokens", "4", "-c", "2", "--prompt-len", "8", "--no-progress"]
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["run", *FAST, *map(str, args)])


def assert_one_line_error(result, code: int, *needles: str) -> str:
    """Exit `code`, nothing on stdout, exactly one stderr line naming the problem, no traceback."""
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    assert result.stdout == ""
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def slots(kv: dict) -> tuple[int, int, int]:
    return tuple(kv[f"{k}_slots_per_token"] for k in ("reserved", "live", "dead"))


@pytest.fixture(scope="module")
def ouro_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run.json"
    result = invoke("--model", "ouro", "--format", "json", "-o", out)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


# --- success paths --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, preset", [("ouro", "ouro-tiny"), ("huginn", "huginn-tiny")])
def test_table_output(family, preset) -> None:
    result = invoke("--model", family)
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in (
        preset,
        "TTFT",
        "TPOT",
        "ITL",
        "E2EL",
        "KV pool capacity (tokens)",
        "8,192",
        f"'{family}' resolved to {preset} on cpu; pick another with --model",
    ):
        assert text in out, text
    assert result.stderr == ""  # --no-progress, and -c 2 fits in max_num_seqs: no notes


def test_json_output_and_file(ouro_json) -> None:
    data, path = ouro_json
    assert data["schema"] == "looptrace.run/1"
    h = data["header"]
    assert h["model_preset"] == "ouro-tiny" and h["recipe"] == "base"
    assert h["device"].startswith("CPU")
    assert h["versions"]["looptrace"] == looptrace.__version__ and "torch" in h["versions"]
    assert h["config"]["kv"]["layout"] == "planes"
    assert h["config"]["scheduler"]["max_model_len"] == 16  # sized to prompt 8 + 4 tokens, one block
    m = data["metrics"]
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "output_throughput"):
        assert isinstance(m[key], (int, float)) and m[key] >= 0, key
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 0, 8)
    assert data["engine"]["output_tokens"] == 8 and data["engine"]["steps"] > 0
    kv = data["kv"]
    assert kv["capacity_tokens"] == 8192
    assert slots(kv) == (16, 16, 0)  # planes layout: one plane per loop, every slot live
    assert json.loads(path.read_text()) == data
    assert not path.with_name(path.name + ".partial").exists()


def test_huginn_kv_slots() -> None:
    result = invoke("--model", "huginn", "--format", "json")
    assert result.exit_code == 0, result.output
    kv = json.loads(result.stdout)["kv"]
    # 8 recurrent-layer slots x 8 loops reserved; live: 2 prelude + 2 coda + 4 core layers x 8 loops.
    assert slots(kv) == (64, 36, 28)


def test_csv_output() -> None:
    result = invoke("--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.reader(io.StringIO(result.stdout)))
    assert rows[0] == ["section", "metric", "value"]
    keys = {(r[0], r[1]) for r in rows[1:]}
    assert {("metrics", "mean_ttft_ms"), ("engine", "steps"), ("kv", "capacity_tokens")} <= keys


@pytest.mark.parametrize(
    "args, requests",
    [
        (["--workload", "burst"], 2),
        (["--workload", "poisson", "--rate", "50", "--num-requests", "3"], 3),
        (["--workload", "sessions", "--sessions", "2", "--turns", "2"], 4),
    ],
)
def test_workload_kinds(args, requests) -> None:
    result = invoke(*args, "--format", "json")
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["metrics"]
    assert (m["completed"], m["failed"]) == (requests, 0)


def test_jsonl_workload_uses_byte_tokenizer(tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n\n{"prompt": "h\\u00e9", "max_tokens": 2}\n')
    result = invoke("--workload", "jsonl", "--prompts", prompts, "--format", "json")
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["metrics"]
    assert (m["completed"], m["failed"]) == (2, 0)
    assert m["total_input_tokens"] == len(b"hello world") + len("hé".encode())  # UTF-8 bytes
    assert m["total_output_tokens"] == 4 + 2


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"looptrace {looptrace.__version__}"


# --- bad input ------------------------------------------------------------------------------------------
BAD_INPUTS = {
    "unknown model": (["--model", "gpt2"], ["unknown model 'gpt2'", "ouro-tiny"]),
    "unknown --set key": (
        ["--set", "scheduler.max_num_seq=3"],
        ["--set", "scheduler.max_num_seq", "max_num_seqs"],
    ),
    "bad --set value": (["--set", "kv.layout=plane"], ["kv.layout", "'planes' or 'shared'", "'plane'"]),
    "unknown recipe": (["--recipe", "nosuch"], ["unknown recipe 'nosuch'", "base"]),
    "missing weights": (["--weights", "/nonexistent"], ["/nonexistent"]),
    "zero concurrency": (["-c", "0"], ["concurrency", ">= 1", "0"]),
    "negative concurrency": (["-c", "-3"], ["concurrency", ">= 1", "-3"]),
    "poisson without rate": (["--workload", "poisson"], ["--rate"]),
    "jsonl without prompts": (["--workload", "jsonl"], ["--prompts"]),
    "missing prompts file": (["--workload", "jsonl", "--prompts", "/no/p.jsonl"], ["/no/p.jsonl"]),
    "bad dtype": (["--dtype", "fp8"], ["--dtype 'fp8'"]),
}


@pytest.mark.parametrize("args, needles", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_exit_2(args, needles, tmp_path) -> None:
    out = tmp_path / "out.json"
    assert_one_line_error(invoke(*args, "-o", out), 2, *needles)
    assert list(tmp_path.iterdir()) == []


def test_recipe_file_with_unknown_key(tmp_path) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("name: mine\nkv:\n  layot: shared\n")
    line = assert_one_line_error(invoke("--recipe", recipe, "-o", tmp_path / "out.json"), 2)
    assert str(recipe) in line and "kv.layot" in line and "layout" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]


def test_malformed_jsonl_line_names_file_and_line(tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": \n')
    result = invoke("--workload", "jsonl", "--prompts", prompts)
    assert_one_line_error(result, 2, f"{prompts}:2:", "invalid JSON")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_exit_3(tmp_path) -> None:
    assert_one_line_error(invoke("--device", "cuda", "-o", tmp_path / "o.json"), 3, "CUDA is not available")
    assert list(tmp_path.iterdir()) == []


def test_prompt_longer_than_context_is_bad_input(tmp_path) -> None:
    out = tmp_path / "out.json"
    result = invoke("--prompt-len", "5000", "--set", "scheduler.max_model_len=64", "-o", out)
    assert_one_line_error(result, 2, "5000", "64")
    assert not out.exists()


def test_poisson_zero_requests_is_bad_input() -> None:
    result = invoke("--workload", "poisson", "--rate", "5", "--num-requests", "0")
    assert_one_line_error(result, 2, "num_requests")


def test_output_in_missing_directory_is_bad_input() -> None:
    assert_one_line_error(invoke("-o", "/nonexistent_dir/out.json"), 2, "/nonexistent_dir")


# --- a real process: exit code and stderr without CliRunner ---------------------------------------------
def test_subprocess_bad_input(tmp_path) -> None:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "looptrace", "run", *FAST, "--set", "kv.layout=plane", "-o", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"KINETO_LOG_LEVEL": "5"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: --set: kv.layout: Input should be 'planes' or 'shared' (got 'plane')"
    ]
    assert not out.exists()
