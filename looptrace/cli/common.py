"""What every command shares: exit codes, one-line errors, interrupts, the stderr console."""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from looptrace.build import BuildRequest, NoDeviceError

err_console = Console(stderr=True, highlight=False)

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_NO_ENV = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_CODES_HELP = "Exit codes: 0 ok, 2 bad input, 3 environment missing, 130 interrupted (Ctrl-C)."


class UsageError(ValueError):
    """Bad input detected by the CLI itself."""


def one_line(text: str) -> str:
    """`text` on one line: line breaks and other unprintable characters (a user's path or value may hold
    any) written as escapes, so an error stays one line and cannot drive the terminal."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    """Print `error: message` on one line to stderr and return the Exit to raise (`raise fail(...) from
    None`). The message is plain text, never Rich markup: it quotes user paths and values such as
    'my[/]recipe.yaml' (the one place every error goes through, so none needs escaping)."""
    err_console.print(Text("error: ", style="bold red") + Text(one_line(message)), soft_wrap=True)
    return typer.Exit(code=code)


def note(message: str, label: str = "note") -> None:
    """A `note:` (or `interrupted:`, ...) line on stderr; the message is plain text, as in `fail`."""
    err_console.print(Text(f"{label}: ", style="yellow") + Text(one_line(message)), soft_wrap=True)


# Input errors by (module, class): matched only once their module is loaded (an exception of a module
# never imported cannot have been raised), so commands that need no engine never import torch for this.
_BAD_INPUT = (
    ("looptrace.build", "BuildInputError"),
    ("looptrace.analysis.diff_run", "DiffInputError"),
    ("looptrace.drive.run_request", "RunInputError"),
    ("looptrace.analysis.depth", "DepthInputError"),
    ("looptrace.train.evaluate", "EvalSetError"),
    ("looptrace.drive.workloads", "WorkloadError"),
    ("looptrace.engine.llm_engine", "EngineInputError"),
    ("looptrace.engine.model_config", "UnknownModelError"),
    ("looptrace.engine.checkpoint", "CheckpointError"),
    ("looptrace.engine.tokenizer", "TokenizerError"),
    ("looptrace.engine.budget", "BudgetError"),
    ("looptrace.engine.config", "ConfigError"),
    ("looptrace.probes.session", "ProfileInputError"),
    ("looptrace.recipes", "RecipeError"),
    ("looptrace.serve.server", "ServeOptionError"),
    ("looptrace.output_files", "OutputError"),
)


def _bad_input_types() -> tuple[type[BaseException], ...]:
    found = [getattr(sys.modules[mod], name, None) for mod, name in _BAD_INPUT if mod in sys.modules]
    return (UsageError, FileNotFoundError, *(t for t in found if isinstance(t, type)))


@contextmanager
def friendly_errors() -> Iterator[None]:
    """Turn our input errors into one line + exit code 2; an unavailable device into exit code 3."""
    try:
        yield
    except NoDeviceError as exc:
        raise fail(str(exc), EXIT_NO_ENV) from None
    except Exception as exc:
        if isinstance(exc, _bad_input_types()):
            raise fail(str(exc)) from None
        raise


@contextmanager
def interrupt_exit(what: str | Callable[[], str] = "interrupted") -> Iterator[None]:
    """Ctrl-C anywhere in a command: one line on stderr and exit code 130, no traceback. `what` may be a
    function, asked at the Ctrl-C: the line then says what the command had done by then."""
    try:
        yield
    except KeyboardInterrupt:
        line = what() if callable(what) else what
        err_console.print(Text(one_line(line), style="yellow"), soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def spinner(show: bool, text: str):
    """A transient Rich spinner on stderr (drawn only when stderr is a terminal), or nothing."""
    return err_console.status(text) if show else nullcontext()


def fields_of(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The `options` (a command's parameters, by name) that dataclass `cls` has fields for."""
    return {f.name: options[f.name] for f in dataclasses.fields(cls) if f.name in options}


def pick(options: Any, names: str) -> dict[str, Any]:
    """The options `names` (space-separated) of a command's options namespace, by name."""
    return {name: vars(options)[name] for name in names.split()}


BUILD_OPTIONS = ("model", "weights", "random_weights", "recipe", "device", "dtype", "seed", "threads")


def build_request(options: Any, **fields: Any) -> BuildRequest:
    """The engine options a command was given (--model, --weights, --random-weights, --recipe, --set,
    --device, --dtype, --seed, --threads: those it has) as a `BuildRequest`; `fields` add or replace."""
    given = vars(options)
    picked = {name: given[name] for name in BUILD_OPTIONS if name in given}
    picked["sets"] = tuple(given.get("sets") or ())
    return BuildRequest(**(picked | fields))


def progress_bar(console: Console, *middle):
    """A transient Rich progress bar on `console`: the task's description, the bar, `middle`, elapsed time."""
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), *middle, TimeElapsedColumn())
    return Progress(*columns, console=console, transient=True)


def require_extra(command: str, *modules: str) -> None:
    """Exit 3 naming the first of `modules` that is missing: `command` needs the serve extra."""
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as exc:
        raise missing_extra(command, exc) from None


def missing_extra(command: str, exc: ImportError) -> typer.Exit:
    what = f"`looptrace {command}` needs the serve extra ({exc.name} is missing)"
    return fail(f"{what}: pip install 'looptrace[serve]'", EXIT_NO_ENV)


def check_roofline_device(name: str | None, option: str) -> None:
    """An unknown roofline device name is bad input before any work."""
    if name is None:
        return
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.probes.roofline import device_for

    try:
        device_for(None, name)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)
