"""The `looptrace` command: one Typer app, one module per command (group)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

import looptrace
from looptrace.cli.common import fail
from looptrace.cli.profile_cmd import EPILOG as PROFILE_EPILOG
from looptrace.cli.profile_cmd import profile
from looptrace.cli.run_cmd import EPILOG as RUN_EPILOG
from looptrace.cli.run_cmd import run

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


app.command(epilog=PROFILE_EPILOG)(profile)
app.command(epilog=RUN_EPILOG)(run)


def _register_optional() -> None:
    """Commands whose modules may pull heavier imports are attached here."""
    from looptrace.cli.trace_cmd import trace_app
    from looptrace.cli.trace_compare_cmd import EPILOG as TRACE_COMPARE_EPILOG
    from looptrace.cli.trace_compare_cmd import compare as trace_compare

    trace_app.command("compare", epilog=TRACE_COMPARE_EPILOG)(trace_compare)
    app.add_typer(trace_app, name="trace")
    # serve/top: module imports are light; fastapi, uvicorn and textual load inside the commands.
    from looptrace.cli.serve_cmd import EPILOG as SERVE_EPILOG
    from looptrace.cli.serve_cmd import serve
    from looptrace.cli.top_cmd import EPILOG as TOP_EPILOG
    from looptrace.cli.top_cmd import top

    app.command(epilog=SERVE_EPILOG)(serve)
    app.command(epilog=TOP_EPILOG)(top)
    from looptrace.cli.diff_cmd import EPILOG as DIFF_EPILOG
    from looptrace.cli.diff_cmd import diff

    app.command(epilog=DIFF_EPILOG)(diff)
    # issue #9: depth analysis and tiny-model training (torch/numpy load inside the commands).
    from looptrace.cli.depth_cmd import EPILOG as DEPTH_EPILOG
    from looptrace.cli.depth_cmd import depth
    from looptrace.cli.train_cmd import EPILOG as TRAIN_EPILOG
    from looptrace.cli.train_cmd import train_tiny

    app.command(epilog=DEPTH_EPILOG)(depth)
    app.command("train-tiny", epilog=TRAIN_EPILOG)(train_tiny)
    # issue #8: paired A/B benchmark (torch and matplotlib load inside the command).
    from looptrace.cli.bench_cmd import EPILOG as BENCH_EPILOG
    from looptrace.cli.bench_cmd import bench

    app.command(epilog=BENCH_EPILOG)(bench)


_register_optional()


def main() -> None:
    app()
