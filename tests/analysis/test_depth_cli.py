"""`looptrace depth` as a command: -o suffix rule, loop-count options named in their errors,
the memory budget before allocating, and a Ctrl-C during --validate writing what was measured (exit 130)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looptrace.cli.main import app
from looptrace.train.task import AdditionTask, write_jsonl

runner = CliRunner()
FAST = ["--limit", "3", "--no-progress"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("depth") / "eval.jsonl"
    write_jsonl(AdditionTask(2).eval_items(3), path)
    return path


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("suffix", [".json", ".csv", ".txt"])
def test_output_suffix_picks_the_format(prompts: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"x{suffix}"
    r = runner.invoke(app, ["depth", "--prompts", str(prompts), *FAST, "-o", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    if suffix == ".json":
        assert json.loads(text)["s_ref"] == 8
    elif suffix == ".csv":
        assert text.splitlines()[0] == "S,P,prompt,final_prefill,decode"
    else:
        assert text.startswith("huginn-tiny (huginn)")
    by_depth = tmp_path / f"acc{suffix}"
    r = runner.invoke(
        app, ["depth", "--prompts", str(prompts), *FAST, "--accuracy-by-depth", "1,2", "-o", str(by_depth)]
    )
    assert r.exit_code == 0, r.output
    if suffix == ".json":
        assert [x["loops"] for x in json.loads(by_depth.read_text())["accuracy_by_depth"]] == [1, 2]
    elif suffix == ".csv":
        assert by_depth.read_text().splitlines()[0] == "loops,exact_match,stderr,n"


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--s-ref", "0"], ["--s-ref 0: expected a loop count from 1 to 1024"]),
        (["--s-ref", "100000"], ["--s-ref 100000: expected a loop count from 1 to 1024"]),
        (["--s", "0"], ["--s 0:"]),
        (["--p", "-1"], ["--p -1:"]),
        (["--accuracy-by-depth", "100000"], ["--accuracy-by-depth '100000'", "from 1 to 1024"]),
    ],
)
def test_loop_counts_are_named_in_the_error(prompts: Path, args, needles) -> None:
    one_line_error(runner.invoke(app, ["depth", "--prompts", str(prompts), *FAST, *args]), *needles)


@pytest.mark.parametrize(
    "args, option",
    [(["--s-ref", "1024"], "--s-ref"), (["--accuracy-by-depth", "2,1024"], "--accuracy-by-depth")],
)
def test_memory_budget_before_allocating(prompts: Path, monkeypatch, args, option: str) -> None:
    from looptrace.engine import budget

    monkeypatch.setattr(budget, "host_available", lambda: 8 << 30)  # 8 GiB: 1024 KV planes need ~32 GiB
    line = one_line_error(
        runner.invoke(app, ["depth", "--prompts", str(prompts), *FAST, *args]), f"{option} 1024:"
    )
    assert f"KV pool 32.0 GiB ({option})" in line and line.endswith(f"lower {option}")


def test_ctrl_c_during_validate_writes_what_was_measured(prompts: Path, tmp_path: Path, monkeypatch) -> None:
    """A Ctrl-C during --validate gave `TypeError: '<' not supported ... NoneType` (the partial
    record of the interrupted run went into the statistics)."""
    from looptrace.drive import benchmark

    real = benchmark.run_workload
    calls = []

    def interrupted_second_run(engine, workload, *a, **kw):
        rec = real(engine, workload, *a, **kw)
        calls.append(rec)
        return dataclasses.replace(rec, interrupted=True) if len(calls) == 2 else rec

    monkeypatch.setattr(benchmark, "run_workload", interrupted_second_run)
    out = tmp_path / "d.json"
    args = [
        "depth",
        "--prompts",
        str(prompts),
        *FAST,
        "--p",
        "2",
        "--validate",
        "--repeats",
        "1",
        *("--val-prompt-len", "16", "--val-requests", "2", "--val-answer-len", "2"),
        "-o",
        str(out),
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 130, r.output
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    assert r.stderr.strip().splitlines() == ["interrupted: wrote what was measured before the Ctrl-C"]
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and data["q90"]  # the analysis is complete
    v = data["validate"]
    assert v["interrupted"] is True and v["timed_runs_s"] == {
        "(8,8)": [v["timed_runs_s"]["(8,8)"][0]],
        "(8,2)": [],
    }
    assert "throughput_req_s" not in v and "controller" not in v
    from looptrace.analysis.depth_report import validate_lines

    assert "  interrupted: timed runs done (8,8) 1/1, (8,2) 0/1" in "\n".join(validate_lines(v))  # the table


def test_progress_on_a_terminal_names_each_phase(prompts: Path, monkeypatch) -> None:
    import io

    from rich.console import Console

    from looptrace.cli import depth_cmd

    buf = io.StringIO()
    monkeypatch.setattr(depth_cmd, "err_console", Console(file=buf, force_terminal=True, width=120))
    r = runner.invoke(app, ["depth", "--prompts", str(prompts), "--limit", "3", "-f", "json"])
    assert r.exit_code == 0, r.output
    shown = buf.getvalue()
    assert "generating at S_ref=8 (3 prompts)" in shown and "replaying at S_ref=8" in shown
    json.loads(r.stdout)  # stdout stays the report alone
