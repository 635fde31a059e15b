"""`looptrace trace …`: analyse a saved Chrome/Kineto trace (torch.profiler, vLLM, SGLang)."""

from __future__ import annotations

import io
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.text import Text

from looptrace.cli.common import UsageError, fail, interrupt_exit
from looptrace.cli.options import OutputFormat, arg, opt, output_path
from looptrace.cli.output import OutputError, atomic_write_text, check_output, folder_inputs, infer_format

EXAMPLES = """
[bold]EXAMPLES[/bold]

  looptrace trace analyze decode.json --tokens 64

  looptrace trace analyze vllm_decode_full/graph_execution.json.gz   [dim]# finds capture_traces/[/dim]

  looptrace trace analyze replay.json.gz --capture run1/capture_traces --format json -o report.json

  looptrace trace analyze sglang_prefill.json.gz --device MI300X

  looptrace trace analyze vllm_rank0.json.gz --step-marker execute_model --format json -o counters.json

  looptrace trace analyze run.json --window all --format csv

  looptrace trace analyze ouro_vllm.json.gz --loops 4   [dim]# loops run back to back[/dim]

[bold]TOKENS[/bold]  --tokens N, else --step-marker instances in the window (none is an error), else the
lt.tokens/<n> markers of looptrace's own traces (the same tokens `looptrace profile` reported), else the
engine's step annotations (vLLM execute_<n>_context_…_generation_…, SGLang step[EXTEND|DECODE …]: output
tokens when the window decodes, else prompt tokens; the phase table gives decode per output token and
prefill per prompt token), else lt.step#, ProfilerStep#, execute_model or gpu_model_runner instances,
else the model's forward passes (FORWARDS below), else 1 (totals; the notes say so).

[bold]FORWARDS[/bold]  without step annotations (a Hugging Face generate, a script's decode loop), each
forward of the model is one step: the lm-head GEMM (output dimension = the vocabulary) closes it, its
module / forward event or embedding lookup opens it (record with record_shapes=True). Its rows (the
lookup's ids, else the first GEMM's M) tell prefill (prompt tokens) from decode (one output token per
sequence). tokens = decode rows; the default window is the decode forwards (--window prefill: the
prefill forwards; all: everything); the phase table gives both.

[bold]GRAPH REPLAYS[/bold]  kernels of a CUDA/HIP graph replay have no CPU op around them; --capture DIR
(default: a capture_traces/ folder beside the trace, with execution_details.json) maps them, by order,
to the launches recorded while the graph was captured (vLLM --profiler-config.capture_torch_profiler,
SGLang --enable-profile-cuda-graph). Without one the report says they are not attributed.

[bold]LOOPED MODELS[/bold]  in a trace without looptrace's lt.* ranges, a looped model (Ouro, Huginn) is
found from its launch pattern: within each engine step or forward, two or more consecutive blocks of
layers with the same ops, separated by the same ops, are passes of the recurrent block. Kernels then get
stage, loop and layer (core<i>, prelude<i>, coda<i>); the report adds a "Loop structure" line (JSON:
structure = prelude_layers, layers_per_loop, loops, coda_layers, source, coverage), "Kernels by op and
loop" (JSON: breakdown.by_loop, breakdown.by_op_layer_loop) and a note on what was found. Loops that
run back to back with no op between them look like a deeper plain model: --loops N and/or
--layers-per-loop L split them (and keep only patterns of that shape). Traces with lt ranges take
loops from the ranges; the hints are ignored there.

[bold]OUTPUT[/bold]  -o FILE: the format follows the suffix (.json, .csv, else table) unless --format is
given; written whole and atomically, through a symlink; a directory or a device is refused.

[bold]EXIT CODES[/bold]  0 ok · 2 bad input (missing file, invalid JSON, truncated gzip, not a trace, no
events, no such window, unknown --step-marker, a capture folder without execution_details.json,
unwritable -o) · 130 interrupted (Ctrl-C)

[bold]LEARN MORE[/bold]  counters and event rules: looptrace/probes/counters.py and classify.py docstrings;
runtime names: runtime.py; steps: steps.py; forwards: forwards.py; categories: categories.py; capture
traces: capture.py; loop inference: loops.py; structure: structure.py
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


def emit(text: str, output: Path | None) -> None:
    """Text to stdout, or written whole and atomically to OUTPUT (trace analyze and trace compare)."""
    if output is None:
        sys.stdout.write(text)
        return
    try:
        atomic_write_text(output, text)
    except OutputError as exc:
        raise fail(str(exc)) from None
    Console(stderr=True, highlight=False).print(Text(f"wrote {output}"))  # a path, not markup


TraceArg = arg(Path, help="Chrome/Kineto trace: .json or .json.gz.")
TokensOpt = opt(Optional[int], "--tokens", min=1, help="Output tokens in the window (per-token divisor).")
StepMarkerOpt = opt(
    Optional[str],
    "--step-marker",
    help="user_annotation name prefix that marks one step (e.g. ProfilerStep#, execute_model); without "
    "--tokens, tokens = its instances in the window. Default: lt.step#, else ProfilerStep#.",
)
WindowOpt = opt(
    WindowChoice,
    help="lt.window/decode or lt.window/prefill ranges, or the whole trace; auto: decode if any.",
)
TraceFormatOpt = opt(
    Optional[OutputFormat],
    "--format",
    help="Output format. Default: from the --output suffix (.json, .csv), else table.",
)
TraceOutputOpt = opt(
    Optional[Path], "--output", "-o", parser=output_path, help="Write to PATH instead of stdout."
)
TopOpt = opt(int, min=0, help="Kernels listed in each top-kernels table.")
CaptureOpt = opt(
    Optional[Path],
    "--capture",
    help="Capture-trace folder (execution_details.json + traces) that attributes graph-replayed kernels. "
    "Default: capture_traces/ beside the trace, if present.",
)
PeakDeviceOpt = opt(
    Optional[str],
    help="Device for the roofline peaks (e.g. H100, MI300X). Default: the trace's.",
)
LoopsOpt = opt(
    Optional[int],
    "--loops",
    min=1,
    help="Looped model: passes of its recurrent block per forward (traces without lt ranges; see LOOPED "
    "MODELS).",
)
LayersPerLoopOpt = opt(
    Optional[int],
    "--layers-per-loop",
    min=1,
    help="Looped model: layers in its recurrent block (traces without lt ranges).",
)


@trace_app.command(epilog=EXAMPLES)
def analyze(
    trace: TraceArg,
    tokens: TokensOpt = None,
    step_marker: StepMarkerOpt = None,
    window: WindowOpt = WindowChoice.auto,
    fmt: TraceFormatOpt = None,
    output: TraceOutputOpt = None,
    top: TopOpt = 10,
    capture: CaptureOpt = None,
    device: PeakDeviceOpt = None,
    loops: LoopsOpt = None,
    layers_per_loop: LayersPerLoopOpt = None,
) -> None:
    """Per-token counters (Table A4 shape), op categories and per-op roofline, kernel attribution by
    stage/op/layer and top kernels; vLLM, SGLang, Hugging Face and looptrace traces (CUDA and ROCm)."""
    with interrupt_exit():
        # The analysis modules load here, not at import: `looptrace --help` and usage errors stay fast.
        # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
        from looptrace.probes.capture import find_capture_dir
        from looptrace.probes.compare import analyze_file
        from looptrace.probes.events import TraceError

        try:
            inputs = [(trace, "trace"), *folder_inputs(capture or find_capture_dir(trace), "--capture")]
            check_output(output, inputs=inputs)  # never replace the trace (or a capture) with its analysis
            if step_marker is not None and not step_marker.strip():  # '' would match every annotation
                raise UsageError("--step-marker: expected a name prefix (e.g. ProfilerStep#), got ''")
            result, header, captures = analyze_file(
                trace, capture, tokens=tokens, window=window.value, step_marker=step_marker, top=top,
                device=device, loops=loops, layers_per_loop=layers_per_loop,
            )  # fmt: skip
        except (TraceError, UsageError, OutputError) as exc:
            raise fail(str(exc)) from None
        if captures is not None:
            header["capture"] = str(capture or find_capture_dir(trace))
        if result.device:
            header["device"] = result.device
        _render(result, header, infer_format(fmt, output), output)


def _render(result, header: dict, fmt: OutputFormat, output: Path | None) -> None:
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.probes.report import render_report, to_csv, to_json

    if fmt is OutputFormat.json:
        emit(to_json(result, header) + "\n", output)
    elif fmt is OutputFormat.csv:
        emit(to_csv(result, header), output)
    elif output is None:
        render_report(result, header, Console(width=None if sys.stdout.isatty() else 160))
    else:
        buf = io.StringIO()
        render_report(result, header, Console(file=buf, width=160, color_system=None))
        emit(buf.getvalue(), output)
