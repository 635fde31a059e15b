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
from tests.cli.test_output_files import char_device

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
    assert "{" not in result.stdout and "TPOT" in result.stdout  # -o X.json: the table on the terminal
    assert result.stdout.rstrip().splitlines()[-1].startswith(f"wrote {out} (json, ")
    return json.loads(out.read_text()), out


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


def test_a_burst_wider_than_the_batch_rows_gets_a_note() -> None:
    """-c 2 over max_num_seqs 1: the note names the engine's row limit and the setting that lifts it."""
    result = invoke("--model", "ouro", "--set", "scheduler.max_num_seqs=1")
    assert result.exit_code == 0, result.output
    note = (
        "batches hold at most 1 rows (scheduler.max_num_seqs); "
        "pass --set scheduler.max_num_seqs=2 to batch all 2 requests"
    )
    assert note in " ".join(result.stderr.split()), result.stderr


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
    assert m["total_input_tokens"] == 1 + len(b"hello world") + 1 + len("hé".encode())  # BOS, UTF-8 bytes
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
    "bad --set value": (["--set", "kv.layout=plane"], ["kv.layout", "'planes'", "'shared'", "'plane'"]),
    "unknown recipe": (["--recipe", "nosuch"], ["unknown recipe 'nosuch'", "base"]),
    "missing weights": (["--weights", "/nonexistent"], ["/nonexistent"]),
    "zero concurrency": (["-c", "0"], ["concurrency", ">= 1", "0"]),
    "negative concurrency": (["-c", "-3"], ["concurrency", ">= 1", "-3"]),
    "poisson without rate": (["--workload", "poisson"], ["--rate"]),
    "jsonl without prompts": (["--workload", "jsonl"], ["--prompts"]),
    "missing prompts file": (["--workload", "jsonl", "--prompts", "/no/p.jsonl"], ["/no/p.jsonl"]),
    "bad dtype": (["--dtype", "fp8"], ["--dtype 'fp8'"]),
    "negative seed": (["--seed", "-1"], ["--seed -1", "0 to 2**64-1"]),
    "seed too large": (["--seed", str(2**64)], ["--seed 18446744073709551616"]),
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
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: --set: kv.layout: Input should be 'planes'") and line.endswith(
        "(got 'plane')"
    )
    assert not out.exists()


# --- output files: checked before the run, never clobbering directories or devices -----------------------
@pytest.mark.parametrize(
    "target, needle",
    [(".", "is a directory"), ("/proc/x.json", "cannot create files in /proc"), ("DEVICE", "")],
)
def test_unwritable_output_is_one_line_exit_2(target, needle, tmp_path) -> None:
    if target == "DEVICE":  # like `-o /dev/full` as root, on a private node (see char_device)
        target, needle = char_device(tmp_path)
    before = os.stat(target) if os.path.exists(target) else None
    assert_one_line_error(invoke("-o", target), 2, f"--output {target}", needle)
    if before is not None:  # the directory or device node is untouched
        after = os.stat(target)
        assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)


def test_output_onto_non_empty_directory_leaves_nothing(tmp_path) -> None:
    target = tmp_path / "results"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    assert_one_line_error(invoke("-o", target), 2, "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # no results.partial
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_output_format_from_suffix_written_through_symlink(tmp_path) -> None:
    real = tmp_path / "data" / "latest.txt"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "run.csv"
    link.symlink_to(real)
    result = invoke("-o", link)  # no --format: .csv decides the file's format; stdout gets the table
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(real)
    rows = list(csv.reader(io.StringIO(real.read_text())))
    assert rows[0] == ["section", "metric", "value"]
    assert "section,metric,value" not in result.stdout and "TPOT" in result.stdout
    assert result.stdout.rstrip().splitlines()[-1] == f"wrote {link} (csv, {len(rows)} lines)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "run.csv"]
    assert [p.name for p in real.parent.iterdir()] == ["latest.txt"]


def test_json_suffix_means_json(tmp_path) -> None:
    out = tmp_path / "out.json"
    result = invoke("--workload", "burst", "-c", "1", "-o", out)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["schema"] == "looptrace.run/1"


# --- --weights must agree with --model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ouro_checkpoint(tmp_path_factory) -> Path:
    from looptrace.engine.checkpoint import save_checkpoint
    from looptrace.engine.model_config import PRESETS
    from looptrace.engine.weights import create_model, init_random

    model = create_model(PRESETS["ouro-tiny"], torch.device("cpu"), torch.float32)
    init_random(model, 0)
    path = tmp_path_factory.mktemp("ouro_ckpt")
    save_checkpoint(model, path)
    return path


@pytest.mark.parametrize("model", ["huginn", "olmo", "huginn-tiny"])
def test_model_family_contradicting_checkpoint_is_bad_input(ouro_checkpoint, model, tmp_path) -> None:
    out = tmp_path / "out.json"
    line = assert_one_line_error(invoke("--model", model, "--weights", ouro_checkpoint, "-o", out), 2)
    assert f"--model {model}" in line and "ouro checkpoint" in line and str(ouro_checkpoint) in line
    assert not out.exists()


@pytest.mark.parametrize("model", [None, "ouro", "ouro-1.4b"])
def test_checkpoint_family_is_used_and_named(ouro_checkpoint, model) -> None:
    args = ["--weights", ouro_checkpoint, "--format", "json", "-c", "1"]
    result = invoke(*args, *(["--model", model] if model else []))
    assert result.exit_code == 0, result.output
    h = json.loads(result.stdout)["header"]
    assert h["family"] == "ouro" and h["weights"] == str(ouro_checkpoint)
    assert "ouro checkpoint" in h["preset_note"] and "resolved to" not in h["preset_note"]
    # on CPU, --model ouro alone loads the packaged trained checkpoint, not random weights
    assert "without --weights, --model ouro loads the packaged trained ouro-tiny on CPU" in h["preset_note"]
    assert "random weights: --model ouro without --weights" not in h["preset_note"]


@pytest.mark.parametrize("model, random_weights", [("olmo", True), ("ouro", False)])  # olmo: no checkpoint
def test_random_weights_run_names_the_next_step(model: str, random_weights: bool) -> None:
    result = invoke("--model", model, "-c", "1")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert (
        "next: these were seeded random weights: pass a trained checkpoint with --weights DIR" in said
    ) == (random_weights)


# --- Ctrl-C: report what was produced, exit 130 ------------------------------------------------------------
def interrupt_engine_after(monkeypatch, steps: int) -> None:
    from looptrace.engine.llm_engine import LLMEngine

    real_step = LLMEngine.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] > steps:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)


def test_ctrl_c_reports_tokens_produced_and_exits_130(monkeypatch, tmp_path) -> None:
    interrupt_engine_after(monkeypatch, 6)  # prefill + a few decode tokens, both requests mid-generation
    out = tmp_path / "run.json"
    result = invoke("--max-tokens", "32", "-o", out)
    assert result.exit_code == 130, result.output
    data = json.loads(out.read_text())  # the report of the partial run is written
    assert "TPOT" in result.stdout and result.stdout.rstrip().endswith(" lines)")  # its table on stdout
    m = data["metrics"]
    assert m["interrupted"] and m["tokens_sampled"] > 0
    assert (m["completed"], m["failed"], m["interrupted_requests"]) == (0, 0, 2)
    assert m["finish_reasons"] == {"interrupted": 2}
    assert data["engine"]["output_tokens"] == m["tokens_sampled"]
    assert "interrupted" in result.stderr and "Traceback" not in result.output


def test_ctrl_c_table_says_interrupted(monkeypatch) -> None:
    interrupt_engine_after(monkeypatch, 6)
    result = invoke("--max-tokens", "32", "--format", "table")
    assert result.exit_code == 130, result.output
    assert "INTERRUPTED: 2 request(s) in flight were stopped" in result.stdout
    row = next(line for line in result.stdout.splitlines() if "all sampled" in line)
    assert row.split("│")[2].strip().startswith("0 / ") and not row.split("│")[2].strip().endswith(" 0")


def test_ctrl_c_before_serving_exits_130_without_traceback(monkeypatch, tmp_path) -> None:
    def ctrl_c(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr("looptrace.drive.run_request.build", ctrl_c)
    out = tmp_path / "run.json"
    result = invoke("-o", out)
    assert result.exit_code == 130 and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


# --- progress on stderr for every format --------------------------------------------------------------------
def test_progress_bar_on_a_terminal_for_json_output(monkeypatch) -> None:
    from rich.console import Console

    from looptrace.cli import common

    buf = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=buf, force_terminal=True, width=100))
    result = runner.invoke(app, ["run", *FAST[:-1], "--format", "json"])  # FAST minus --no-progress
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # the bar never mixes into stdout
    assert "serving" in buf.getvalue() and "requests" in buf.getvalue()


def test_jsonl_format_is_in_help() -> None:
    result = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "140"})
    assert result.exit_code == 0
    for text in ("JSONL PROMPTS", '"prompt_token_ids"', "max_tokens", "arrival", "130 interrupted"):
        assert text in result.stdout, text
