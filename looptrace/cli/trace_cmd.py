"""`looptrace trace …`: analyse a saved Chrome/Kineto trace (torch.profiler, vLLM, SGLang)."""

from __future__ import annotations

import io
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from looptrace.cli.common import OutputFormat, UsageError, fail, interrupt_exit
from looptrace.cli.output import atomic_write_text, check_output, infer_format
from looptrace.probes.counters import analyze as analyze_trace
from looptrace.probes.events import TraceError, load_chrome_trace
from looptrace.probes.report import render_report, to_csv, to_json

EXAMPLES = """
[bold]EXAMPLES[/bold]

  looptrace trace analyze decode.json --tokens 64

  looptrace trace analyze vllm_rank0.json.gz --step-marker execute_model --format json -o counters.json

  looptrace trace analyze run.json --window all --format csv

[bold]TOKENS[/bold]  --tokens N, else --step-marker instances in the window (none is an error), else the
lt.tokens/<n> markers of looptrace's own traces (the same tokens `looptrace profile` reported), else
lt.step#/ProfilerStep# instances, else 1 (totals; the notes say so).

[bold]OUTPUT[/bold]  -o FILE: the format follows the suffix (.json, .csv, else table) unless --format is
given; written whole and atomically, through a symlink; a directory or a device is refused.

[bold]EXIT CODES[/bold]  0 ok · 2 bad input (missing file, invalid JSON, no events, no such window,
unknown --step-marker, unwritable -o) · 130 interrupted (Ctrl-C)

[bold]LEARN MORE[/bold]  counters and event rules: looptrace/probes/counters.py and classify.py docstrings
"""

trace_app = typer.Typer(
    help="Count kernels, launches, copies and syncs per token in a Chrome/Kineto trace.",
    rich_markup_mode="rich",
    no_args_is_help=True,
)


class WindowChoice(str, Enum):
    auto = "auto"
    decode = "decode"
    prefill = "prefill"
    all = "all"


def _wrote(output: Path) -> None:
    Console(stderr=True, highlight=False).print(f"wrote {output}")


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        atomic_write_text(output, text)
    except UsageError as exc:
        raise fail(str(exc)) from None
    _wrote(output)


@trace_app.command(epilog=EXAMPLES)
def analyze(
    trace: Annotated[
        Path, typer.Argument(help="Chrome/Kineto trace: .json or .json.gz.", show_default=False)
    ],
    tokens: Annotated[
        Optional[int],
        typer.Option("--tokens", min=1, help="Output tokens in the window (per-token divisor)."),
    ] = None,
    step_marker: Annotated[
        Optional[str],
        typer.Option(
            "--step-marker",
            help="user_annotation name prefix that marks one step (e.g. ProfilerStep#, execute_model); "
            "without --tokens, tokens = its instances in the window. Default: lt.step#, else ProfilerStep#.",
        ),
    ] = None,
    window: Annotated[
        WindowChoice,
        typer.Option(
            help="lt.window/decode or lt.window/prefill ranges, or the whole trace; auto: decode if any."
        ),
    ] = WindowChoice.auto,
    fmt: Annotated[
        Optional[OutputFormat],
        typer.Option(
            "--format",
            help="Output format. Default: from the --output suffix (.json, .csv), else table.",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Write to PATH instead of stdout.")
    ] = None,
    top: Annotated[int, typer.Option(min=0, help="Kernels listed in each top-kernels table.")] = 10,
) -> None:
    """Per-token counters (Table A4 shape), kernel attribution by stage/op/layer and top kernels."""
    with interrupt_exit():
        _analyze(trace, tokens, step_marker, window, infer_format(fmt, output), output, top)


def _analyze(
    trace: Path,
    tokens: int | None,
    step_marker: str | None,
    window: WindowChoice,
    fmt: OutputFormat,
    output: Path | None,
    top: int,
) -> None:
    try:
        check_output(output)
        loaded = load_chrome_trace(trace)
        if not loaded.events:
            raise TraceError(f"{trace}: no complete ('ph': 'X') events in the trace")
        result = analyze_trace(loaded, tokens=tokens, window=window.value, step_marker=step_marker, top=top)
    except (TraceError, UsageError) as exc:
        raise fail(str(exc)) from None
    header = {"trace": str(trace), "window": result.counters.window, "mode": result.counters.mode}
    if fmt is OutputFormat.json:
        _emit(to_json(result, header) + "\n", output)
    elif fmt is OutputFormat.csv:
        _emit(to_csv(result, header), output)
    elif output is None:
        render_report(result, header, Console(width=None if sys.stdout.isatty() else 160))
    else:
        buf = io.StringIO()
        render_report(result, header, Console(file=buf, width=160, color_system=None))
        _emit(buf.getvalue(), output)
