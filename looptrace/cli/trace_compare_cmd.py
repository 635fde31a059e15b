"""`looptrace trace compare A B`: two traces (any engine) or saved `trace analyze` reports side by side.

Thin: loading, the comparison rows and their tables live in looptrace.probes.compare.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from looptrace.cli.common import UsageError, check_roofline_device, dumps, fail, interrupt_exit
from looptrace.cli.options import OutputFormat, arg, opt
from looptrace.cli.output import OutputError, check_output, infer_format
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


def _labels(text: str | None) -> tuple[str, str]:
    if text is None:
        return "A", "B"
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise UsageError(f"--labels wants two comma-separated names, got {text!r}")
    return parts[0], parts[1]


SideArg = arg(Path, help="Trace (.json/.json.gz) or saved `trace analyze` JSON report.")
OtherSideArg = arg(Path, help="The other trace or report; ratios are B/A.")
LabelsOpt = opt(Optional[str], "--labels", help="Names of A and B, comma-separated (default: A,B).")
SideWindowOpt = opt(WindowChoice, help="Window of a trace side (as `trace analyze`); auto: decode if any.")
RooflineDeviceOpt = opt(
    Optional[str], "--device", help="Device for the roofline columns of a trace side (e.g. h200, mi300x)."
)
CaptureAOpt = opt(
    Optional[Path],
    "--capture-a",
    help="Capture folder for A's graph replays (default: beside A).",
)
CaptureBOpt = opt(
    Optional[Path],
    "--capture-b",
    help="Capture folder for B's graph replays (default: beside B).",
)
ByLayerOpt = opt(bool, "--by-layer", help="Op rows per layer (default: layers summed).")
TopRowsOpt = opt(int, min=0, help="Op rows shown (0: all), by the larger GPU time of the two.")
CompareFormatOpt = opt(
    Optional[OutputFormat],
    "--format",
    help="Output format. Default: from the -o suffix, else table.",
)


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
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.probes.compare import compare_reports, load_side
    from looptrace.probes.events import TraceError

    with interrupt_exit():
        try:
            check_output(output, inputs=[(a, "A"), (b, "B")])  # never replace an input with the comparison
            names = _labels(labels)
            check_roofline_device(device, "--device")
            sa, sb = (
                load_side(a, window.value, device, capture_a),
                load_side(b, window.value, device, capture_b),
            )
            data = compare_reports(sa[0], sb[0], names, (a, b), top or None, (sa[1], sb[1]), by_layer)
        except (TraceError, UsageError, OutputError) as exc:
            raise fail(str(exc)) from None
        _render(data, infer_format(fmt, output), output)


def _render(data: dict[str, Any], fmt: OutputFormat, output: Path | None) -> None:
    """JSON, CSV or the tables, to stdout (a terminal gets its own width and colours) or to OUTPUT."""
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.probes.compare import render_tables, to_csv

    if fmt is OutputFormat.json:
        text = dumps(data) + "\n"
    elif fmt is OutputFormat.csv:
        text = to_csv(data)
    else:
        buf = io.StringIO()
        width = None if output is None and sys.stdout.isatty() else 200
        file = None if output is None and sys.stdout.isatty() else buf
        # markup off: labels, paths and op names are user text (`--labels "A,[/]"` is no closing tag)
        console = Console(file=file, width=width, color_system=None if file is buf else "auto", markup=False)
        render_tables(data, console)
        if file is None:
            return
        text = buf.getvalue()
    emit(text, output)
