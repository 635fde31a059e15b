"""`looptrace trace …`: analyse a saved Chrome/Kineto trace (torch.profiler, vLLM, SGLang)."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from looptrace.cli.common import OutputFormat, UsageError, check_output_path, fail
from looptrace.probes.counters import analyze as analyze_trace
from looptrace.probes.events import TraceError, load_chrome_trace
from looptrace.probes.report import render_report, to_csv, to_json

EXAMPLES = """
[bold]EXAMPLES[/bold]

  looptrace trace analyze decode.json --tokens 64

  looptrace trace analyze vllm_rank0.json.gz --step-marker execute_model --format json -o counters.json

  looptrace trace analyze run.json --window all --format csv

[bold]EXIT CODES[/bold]  0 ok · 2 bad input (missing file, invalid JSON, no events, no such window)

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
    else:
        output.write_text(text, encoding="utf-8")
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
    fmt: Annotated[OutputFormat, typer.Option("--format", help="Output format.")] = OutputFormat.table,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Write to PATH instead of stdout.")
    ] = None,
    top: Annotated[int, typer.Option(min=0, help="Kernels listed in each top-kernels table.")] = 10,
) -> None:
    """Per-token counters (Table A4 shape), kernel attribution by stage/op/layer and top kernels."""
    try:
        check_output_path(output)
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
        with output.open("w", encoding="utf-8") as fh:
            render_report(result, header, Console(file=fh, width=160, color_system=None))
        _wrote(output)
