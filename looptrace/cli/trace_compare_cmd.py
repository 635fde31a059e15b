"""`looptrace trace compare A B`: two traces (any engine) or saved `trace analyze` reports side by side.

Thin: loading, the comparison rows and their tables live in looptrace.probes.compare.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from looptrace.cli.common import UsageError, fail, interrupt_exit
from looptrace.cli.options import OutputFormat
from looptrace.cli.trace_cmd import TraceOutputOpt, WindowChoice, emit

EPILOG = """
[bold]EXAMPLES[/bold]

  looptrace trace compare base_decode.json.gz exactloop_decode.json.gz --labels base,exactloop

  looptrace trace compare vllm_ouro.json.gz looptrace_ouro.json.gz --format json -o compare.json

  looptrace trace analyze run.json --format json -o run_report.json
  looptrace trace compare run_report.json other.json.gz --top 40

[bold]INPUTS[/bold]  each of A and B is a Chrome/Kineto trace (.json / .json.gz, torch.profiler, vLLM,
SGLang, Hugging Face) analysed as `trace analyze` does, or a saved `trace analyze --format json` report.

[bold]RATIOS[/bold]  B/A of the per-token values (each side divided by its own token count); "–" where both
are 0, "new" where only B has the row.

[bold]EXIT CODES[/bold]  0 ok · 2 bad input (missing or unreadable file, not a trace or report, unknown
--device, unwritable -o) · 130 interrupted
"""


# --- command -----------------------------------------------------------------------------------------


def _labels(text: str | None) -> tuple[str, str]:
    if text is None:
        return "A", "B"
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise UsageError(f"--labels wants two comma-separated names, got {text!r}")
    return parts[0], parts[1]


def _check_device(device: str | None) -> None:
    """An unknown --device name is bad input before any trace is read."""
    if device is None:
        return
    from looptrace.probes.roofline import device_for

    try:
        device_for(None, device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None


SideArg = Annotated[Path, typer.Argument(help="Trace (.json/.json.gz) or saved `trace analyze` JSON report.")]
OtherSideArg = Annotated[Path, typer.Argument(help="The other trace or report; ratios are B/A.")]
LabelsOpt = Annotated[
    Optional[str], typer.Option("--labels", help="Names of A and B, comma-separated (default: A,B).")
]
SideWindowOpt = Annotated[
    WindowChoice, typer.Option(help="Window of a trace side (as `trace analyze`); auto: decode if any.")
]
RooflineDeviceOpt = Annotated[
    Optional[str],
    typer.Option("--device", help="Device for the roofline columns of a trace side (e.g. h200, mi300x)."),
]
CaptureAOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--capture-a", help="Capture folder for A's graph replays (default: beside A).", show_default=False
    ),
]
CaptureBOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--capture-b", help="Capture folder for B's graph replays (default: beside B).", show_default=False
    ),
]
ByLayerOpt = Annotated[bool, typer.Option("--by-layer", help="Op rows per layer (default: layers summed).")]
TopRowsOpt = Annotated[
    int, typer.Option(min=0, help="Op rows shown (0: all), by the larger GPU time of the two.")
]
CompareFormatOpt = Annotated[
    Optional[OutputFormat],
    typer.Option(
        "--format", help="Output format. Default: from the -o suffix, else table.", show_default=False
    ),
]


def compare(
    a: SideArg,
    b: OtherSideArg,
    labels: LabelsOpt = None,
    window: SideWindowOpt = WindowChoice.auto,
    device: RooflineDeviceOpt = None,
    capture_a: CaptureAOpt = None,
    capture_b: CaptureBOpt = None,
    by_layer: ByLayerOpt = False,
    top: TopRowsOpt = 25,
    fmt: CompareFormatOpt = None,
    output: TraceOutputOpt = None,
) -> None:
    """Two traces or reports side by side per op category and op, per token, with B/A ratios."""
    with interrupt_exit():
        sides = ((a, capture_a), (b, capture_b))
        _compare(sides, labels, window.value, device, by_layer, top, fmt, output)


def _compare(
    sides: tuple[tuple[Path, Path | None], tuple[Path, Path | None]],
    labels: str | None,
    window: str,
    device: str | None,
    by_layer: bool,
    top: int,
    fmt: OutputFormat | None,
    output: Path | None,
) -> None:
    from looptrace.cli.output import check_output, infer_format
    from looptrace.probes.compare import compare_reports, load_side
    from looptrace.probes.events import TraceError

    (a, cap_a), (b, cap_b) = sides
    try:
        check_output(output, inputs=[(a, "A"), (b, "B")])  # never replace an input with the comparison
        names = _labels(labels)
        _check_device(device)
        (ra, sa), (rb, sb) = load_side(a, window, device, cap_a), load_side(b, window, device, cap_b)
        data = compare_reports(ra, rb, names, (a, b), top or None, (sa, sb), by_layer)
    except (TraceError, UsageError) as exc:
        raise fail(str(exc)) from None
    _render(data, infer_format(fmt, output), output)


def _render(data: dict[str, Any], fmt: OutputFormat, output: Path | None) -> None:
    """JSON, CSV or the tables, to stdout (a terminal gets its own width and colours) or to OUTPUT."""
    from rich.console import Console

    from looptrace.probes.compare import render_tables, to_csv

    if fmt is OutputFormat.json:
        text = json.dumps(data, indent=2, default=str) + "\n"
    elif fmt is OutputFormat.csv:
        text = to_csv(data)
    else:
        buf = io.StringIO()
        width = None if output is None and sys.stdout.isatty() else 200
        file = None if output is None and sys.stdout.isatty() else buf
        console = Console(file=file, width=width, color_system=None if file is buf else "auto")
        render_tables(data, console)
        if file is None:
            return
        text = buf.getvalue()
    emit(text, output)
