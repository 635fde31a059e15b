"""`looptrace profile`: what does one generated token cost, and where does it go?

Thin: building and profiling each side lives in looptrace.probes.profile_run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from looptrace.build import check_seed, resolve_model
from looptrace.cli.common import (
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    UsageError,
    dumps,
    err_console,
    friendly_errors,
    interrupt_exit,
    note,
    spinner,
)
from looptrace.cli.options import (
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    ModelOpt,
    OutputFormat,
    OutputOpt,
    SeedOpt,
    SetOpt,
    ThreadsOpt,
    WeightsOpt,
)
from looptrace.cli.output import atomic_path, check_outputs, command_inputs, infer_format, write_output

EPILOG = (
    """\
[bold]EXAMPLES[/]

  looptrace profile --model ouro                          # ouro-tiny on CPU (leaf ATen ops), ouro-1.4b on GPU
  looptrace profile --model ouro-1.4b -c 32 --set scheduler.max_num_seqs=32
  looptrace profile --model huginn --trace huginn.json    # also write a Chrome trace (open in Perfetto)
  looptrace profile --model ouro --compare base base --b-set cuda_graphs.enabled=false
  looptrace profile --model ouro --level layer --format json -o ouro.json

[bold]WHAT IS MEASURED[/]  A decode window (whole tokens, after warm-up and graph capture) and a prefill
window (a fresh burst until every request has its first token), under torch.profiler. Counters are per
output token (decode) or per prompt token (prefill). On CPU, "kernels" are leaf ATen ops. The --trace
file carries lt.tokens/<n> markers, so `looptrace trace analyze` of it reports the same tokens.

[bold]OUTPUT[/]  -o FILE: the format follows the suffix (.json, .csv, else table) unless --format is
given. -o and --trace are checked before profiling and written whole and atomically; a symlink is
written through; a directory or a device is refused. Ctrl-C reports the windows that finished.

"""
    + EXIT_CODES_HELP
)

LEVELS = ("step", "loop", "layer", "op")

ProfileRecipeOpt = Annotated[
    str | None,
    typer.Option(
        "--recipe", "-r", help="Recipe name in recipes/ or a YAML path (default: base).", show_default=False
    ),
]
ConcurrencyOpt = Annotated[int, typer.Option("--concurrency", "-c", help="Requests decoding together.")]
PromptLenOpt = Annotated[int, typer.Option(help="Prompt tokens per request (random ids).")]
DecodeStepsOpt = Annotated[
    int | None, typer.Option(help="Engine steps in the decode window (default: ~8 tokens per request).")
]
LevelOpt = Annotated[str, typer.Option(help="Range granularity: step, loop, layer or op.")]
TraceOpt = Annotated[Path | None, typer.Option("--trace", help="Write the Chrome trace here.")]
CompareOpt = Annotated[
    tuple[str, str] | None,
    typer.Option(
        help="Profile two recipes on the same workload and compare: --compare A B.", show_default=False
    ),
]
ASetOpt = Annotated[list[str] | None, typer.Option("--a-set", help="Override for side A of --compare.")]
BSetOpt = Annotated[list[str] | None, typer.Option("--b-set", help="Override for side B of --compare.")]
RooflineDeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--roofline-device",
        help="Device peaks for the roofline columns (h200, h100-sxm, mi300x, ...); default: the GPU's "
        "name from the trace, none on CPU.",
        show_default=False,
    ),
]


def profile(
    model: ModelOpt = None,
    recipe: ProfileRecipeOpt = None,
    sets: SetOpt = None,
    concurrency: ConcurrencyOpt = 1,
    prompt_len: PromptLenOpt = 64,
    decode_steps: DecodeStepsOpt = None,
    level: LevelOpt = "op",
    trace: TraceOpt = None,
    compare: CompareOpt = None,
    a_set: ASetOpt = None,
    b_set: BSetOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = None,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    roofline_device: RooflineDeviceOpt = None,
) -> None:
    """Count kernels, launches, graph replays and fallbacks, copies, syncs and time per generated token,
    attributed to model op x layer x loop x stage (the ExactLoop paper's Table A4, automated)."""
    with interrupt_exit("interrupted before any window finished: no report written"):
        _profile(_ProfileArgs(**locals()))  # every option, by name (the dataclass lists the same fields)


@dataclass(frozen=True)
class _ProfileArgs:
    model: str | None
    recipe: str | None
    sets: list[str] | None
    concurrency: int
    prompt_len: int
    decode_steps: int | None
    level: str
    trace: Path | None
    compare: tuple[str, str] | None
    a_set: list[str] | None
    b_set: list[str] | None
    device: str
    dtype: str
    weights: Path | None
    seed: int
    threads: int
    fmt: OutputFormat | None
    output: Path | None
    roofline_device: str | None


def _profile(a: _ProfileArgs) -> None:
    from looptrace.probes.profile_run import ProfileEngines, report_data
    from looptrace.probes.session import ProfileConfig

    fmt = infer_format(a.fmt, a.output)
    with friendly_errors():
        _check_options(a)
        cfg = ProfileConfig(a.concurrency, a.prompt_len, a.decode_steps, level=a.level, seed=a.seed)
        model = resolve_model(a.model, a.device, a.weights)
        engines = ProfileEngines(model, a.device, a.dtype, a.seed, a.threads)
        runs = _sides_to_run(a)
        sides, interrupted = _profile_sides(runs, cfg, engines, a.trace, a.roofline_device)
    data = report_data(sides, a.compare is not None)
    text = _render(sides, fmt, a.compare is not None)
    if interrupted:
        data["interrupted"] = True
        done = ", ".join(f"{s['header']['label']}: {'+'.join(s['windows'])}" for s in sides)
        note(f"reporting the windows that finished ({done})", "interrupted")
    with friendly_errors():
        write_output(text if fmt != OutputFormat.json else dumps(data), a.output, Console(width=140))
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)


def _check_options(a: _ProfileArgs) -> None:
    """The options, checked before anything is built."""
    from looptrace.probes.profile_run import check_prompts_memory

    if a.level not in LEVELS:
        raise UsageError(f"--level '{a.level}': expected one of {', '.join(LEVELS)}")
    if a.concurrency < 1 or a.prompt_len < 1 or (a.decode_steps is not None and a.decode_steps < 1):
        raise UsageError("--concurrency, --prompt-len and --decode-steps must be >= 1")
    check_prompts_memory(a.concurrency, a.prompt_len)
    if a.compare is not None and a.recipe is not None:  # --compare names both recipes
        raise UsageError(f"--recipe {a.recipe} and --compare A B: give one (--compare sets both sides)")
    recipe = a.recipe or "base"
    inputs = command_inputs(None, recipe, a.weights) + [(Path(r), "--compare") for r in a.compare or ()]
    check_outputs((a.output, "--output"), (a.trace, "--trace"), inputs=inputs)
    check_seed(a.seed)
    if a.compare is None and (a.a_set or a.b_set):
        raise UsageError("--a-set/--b-set only apply with --compare A B")


def _sides_to_run(a: _ProfileArgs) -> list[tuple[str, list[str]]]:
    """The (recipe, overrides) of each side, each loaded once to fail before any profiling."""
    runs = [(a.recipe or "base", list(a.sets or []))]
    if a.compare is not None:
        runs = _compare_runs(a.compare, list(a.sets or []), a.a_set, a.b_set)
    if a.roofline_device is not None:
        _check_roofline_device(a.roofline_device)
    return runs


def _compare_runs(compare: tuple[str, str], base: list[str], a_set, b_set) -> list[tuple[str, list[str]]]:
    from looptrace.recipes import load_recipe

    runs = [(name, base + list(extra or [])) for name, extra in zip(compare, (a_set, b_set))]
    for name, overrides in runs:  # both sides valid before any profiling
        load_recipe(name, overrides)
    return runs


def _check_roofline_device(name: str) -> None:
    from looptrace.probes.roofline import device_for

    try:
        device_for(None, name)
    except ValueError as exc:
        raise UsageError(f"--roofline-device: {exc}") from None


def _profile_sides(
    runs: list[tuple[str, list[str]]], cfg, engines, trace: Path | None, peak: str | None = None
) -> tuple[list[dict[str, Any]], bool]:
    """Profile each (recipe, overrides); the first side writes --trace. A Ctrl-C keeps the sides (and
    windows) that finished and skips the rest; with nothing finished it propagates."""
    from looptrace.probes.profile_run import profile_side

    def status(text: str):
        return spinner(err_console.is_terminal, text)

    sides: list[dict[str, Any]] = []
    for i, (name, overrides) in enumerate(runs):
        try:
            if i == 0 and trace is not None:
                with atomic_path(trace, "--trace") as tmp:
                    side = profile_side(name, overrides, cfg, engines, tmp, peak, status)
                side["header"]["trace"] = str(trace)
            else:
                side = profile_side(name, overrides, cfg, engines, None, peak, status)
        except KeyboardInterrupt:
            if not sides:
                raise
            return sides, True
        sides.append(side)
        if side["interrupted"]:
            return sides, True
    return sides, False


def _render(sides: list[dict[str, Any]], fmt: OutputFormat, compare: bool) -> str:
    """The text report (a --compare cut short before side B's decode window finished: side A alone)."""
    from looptrace.probes.profile_report import render_compare, render_single
    from looptrace.probes.profile_run import is_comparison

    return render_compare(sides, fmt) if is_comparison(sides, compare) else render_single(sides[0], fmt)
