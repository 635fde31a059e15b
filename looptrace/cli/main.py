"""The `looptrace` command: one Typer app, one module per command (group)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

import looptrace
from looptrace.cli.common import fail

try:  # Typer >= 0.20 vendors Click as typer._click; older releases use Click itself
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException


@contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    """A usage error (unknown option, bad value, missing argument) is one `error:` line, exit 2, as
    every other bad input: not Typer's usage line, hint and boxed message."""
    try:
        yield
    except ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help text is the answer (already printed)
            raise
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        message = " ".join(exc.format_message().split()).replace("Value error, ", "")  # Click's "\n\t"
        raise fail(message + hint, exc.exit_code) from None


class OneLineErrorsGroup(TyperGroup):
    """The top-level group: usage errors of any subcommand pass through its context and invoke."""

    def make_context(self, *args: Any, **kwargs: Any):
        with _one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line_usage_errors():
            return super().invoke(ctx)


app = typer.Typer(
    cls=OneLineErrorsGroup,
    name="looptrace",
    help="Profile, diff and serve looped language models (Ouro, Huginn-0125, recurrent OLMo retrofits).",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    epilog="Exit codes: 0 ok, 1 a check failed, 2 bad input, 3 environment missing, 130 interrupted.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"looptrace {looptrace.__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """looptrace: where does each token of a looped model go?"""


# (command name, module, function), in the order `looptrace --help` lists them. The modules' imports are
# light: torch, fastapi, uvicorn, textual and matplotlib load inside the commands.
COMMANDS = (
    ("profile", "profile_cmd", "profile"),
    ("run", "run_cmd", "run"),
    ("serve", "serve_cmd", "serve"),
    ("top", "top_cmd", "top"),
    ("diff", "diff_cmd", "diff"),
    ("depth", "depth_cmd", "depth"),  # depth analysis and tiny-model training
    ("train-tiny", "train_cmd", "train_tiny"),
    ("bench", "bench_cmd", "bench"),  # paired A/B benchmark
)


def _register() -> None:
    for name, module_name, function in COMMANDS:
        module = importlib.import_module(f"looptrace.cli.{module_name}")
        app.command(name, epilog=module.EPILOG)(vars(module)[function])
    from looptrace.cli.trace_cmd import trace_app
    from looptrace.cli.trace_compare_cmd import EPILOG as TRACE_COMPARE_EPILOG
    from looptrace.cli.trace_compare_cmd import compare as trace_compare

    trace_app.command("compare", epilog=TRACE_COMPARE_EPILOG)(trace_compare)
    app.add_typer(trace_app, name="trace")


_register()


def main() -> None:
    app()
