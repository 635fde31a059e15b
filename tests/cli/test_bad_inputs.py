"""The last tracebacks: every bad input across the commands is one `error:` line on stderr and
exit code 2 (Rich markup in user text, Typer usage errors, huge values, malformed files, conflicting
options); an output is never one of the command's inputs; light commands never import torch."""

from __future__ import annotations

import contextlib
import enum
import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
import types
import typing
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from looptrace.assets import shipped_weights
from looptrace.cli.main import app
from looptrace.cli.options import MAX_THREADS
from looptrace.cli.output import OutputError, check_output, check_outputs
from looptrace.engine import budget
from looptrace.input_files import recipe_dir

runner = CliRunner()
FAST = ["--max-tokens", "2", "-c", "1", "--prompt-len", "4", "--no-progress"]


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(result, code: int = 2) -> str:
    """The single `error:` line of a failed command (no traceback, nothing else on stderr)."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# 1. Rich markup in user-supplied text is quoted as plain text ------------------------------------------
@pytest.mark.parametrize(
    "args, quoted",
    [
        (["run", "-o", "/nonexist[/]/x.json"], "/nonexist[/]/x.json"),
        (["run", "--recipe", "my[/]recipe.yaml", *FAST], "my[/]recipe.yaml"),
        (["trace", "analyze", "trace[/bold].json"], "trace[/bold].json"),
        (["run", "--model", "[bold]x[/]"], "'[bold]x[/]'"),
        (["bench", "--from", "no[red]such.json"], "no[red]such.json"),
    ],
)
def test_markup_in_user_text_is_quoted_verbatim(args, quoted) -> None:
    assert quoted in one_error_line(invoke(*args))


def test_markup_in_a_valid_path_is_printed_verbatim(tmp_path, monkeypatch) -> None:
    """A checkpoint directory `a[/b]` (a closing tag to Rich) runs, and the report shows its path."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(shipped_weights("ouro-tiny"), Path("a[", "b]"))
    result = invoke("run", *FAST, "--weights", "a[/b]")
    assert result.exit_code == 0, result.output
    assert "weights: a[/b])" in result.stdout


def test_control_characters_stay_on_one_line() -> None:
    line = one_error_line(invoke("run", "-o", "/nonexist\n/x\u2028y.json"))
    assert "/nonexist\\n/x\\u2028y.json" in line


# 2. Typer/Click usage errors: one line, exit 2 ---------------------------------------------------------
@pytest.mark.parametrize(
    "args, needles",
    [
        (["run", "--bogus"], ["No such option: --bogus", "looptrace run --help"]),
        (["run", "--seed", "x"], ["'--seed'", "integer"]),
        (["run", "--workload", "foo"], ["'--workload'", "'foo'", "burst"]),
        (["train-tiny"], ["Missing option '--family'", "ouro, huginn"]),
        (["trace", "analyze"], ["Missing argument"]),
        (["frobnicate"], ["No such command 'frobnicate'"]),
        (["--frob"], ["No such option: --frob"]),
    ],
)
def test_usage_errors_are_one_line(args, needles) -> None:
    line = one_error_line(invoke(*args))
    for needle in needles:
        assert needle in line, line


def test_no_arguments_still_prints_help() -> None:
    result = invoke()
    assert result.exit_code == 2 and "Usage" in result.output and "error:" not in result.output


# 3. Huge values: schema bounds, then the memory budget ------------------------------------------------
@pytest.mark.parametrize(
    "setting, bound",
    [
        ("scheduler.max_num_seqs=99999999999999999999", "2147483647"),
        ("scheduler.max_num_seqs=1000000000000", "2147483647"),
        ("kv.num_blocks=1000000000000", "2147483647"),
        ("exit.max_loops=100000", "1024"),
    ],
)
def test_huge_settings_name_the_key_and_bound(setting, bound) -> None:
    line = one_error_line(invoke("run", *FAST, "--set", setting))
    assert setting.split("=")[0] in line and bound in line


@pytest.fixture
def one_gib(monkeypatch):
    """A machine with 1 GiB free: the budget check must refuse what would not fit."""
    monkeypatch.setattr(budget, "host_available", lambda: 1 << 30)


@pytest.mark.parametrize(
    "args, setting",
    [
        (["--set", "kv.num_blocks=1000000000"], "kv.num_blocks"),
        (["--set", "scheduler.max_num_seqs=1000000000"], "scheduler.max_num_seqs"),
        (["--set", "kv.cpu_pool_tokens=2000000000"], "kv.cpu_pool_tokens"),
        (["-c", "99999999999999999999"], "--concurrency / --prompt-len"),
    ],
)
def test_budget_names_the_setting_to_lower(one_gib, args, setting) -> None:
    line = one_error_line(invoke("run", *FAST, *args))
    assert "1.0 GiB available" in line and line.endswith(f"lower {setting}"), line


@pytest.mark.parametrize(
    "arms", [["base", "--b-set", "scheduler.max_num_seqs=2"], ["http://127.0.0.1:9", "http://127.0.0.1:9"]]
)
def test_diff_huge_num_requests_is_refused_before_drawing_prompts(one_gib, arms) -> None:
    """Found by the property test: the random prompts were drawn first (numpy's 'Maximum allowed
    dimension exceeded', exit 1)."""
    line = one_error_line(invoke("diff", *arms, "--num-requests", "99999999999999999999", "--no-progress"))
    assert "1.0 GiB available" in line and line.endswith("lower --num-requests / --prompt-len"), line


def test_bench_huge_concurrency(one_gib) -> None:
    line = one_error_line(invoke("bench", "--cell", "ouro-tiny:16/4@99999999999999999999"))
    assert "--cell ouro-tiny:16/4@99999999999999999999" in line and "2147483647" in line
    line = one_error_line(invoke("bench", "--cell", "ouro-tiny:16/4@100000000"))
    assert "--cell ouro-tiny:16/4@100000000" in line and line.endswith("lower C")


def test_check_memory_separates_host_and_device(monkeypatch) -> None:
    monkeypatch.setattr(budget, "host_available", lambda: 1000)
    monkeypatch.setattr(budget, "device_available", lambda device: 10**9)
    on_gpu = [budget.Need("KV pool", 10**8, "kv.num_blocks"), budget.Need("lists", 10, "x", host=True)]
    budget.check_memory(on_gpu, "cuda:0")  # fits on both
    with pytest.raises(budget.BudgetError, match=r"^--s-ref: needs about .* lower --s-ref$"):
        budget.check_memory([budget.Need("scores", 5000, "--s-ref")], "cpu", context="--s-ref")
    monkeypatch.setattr(budget, "host_available", lambda: None)  # unknown: no refusal
    budget.check_memory([budget.Need("scores", 5000, "--s-ref")], "cpu")


def test_jsonl_arrival_1e308(tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1], "arrival": 1e308}\n')
    assert f"{prompts}:1: arrival" in one_error_line(invoke("run", *FAST, "--prompts", prompts))


# 4. bench --from a non-report; conflicting options ----------------------------------------------------
def test_bench_from_a_json_that_is_not_a_report(tmp_path) -> None:
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"schema": "looptrace.bench/1", "header": {}, "cells": [{}]}))
    line = one_error_line(invoke("bench", "--from", report))
    assert f"--from {report}" in line and "'arms'" in line


@pytest.mark.parametrize(
    "args, needles",
    [
        (["run", "--rate", "4"], ["--rate", "poisson"]),
        (["run", "--num-requests", "4", "--workload", "sessions"], ["--num-requests", "poisson"]),
        (["run", "--prompts", "x.jsonl", "--workload", "burst"], ["--prompts", "jsonl"]),
        (["profile", "--recipe", "base", "--compare", "base", "exactloop"], ["--recipe", "--compare"]),
        (["bench", "--from", "x.json", "--cell", "ouro-tiny:16/4@1"], ["--from", "--cell"]),
    ],
)
def test_conflicting_options(args, needles) -> None:
    line = one_error_line(invoke(*args))
    for needle in needles:
        assert needle in line, line


# 5. A checkpoint whose tokenizer.json is not JSON -----------------------------------------------------
@pytest.fixture
def bad_tokenizer_checkpoint(tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(shipped_weights("ouro-tiny"), root)
    (root / "tokenizer.json").write_text("{not json")
    return root


def test_run_with_a_broken_tokenizer(bad_tokenizer_checkpoint) -> None:
    line = one_error_line(invoke("run", *FAST, "--weights", bad_tokenizer_checkpoint))
    assert "tokenizer.json: not a readable tokenizer.json" in line


def test_serve_with_a_broken_tokenizer(bad_tokenizer_checkpoint) -> None:
    pytest.importorskip("fastapi")
    line = one_error_line(invoke("serve", "--port", "0", "--weights", bad_tokenizer_checkpoint))
    assert "tokenizer.json: not a readable tokenizer.json" in line


# 6. train-tiny: checked before training; never the shipped checkpoint by default ----------------------
@pytest.fixture
def no_training(monkeypatch, tmp_path):
    """Training replaced by writing the marker file into the directory given; the packaged checkpoints
    replaced by a copy (`--replace-shipped` must not touch the real ones)."""
    calls: list[Path] = []

    def fake(family, target, steps, seed, threads):
        calls.append(target)
        (target / "train_meta.json").write_text("{}")
        return {"wall_time_s": 0.0, "dense_exact_by_depth": {}}

    monkeypatch.setattr("looptrace.cli.train_cmd._train", fake)
    assets = tmp_path / "assets"
    shutil.copytree(shipped_weights("ouro-tiny"), assets / "ouro-tiny")
    monkeypatch.setattr("looptrace.assets.ASSETS_DIR", assets)
    return calls


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--out", "/proc/x"], "--out /proc/x: cannot write there"),
        (["--seed", "-1"], "--seed -1"),
        (["--seed", str(2**64 - 1)], "2**64-2"),
        (["--out", "SHIPPED"], "--replace-shipped"),
        (["--replace-shipped", "--out", "x"], "leave out --out"),
    ],
)
def test_train_tiny_bad_input_before_training(no_training, tmp_path, args, needle) -> None:
    args = [str(tmp_path / "assets" / "ouro-tiny") if a == "SHIPPED" else a for a in args]
    assert needle in one_error_line(invoke("train-tiny", "--family", "ouro", *args))
    assert no_training == []


def test_train_tiny_refuses_a_directory_of_other_files(no_training, tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert "holds other files" in one_error_line(invoke("train-tiny", "--family", "ouro", "--out", tmp_path))


def test_train_tiny_default_is_a_new_directory(no_training, tmp_path, monkeypatch) -> None:
    """Each run fills a staging directory beside its target, swapped in whole when the training is done."""
    monkeypatch.chdir(tmp_path)
    shipped = tmp_path / "assets" / "ouro-tiny"
    assert invoke("train-tiny", "--family", "huginn").exit_code == 0
    assert invoke("train-tiny", "--family", "ouro", "--replace-shipped").exit_code == 0
    staged = [(p.parent.resolve(), p.name.rsplit("-", 1)[0]) for p in no_training]
    assert staged == [
        (tmp_path, ".looptrace-looptrace-tiny-huginn"),
        (shipped.parent, ".looptrace-ouro-tiny"),
    ]
    assert [p.name for p in (tmp_path / "looptrace-tiny-huginn").iterdir()] == ["train_meta.json"]
    assert [p.name for p in shipped.iterdir()] == ["train_meta.json"]  # the old checkpoint replaced whole
    assert not [p for p in (tmp_path, shipped.parent) for q in p.iterdir() if q.name.startswith(".looptrace")]


def test_train_tiny_without_its_marker_replaces_nothing(no_training, tmp_path, monkeypatch) -> None:
    """A writer that stops short (no train_meta.json) leaves the old directory as it was."""
    monkeypatch.setattr("looptrace.cli.train_cmd._train", lambda *args: {})
    shipped = tmp_path / "assets" / "ouro-tiny"
    before = sorted(p.name for p in shipped.iterdir())
    line = one_error_line(invoke("train-tiny", "--family", "ouro", "--replace-shipped"))
    assert "wrote no train_meta.json" in line
    assert sorted(p.name for p in shipped.iterdir()) == before


# 7. An output is never one of the inputs ---------------------------------------------------------------
def test_check_output_refuses_an_input_through_any_path(tmp_path) -> None:
    data = tmp_path / "t.json"
    data.write_text("{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.json").symlink_to(data)
    os.link(data, tmp_path / "hard.json")
    for alias in ("t.json", "link.json", "hard.json", "sub/../t.json"):
        with pytest.raises(OutputError, match="is the trace file"):
            check_output(tmp_path / alias, inputs=[(data, "trace")])
    assert check_output(tmp_path / "other.json", inputs=[data, None]) is not None
    with pytest.raises(OutputError, match="--plot .* is the --from file"):
        check_outputs((None, "--output"), (data, "--plot"), inputs=[(data, "--from")])


def test_check_output_refuses_a_path_under_a_file(tmp_path) -> None:
    """realpath would read `file/../x` as a sibling of `file`; open() refuses it (ENOTDIR), so do we."""
    (tmp_path / "file").write_text("keep")
    for bad in ("file/x", "file/../x"):
        with pytest.raises(OutputError, match="is not a directory"):
            check_output(Path(f"{tmp_path}/{bad}"))
    assert not (tmp_path / "x").exists()


def test_trace_analyze_never_replaces_its_trace(tmp_path) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "k", "ts": 0, "dur": 1}]}))
    before = trace.read_bytes()
    link = tmp_path / "link.json"
    link.symlink_to(trace)
    for out in (trace, link):
        assert "is the trace file" in one_error_line(invoke("trace", "analyze", trace, "-o", out))
    assert trace.read_bytes() == before


def test_bench_from_and_run_inputs_are_never_replaced(tmp_path) -> None:
    report = tmp_path / "r.json"
    report.write_text("{}")
    assert "is the --from file" in one_error_line(invoke("bench", "--from", report, "-o", report))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1]}\n')
    assert "is the --prompts file" in one_error_line(invoke("run", "--prompts", prompts, "-o", prompts))
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("name: mine\n")
    assert "is the --recipe file" in one_error_line(invoke("run", "--recipe", recipe, "-o", recipe))
    assert report.read_text() == "{}" and recipe.read_text() == "name: mine\n"


# 8. run: --prompts implies jsonl; out-of-vocabulary ids; the workload header is a dict ----------------
def test_prompts_imply_jsonl_and_header_workload_is_data(tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}\n')
    result = invoke("run", "--no-progress", "--prompts", prompts, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["metrics"]["completed"] == 1
    workload = data["header"]["workload"]
    assert workload["kind"] == "jsonl" and workload["path"] == str(prompts)


def test_out_of_vocabulary_prompt_names_file_and_line(tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1]}\n{"prompt_token_ids": [1, 99999]}\n')
    line = one_error_line(invoke("run", *FAST, "--prompts", prompts))
    assert f"{prompts}:2: token id 99999" in line


# 9. Commands that need no engine never import torch ----------------------------------------------------
NO_TORCH = """
import sys
from typer.testing import CliRunner
import looptrace.cli.main as m
assert "torch" not in sys.modules, "import looptrace.cli.main imported torch"
runner = CliRunner()
for args in (["--help"], ["top", "--help"], ["trace", "analyze", "/nonexistent"], ["run", "--bogus"],
             ["top", "--once", "http://127.0.0.1:9"], ["bench", "--from", "/nonexistent.json"]):
    result = runner.invoke(m.app, args)
    assert result.exit_code in (0, 2), (args, result.output)
    assert "torch" not in sys.modules, f"looptrace {' '.join(args)} imported torch"
print("ok")
"""


def test_light_commands_do_not_import_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# 10. Property: random strings into every command's options are one-line errors -------------------------
# String options whose every value outside a few valid words is refused before any work.
VALIDATED_STR = {"--model", "--recipe", "--set", "--a-set", "--b-set", "--device", "--dtype", "--level"}
VALIDATED_STR |= {"--cell", "--cells", "--a", "--b", "--prefill-batch"}
VALID_WORDS = {"", "base", "exactloop", "auto", "cpu", "ouro", "huginn", "olmo", "whole", "recipe"}
VALID_WORDS |= {"op", "step", "loop", "layer", "bf16", "fp16", "fp32", "float32", "bfloat16", "float16"}


def _commands(group, prefix=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield " ".join((*prefix, name)), cmd


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _hints(cmd) -> dict[str, typing.Any]:
    return typing.get_type_hints(getattr(cmd.callback, "__wrapped__", cmd.callback), include_extras=True)


def _base_type(annotation):
    """int, float, an Enum, Path or str behind Annotated / Optional / list[...]; None for the rest."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return _base_type(args[0])
    if typing.get_origin(annotation) is list and len(args) == 1:
        return _base_type(args[0])
    return annotation if isinstance(annotation, type) else None


def _kind(annotation, option: str | None) -> str | None:
    base = _base_type(annotation)
    if base is None or base is bool:
        return None
    if issubclass(base, enum.Enum):
        return "choice"
    if issubclass(base, (int, float)):
        return "number"
    if issubclass(base, Path):
        return "path"
    return "string" if base is str and option in VALIDATED_STR else None


def _fuzz_targets() -> list[tuple[str, str, str]]:
    """(command, option or argument, kind) for every parameter with values certainly refused; the kinds
    come from the command functions' annotations."""
    out = []
    for path, cmd in COMMANDS.items():
        hints = _hints(cmd)
        for p in cmd.params:
            if p.nargs != 1 or p.name not in hints:
                continue
            long = next((o for o in p.opts if o.startswith("--")), None)
            kind = _kind(hints[p.name], long)
            if kind is not None:
                out.append((path, long or p.name, kind))
    return out


TARGETS = _fuzz_targets()
PIECES = ["[/]", "[bold]", "[/bold]", "[red]x[/]", ":smile:", "\u2028", "\x1b[31m", "ü∂ß", "名前", "\t", ""]
PIECES += ["-1", "99999999999999999999", "1e308", "nan", "=", ",", "@", "/", ".."]
TEXT = st.lists(
    st.one_of(
        st.sampled_from(PIECES),
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8),
    ),
    max_size=3,
).map("".join)


def _certainly_invalid(kind: str, value: str, annotation) -> bool:
    if kind == "number":
        for parse in (int, float):
            try:
                parse(value)
                return False
            except (ValueError, OverflowError):
                pass
        return True
    if kind == "choice":
        return value.strip().lower() not in {str(c.value).lower() for c in _base_type(annotation)}
    return kind == "path" or value.strip().lower() not in VALID_WORDS


@pytest.fixture(scope="module")
def not_a_dir(tmp_path_factory) -> Path:
    """A regular file: paths under it can be neither read nor created."""
    path = tmp_path_factory.mktemp("fuzz") / "a-file"
    path.write_text("not a directory")
    return path


def test_targets_cover_every_command() -> None:
    covered = {path for path, _, _ in TARGETS}
    expected = {"run", "profile", "bench", "diff", "depth", "train-tiny", "serve", "top", "trace analyze"}
    assert expected <= covered, expected - covered


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_strings_are_one_line_errors(not_a_dir, data) -> None:
    path, target, kind = data.draw(st.sampled_from(TARGETS))
    value = data.draw(TEXT)
    cmd = COMMANDS[path]
    param = next(p for p in cmd.params if target in p.opts or p.name == target)
    if kind == "path":  # `x` first: pathlib drops a trailing `/` or `/.`, which would leave the file itself
        value = f"{not_a_dir}/x{value}"
    if not _certainly_invalid(kind, value, _hints(cmd)[param.name]):
        return
    base = {  # arguments that keep each command from starting long work whatever the fuzzed option is
        "top": ["--once", "http://127.0.0.1:9"],
        "serve": ["--port", "0"],
        "train-tiny": ["--family", "ouro", "--out", f"{not_a_dir}/out"],
    }.get(path, [])
    fuzzed = [f"{target}={value}"] if target.startswith("--") else ["--", value]
    args = [*path.split(), *base, *fuzzed]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (args, result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output, args
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)


# 11. Implicit inputs: the recipes and the packaged checkpoints/eval sets are never an output ------------
RECIPES = Path(recipe_dir())
ASSETS = Path(shipped_weights("ouro-tiny")).parent


@pytest.mark.parametrize(
    "args, target",
    [
        (["profile", "--prompt-len", "4"], RECIPES / "base.yaml"),
        (["bench", "--cell", "ouro-tiny:4/2@1", "--runs", "2"], RECIPES / "base.yaml"),
        (["depth", "--limit", "1", "--no-progress"], RECIPES / "base.yaml"),
        (["diff", "base", "exactloop", *FAST], RECIPES / "exactloop.yaml"),
        (["run", *FAST, "-f", "json"], ASSETS / "ouro-tiny" / "model.safetensors"),
        (["bench", "--cell", "ouro-tiny:4/2@1", "--runs", "2"], ASSETS / "ouro-tiny" / "config.json"),
        (["depth", "--limit", "1", "--no-progress", "-f", "json"], ASSETS / "huginn-tiny" / "eval.jsonl"),
        (["run", *FAST], RECIPES / "new.yaml"),  # not read, but read by name the moment it exists
    ],
)
def test_package_data_is_never_an_output(args, target) -> None:
    before = target.read_bytes() if target.exists() else None
    line = one_error_line(invoke(*args, "-o", target))
    assert f"--output {target}: is inside looptrace's own data" in line, line
    assert (target.read_bytes() if target.exists() else None) == before


def test_a_recipe_named_is_an_input(tmp_path, monkeypatch) -> None:
    """`--recipe mine` reads recipes/mine.yaml: registered as the --recipe input, whatever its directory."""
    from looptrace.cli.output import command_inputs, recipe_input

    assert recipe_input("base", "--a") == (RECIPES / "base.yaml", "--a")
    mine = tmp_path / "mine.yaml"
    assert (mine, "--recipe") in command_inputs(None, str(mine), None)


# 12. Numbers: --threads bounded (100000 crashed torch: SIGSEGV), floats finite, lists without holes -----
@pytest.mark.parametrize("command", ["profile", "run", "serve", "depth", "train-tiny", "bench"])
@pytest.mark.parametrize("threads", ["100000", "0", "-1"])
def test_threads_are_bounded(no_training, command, threads) -> None:
    family = ["--family", "ouro"] if command == "train-tiny" else []
    line = one_error_line(invoke(command, *family, "--threads", threads))
    assert f"'--threads': {threads} is not from 1 to {MAX_THREADS} (4 x the CPU count)" in line, line
    assert no_training == []
    assert 4 * (os.cpu_count() or 1) == MAX_THREADS


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "--temperature", "nan"], "'--temperature': 'nan' is not a finite number"),
        (["run", "--temperature", "inf"], "'--temperature': 'inf' is not a finite number"),
        (["run", "--rate", "inf", "--workload", "poisson"], "'--rate': 'inf' is not a finite number"),
        (["run", "--top-p", "-inf"], "'--top-p': '-inf' is not a finite number"),
        (["depth", "--tau", "nan"], "'--tau': 'nan' is not a finite number"),
        (["profile", "--model", ""], "'--model' / '-m': expected a name, got ''"),
        (["serve", "--host", "[/]\u2028"], "'--host': '[/]\\u2028' is neither an IP address nor a host name"),
        (["run", "-o", "out.json/"], "'out.json/' is a directory path; expected a file path"),
        (["profile", "--trace", "t.json/."], "'t.json/.' is a directory path"),
        (["depth", "--accuracy-by-depth", "1,,2"], "--accuracy-by-depth '1,,2': expected comma-separated"),
        (["depth", "--random-weights", "--weights", "."], "--random-weights and --weights: give one"),
        (["run", "--workload", "sessions", "--turns", "100000"], "the last of 100000 turns needs"),
        (["run", "--workload", "sessions", "--turns", "6", "--turn-prompt-len", "1000"], "max context is"),
    ],
)
def test_accepted_before_now_refused(tmp_path, monkeypatch, args, needle) -> None:
    monkeypatch.chdir(tmp_path)
    quiet = ["--no-progress"] if args[0] in ("run", "depth") else []
    assert needle in one_error_line(invoke(*args, *quiet))
    assert list(tmp_path.iterdir()) == []  # nothing written (out.json/ used to write out.json)


# 13. Input files past the parsers' limits: one error line, never a traceback ---------------------------
DEEP = "[" * 100_000 + "]" * 100_000
DIGITS = "9" * 5000


def _trace(ts: str = "0") -> str:
    event = {"ph": "X", "cat": "kernel", "name": "k", "ts": "TS", "dur": 1}
    return json.dumps({"traceEvents": [event]}).replace('"TS"', ts)


BAD_FILES = {  # (input kind, what is wrong): file text
    ("trace", "deep"): '{"traceEvents": ' + DEEP + "}",
    ("trace", "digits"): _trace(DIGITS),
    ("trace", "nan ts"): _trace("NaN"),
    ("jsonl", "deep"): '{"prompt_token_ids": [1], "x": ' + DEEP + "}\n",
    ("jsonl", "digits"): '{"prompt_token_ids": [1], "max_tokens": ' + DIGITS + "}\n",
    ("eval", "deep"): '{"prompt": "1+1=", "answer": "2", "x": ' + DEEP + "}\n",
    ("eval", "surrogate"): '{"prompt": "1+1=", "answer": "\\ud800"}\n',
    ("report", "deep"): DEEP,
    ("replay", "deep"): DEEP + "\n",
    ("replay", "digits"): '{"schema": ' + DIGITS + "}\n",
    ("recipe", "deep"): "kv: " + "[" * 5000 + "]" * 5000 + "\n",
    ("recipe", "digits"): "scheduler:\n  max_num_seqs: " + DIGITS + "\n",
    ("recipe", "duplicate key"): "scheduler:\n  max_num_seqs: 2\n  max_num_seqs: 4\n",
    ("recipe", "binary"): "\udcff\udcfe\x00",  # written with surrogateescape: bytes ff fe 00
}
USES = {  # input kind: command lines reading FILE
    "trace": [["trace", "analyze", "FILE"], ["trace", "compare", "FILE", "FILE"]],
    "jsonl": [
        ["run", *FAST, "--prompts", "FILE"],
        ["diff", "base", "--b-set", "exit.threshold=0.5", *FAST, "--prompts", "FILE"],
    ],
    "eval": [
        ["depth", "--no-progress", "--accuracy-by-depth", "1", "--prompts", "FILE"],
        ["diff", "base", "--b-set", "exit.threshold=0.5", *FAST, "--accuracy", "FILE"],
    ],
    "report": [["bench", "--from", "FILE"], ["trace", "compare", "FILE", "FILE"], ["top", "--diff", "FILE"]],
    "replay": [["top", "--once", "--replay", "FILE"]],
    "recipe": [["run", *FAST, "--recipe", "FILE"], ["bench", "--a", "FILE", "--cell", "ouro-tiny:4/2@1"]],
}
CASES = [(kind, what, use) for (kind, what) in BAD_FILES for use in USES[kind]]


@pytest.mark.parametrize("kind, what, use", CASES, ids=[f"{k}-{w}-{u[0]}" for k, w, u in CASES])
def test_bad_input_files_are_one_error_line(tmp_path, kind, what, use) -> None:
    if use[0] == "top":
        pytest.importorskip("httpx")
    path = tmp_path / ("in.yaml" if kind == "recipe" else "in.json")
    path.write_text(BAD_FILES[kind, what], encoding="utf-8", errors="surrogateescape")
    line = one_error_line(invoke(*[str(path) if a == "FILE" else a for a in use]))
    assert str(path) in line, line


@pytest.mark.parametrize("command", [["trace", "analyze"], ["trace", "compare", "OTHER"]])
def test_corrupt_gzip_trace_is_one_line(tmp_path, command) -> None:
    """A truncated gzip (EOFError) and a corrupt deflate stream (zlib.error, which was a boxed traceback)."""
    other = tmp_path / "ok.json"
    other.write_text(_trace())
    path = tmp_path / "t.json.gz"
    for data in (gzip.compress(_trace().encode())[:-8], gzip.compress(b"{}" * 100)[:10] + b"\xff" * 40):
        path.write_bytes(data)
        args = [str(other) if a == "OTHER" else a for a in command]
        line = one_error_line(invoke(*args, path))
        assert f"{path}: cannot read" in line, line


def test_deep_capture_details_is_one_line(tmp_path) -> None:
    (tmp_path / "capture_traces").mkdir()
    (tmp_path / "capture_traces" / "execution_details.json").write_text(DEEP)
    (tmp_path / "t.json").write_text(_trace())
    line = one_error_line(invoke("trace", "analyze", tmp_path / "t.json"))
    assert "execution_details.json: invalid JSON (nested too deeply)" in line, line


def test_huge_set_value_is_one_line() -> None:
    assert "--set" in one_error_line(invoke("run", *FAST, "--set", f"scheduler.max_num_seqs={DIGITS}"))
    assert "--set" in one_error_line(invoke("run", *FAST, "--set", "kv=" + "[" * 5000 + "]" * 5000))


@pytest.fixture
def fifo(tmp_path):
    """A fifo; should a command read it anyway, a writer opens it after 30 s: the test fails, not hangs."""
    path = tmp_path / "pipe.yaml"
    os.mkfifo(path)
    release = threading.Timer(30, lambda: os.close(os.open(path, os.O_WRONLY)))
    release.daemon = True
    release.start()
    yield path
    release.cancel()


@pytest.mark.parametrize(
    "args",
    [
        ["run", *FAST, "--prompts", "PIPE"],
        ["run", *FAST, "--recipe", "PIPE"],
        ["trace", "analyze", "PIPE"],
        ["trace", "compare", "PIPE", "PIPE"],
        ["depth", "--no-progress", "--prompts", "PIPE"],
        ["bench", "--from", "PIPE"],
        ["trace", "analyze", "/dev/zero"],
    ],
)
def test_non_regular_inputs_are_refused_before_reading(fifo, args) -> None:
    line = one_error_line(invoke(*[str(fifo) if a == "PIPE" else a for a in args]))
    assert "is a fifo, not a regular file" in line or "/dev/zero: is a character device" in line, line


def test_markup_in_labels_and_output_paths(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("t.json").write_text(_trace())
    result = invoke("trace", "compare", "t.json", "t.json", "--labels", "A,[/]")
    assert result.exit_code == 0, result.output
    assert "[/] calls" in result.stdout
    result = invoke("trace", "analyze", "t.json", "-o", "[b]x.json")
    assert result.exit_code == 0 and result.stderr.strip() == "wrote [b]x.json", result.stderr
    assert "--step-marker" in one_error_line(invoke("trace", "analyze", "t.json", "--step-marker", ""))


def test_top_with_an_invalid_url() -> None:
    """Found by the property test: httpx.InvalidURL is not an httpx.HTTPError (a traceback, exit 1)."""
    pytest.importorskip("httpx")
    assert "http://[bold]/v1/stats: cannot connect (InvalidURL" in one_error_line(
        invoke("top", "--once", "[bold]")
    )


def test_bom_and_crlf_prompts_are_accepted(tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(
        b'\xef\xbb\xbf{"prompt_token_ids": [1, 2], "max_tokens": 2}\r\n{"prompt_token_ids": [3]}\r\n'
    )
    result = invoke("run", *FAST, "--prompts", prompts, "-f", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["metrics"]["completed"] == 2


# 14. A full disk: one error line, the old file (or none) and no temp file left ---------------------------
@pytest.fixture
def full_dir(tmp_path):
    """A real full filesystem: a 64 KiB tmpfs filled up (mounting needs root; elsewhere the test skips and
    tests/cli/test_output_files.py's injected ENOSPC covers the same code)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs (not root)")
    try:
        fd = os.open(mnt / "fill", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
        os.close(fd)
        yield mnt
    finally:  # lazily: a profiler thread may still hold a file there for a moment
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "fill")


@pytest.mark.parametrize(
    "args, option",
    [
        (["profile", "--prompt-len", "4", "--decode-steps", "2", "--trace", "FULL/t.json"], "--trace"),
        (["profile", "--prompt-len", "4", "--decode-steps", "2", "--trace", "FULL/t.json.gz"], "--trace"),
        (["run", *FAST, "-o", "FULL/r.json"], "--output"),
        (
            ["depth", "--no-progress", "--limit", "1", "--accuracy-by-depth", "1", "-o", "FULL/d.json"],
            "--output",
        ),
        (["trace", "analyze", "TRACE", "-o", "FULL/a.json"], "--output"),
    ],
)
def test_full_disk_is_one_line_and_leaves_nothing(full_dir, tmp_path, args, option) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(_trace())
    args = [a.replace("FULL", str(full_dir)).replace("TRACE", str(trace)) for a in args]
    line = one_error_line(invoke(*args))
    assert option in line and "No space left on device" in line, line
    assert _left(full_dir) == []


def test_full_disk_bench_plot(full_dir, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    report = tmp_path / "bench.json"
    made = invoke("bench", "--cell", "ouro-tiny:4/2@1", "--runs", "2", "--no-progress", "-o", report)
    assert made.exit_code == 0, made.output
    line = one_error_line(invoke("bench", "--from", report, "--plot", f"{full_dir}/p.svg"))
    assert "--plot" in line and "No space left on device" in line
    assert _left(full_dir) == []


def test_full_disk_train_tiny_leaves_no_directory(full_dir, monkeypatch) -> None:
    def fill(family, target, steps, seed, threads):  # the real writers, on the full disk
        (target / "model.safetensors").write_bytes(b"\0" * (1 << 20))

    monkeypatch.setattr("looptrace.cli.train_cmd._train", fill)
    line = one_error_line(invoke("train-tiny", "--family", "ouro", "--out", full_dir / "ckpt"))
    assert "--out" in line and "No space left on device" in line
    assert _left(full_dir) == []


# 15. Ctrl-C in profile's final write: the files written are named, not denied --------------------------
def test_profile_ctrl_c_after_writing(tmp_path, monkeypatch) -> None:
    """A Ctrl-C while the report is printed, after the file is written: the line names both files."""

    class InterruptedConsole:
        def __init__(self, *_args, **_kwargs) -> None:
            pass

        def print(self, *_args, **_kwargs) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr("looptrace.cli.profile_cmd.Console", InterruptedConsole)
    out, trace = tmp_path / "p.json", tmp_path / "t.json"
    result = invoke("profile", "--prompt-len", "4", "--decode-steps", "2", "-o", out, "--trace", trace)
    assert result.exit_code == 130, result.output
    assert result.stderr.strip() == f"interrupted after writing --trace {trace} and --output {out} (whole)"
    assert json.loads(out.read_text())["schema"] and json.loads(trace.read_text())["traceEvents"]
