"""The `looptrace` command: one Typer app, one module per command (group)."""

from __future__ import annotations

from typing import Annotated

import typer

import looptrace
from looptrace.cli.profile_cmd import EPILOG as PROFILE_EPILOG
from looptrace.cli.profile_cmd import profile
from looptrace.cli.run_cmd import EPILOG as RUN_EPILOG
from looptrace.cli.run_cmd import run

app = typer.Typer(
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
