"""The `looptrace` command: one Typer app, one module per command (group)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from typer.core import TyperGroup, TyperOption

import looptrace
from looptrace.cli.common import fail
from looptrace.cli.trace_cmd import trace_app
from looptrace.cli.trace_compare_cmd import EPILOG as TRACE_COMPARE_EPILOG
from looptrace.cli.trace_compare_cmd import compare as trace_compare

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


def _flag_type_hidden(display_type_rich):
    """Help shows a value type (`<int>`) after an option that takes a value, not after a flag: `--once`
    and `--progress/--no-progress` take none, and `<bool>` there read as if they wanted one."""

    def display(self: TyperOption, ctx) -> str | None:
        return None if self.is_flag else display_type_rich(self, ctx)

    return display


if hasattr(TyperOption, "display_type_rich"):  # Typer's rich help (older releases have no such hook)
    TyperOption.display_type_rich = _flag_type_hidden(TyperOption.display_type_rich)


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
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
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


HELP_WIDTH = 78  # an 80-column terminal, less the help's one-column margins


VERBATIM = ("looptrace", "#", "{", "$")  # how the lines of an example paragraph start


def fit_epilog(text: str, width: int = HELP_WIDTH) -> str:
    """A command's epilog, readable at 80 columns. Help prints it line for line, so a prose paragraph
    hard-wrapped at 100 columns came out ragged: its lines are joined for the terminal to wrap. An
    example paragraph keeps its lines; an example that would wrap gets its `# comment` on a line above
    it and its options continued on the next line (`\\`), as one would type it."""
    paragraphs = []
    for paragraph in text.strip("\n").split("\n\n"):
        lines = paragraph.split("\n")
        if not any(line.strip().startswith(VERBATIM) for line in lines):
            paragraphs.append(" ".join(line.strip() for line in lines))
            continue
        out: list[str] = []
        for line in lines:
            out += _fit_example(line, width) if len(line) > width else [line]
        paragraphs.append("\n".join(out))
    return "\n\n".join(paragraphs)


def _fit_example(line: str, width: int) -> list[str]:
    """One example line as lines of at most `width` where its options allow."""
    indent = line[: len(line) - len(line.lstrip())]
    command, sep, comment = line.partition("  # ")
    out = [f"{indent}# {comment.strip()}"] if sep else []
    command = command.rstrip()
    while len(command) > width:
        cut = command.rfind(" -", len(indent), width - 2)  # before an option, leaving room for " \\"
        if cut <= len(indent):
            break
        out.append(command[:cut] + " \\")
        command = indent + "    " + command[cut + 1 :]
    return out + [command]


def _register() -> None:
    for name, module_name, function in COMMANDS:
        module = importlib.import_module(f"looptrace.cli.{module_name}")
        app.command(name, epilog=fit_epilog(module.EPILOG))(vars(module)[function])
    trace_app.command("compare", epilog=fit_epilog(TRACE_COMPARE_EPILOG))(trace_compare)
    app.add_typer(trace_app, name="trace")


_register()


def main() -> None:
    app()
