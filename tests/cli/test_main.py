"""The `looptrace` command itself: help that reads at 80 columns, and shell completion."""

from __future__ import annotations

import click
import pytest
from rich.cells import cell_len
from typer.main import get_command
from typer.testing import CliRunner

from looptrace.cli.main import app, fit_epilog

runner = CliRunner()
COMMANDS = [
    ["run"],
    ["profile"],
    ["diff"],
    ["depth"],
    ["bench"],
    ["serve"],
    ["top"],
    ["train-tiny"],
    ["trace", "analyze"],
    ["trace", "compare"],
]


def _command(path: list[str]) -> click.Command:
    command = get_command(app)
    for name in path:
        command = command.commands[name]
    return command


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_at_80_columns(path: list[str]) -> None:
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    assert "<bool>" not in result.output  # a flag takes no value
    for param in [p for p in _command(path).params if not getattr(p, "hidden", False)]:  # each name whole
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("--"):
                assert any(name in line for line in lines), name


def test_epilog_examples_fit_80_columns() -> None:
    epilog = """\
[bold]EXAMPLES[/]

  looptrace run --model ouro                                   # tiny Ouro on CPU, real shape on CUDA
  looptrace run --model ouro-1.4b --set scheduler.max_num_seqs=32 -c 32 --format json -o run.json

[bold]OUTPUT[/]  -o FILE: the format follows the suffix (.json, .csv, else table) unless --format is
given."""
    assert fit_epilog(epilog).split("\n") == [
        "[bold]EXAMPLES[/]",
        "",
        "  # tiny Ouro on CPU, real shape on CUDA",
        "  looptrace run --model ouro",
        "  looptrace run --model ouro-1.4b --set scheduler.max_num_seqs=32 -c 32 \\",
        "      --format json -o run.json",
        "",
        "[bold]OUTPUT[/]  -o FILE: the format follows the suffix (.json, .csv, else table) unless --format "
        "is given.",
    ]


def test_shell_completion() -> None:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "80"})
    assert "--install-completion" in result.output and "--show-completion" in result.output
    # what the installed bash completion asks: the candidates for `looptrace pro<TAB>`
    env = {"_LOOPTRACE_COMPLETE": "complete_bash", "COMP_WORDS": "looptrace pro", "COMP_CWORD": "1"}
    result = runner.invoke(app, [], env=env, prog_name="looptrace")
    assert result.exit_code == 0 and result.output.split() == ["profile"]
