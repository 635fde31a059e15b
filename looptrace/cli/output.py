"""The commands' output files: the rules and their checks live in looptrace.output_files (re-exported
here); this module adds the format inferred from -o and the print-then-write of a command's text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from looptrace.cli.options import OutputFormat
from looptrace.input_files import recipe_file
from looptrace.output_files import (  # noqa: F401  (the commands' API)
    OutputError,
    atomic_path,
    atomic_write_text,
    check_output,
    check_outputs,
    output_dir,
    same_file,
)


def infer_format(fmt: OutputFormat | None, output: Path | None) -> OutputFormat:
    """An explicit --format wins; else the -o suffix decides (.json, .csv), else a table."""
    if fmt is not None:
        return fmt
    suffix = output.suffix.lower() if output is not None else ""
    return {".json": OutputFormat.json, ".csv": OutputFormat.csv}.get(suffix, OutputFormat.table)


def command_inputs(prompts: Path | None, recipe: str | None, weights: Path | None) -> list:
    """Files the command reads, which --output must not replace: the prompts, the recipe (a path, or the
    file a name stands for) and the checkpoint's files. (The packaged checkpoints, eval sets and recipes
    are refused as outputs whatever the command: looptrace.output_files.)"""
    inputs: list = [(prompts, "--prompts"), recipe_input(recipe, "--recipe")]
    inputs += folder_inputs(weights, "--weights")
    return inputs


def recipe_input(recipe: str | None, what: str) -> tuple[Path | None, str]:
    """(the file a recipe option reads, `what`): a path as given, else recipes/NAME.yaml."""
    return (recipe_file(recipe) if recipe else None), what


def folder_inputs(folder: Path | None, what: str) -> list[tuple[Path, str]]:
    """The files of an input folder (a checkpoint, capture traces), each an input named `what`."""
    if folder is None or not folder.is_dir():
        return []
    return [(f, what) for f in sorted(folder.iterdir()) if f.is_file()]


def write_output(
    text: str,
    output: Path | None,
    console: Console,
    fmt: OutputFormat = OutputFormat.table,
    table: Callable[[], str] | None = None,
    on_written: Callable[[], None] | None = None,
) -> None:
    """Print to stdout and, with --output, write the same text (whole and atomically, after success).

    With -o and a machine format (json, csv) the terminal gets the human view instead of the file's text
    (a JSON report can run to thousands of lines): the table from `table()` where the command has one,
    then one line naming the file written. `on_written` is called once the file is whole (before any
    printing, which a Ctrl-C may cut short)."""
    if output is None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
        return
    atomic_write_text(output, text + "\n")
    if on_written is not None:
        on_written()
    if fmt == OutputFormat.table:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
        return
    if table is not None:
        console.print(table(), markup=False, highlight=False, soft_wrap=True)
    lines = text.count("\n") + 1
    console.print(
        f"wrote {output} ({fmt.value}, {lines} lines)", markup=False, highlight=False, soft_wrap=True
    )
