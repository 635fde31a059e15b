"""`looptrace profile`: what does one generated token cost, and where does it go?

Thin: building and profiling each side lives in looptrace.probes.profile_run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import typer
from rich.console import Console

from looptrace.build import check_seed
from looptrace.cli import common as c
from looptrace.cli import options as o
from looptrace.cli.output import (
    check_outputs,
    command_inputs,
    infer_format,
    recipe_input,
    write_output,
)

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
    + c.EXIT_CODES_HELP
)

ProfileRecipeOpt = o.opt(
    str | None,
    "--recipe",
    "-r",
    help="Recipe name in recipes/ or a YAML path (default: base).",
)
ConcurrencyOpt = o.opt(int, "--concurrency", "-c", help="Requests decoding together.")
PromptLenOpt = o.opt(int, help="Prompt tokens per request (random ids).")
DecodeStepsOpt = o.opt(int | None, help="Engine steps in the decode window (default: ~8 tokens per request).")
LevelOpt = o.opt(str, help="Range granularity: step, loop, layer or op.")
TraceOpt = o.opt(Path | None, "--trace", parser=o.output_path, help="Write the Chrome trace here.")
ShapesOpt = o.opt(
    bool,
    "--shapes",
    help="Record every op's input shapes (attention key lengths, for the dead_kv finding); adds host time.",
)
CompareOpt = o.opt(
    tuple[str, str] | None,
    help="Profile two recipes on the same workload and compare: --compare A B.",
)
ASetOpt = o.opt(list[str] | None, "--a-set", help="Override for side A of --compare.")
BSetOpt = o.opt(list[str] | None, "--b-set", help="Override for side B of --compare.")
RooflineDeviceOpt = o.opt(
    str | None,
    "--roofline-device",
    help="Device peaks for the roofline columns (h200, h100-sxm, mi300x, ...); default: the GPU's name from "
    "the trace, none on CPU.",
)


def profile(
    model: o.ModelOpt = None,
    recipe: ProfileRecipeOpt = None,
    sets: o.SetOpt = None,
    concurrency: ConcurrencyOpt = 1,
    prompt_len: PromptLenOpt = 64,
    decode_steps: DecodeStepsOpt = None,
    level: LevelOpt = "op",
    trace: TraceOpt = None,
    shapes: ShapesOpt = False,
    compare: CompareOpt = None,
    a_set: ASetOpt = None,
    b_set: BSetOpt = None,
    device: o.DeviceOpt = "auto",
    dtype: o.DtypeOpt = "auto",
    weights: o.WeightsOpt = None,
    seed: o.SeedOpt = 0,
    threads: o.ThreadsOpt = 1,
    fmt: o.FormatOpt = None,
    output: o.OutputOpt = None,
    roofline_device: RooflineDeviceOpt = None,
) -> None:
    """Count kernels, launches, graph replays and fallbacks, copies, syncs and time per generated token,
    attributed to model op x layer x loop x stage (the ExactLoop paper's Table A4, automated)."""
    a = SimpleNamespace(**locals(), written=[])  # every option, by name; the files written so far
    with c.interrupt_exit(lambda: _interrupted_line(a.written)):
        _profile(a)


def _interrupted_line(written: list[str]) -> str:
    if not written:
        return "interrupted before any window finished: no report written"
    return f"interrupted after writing {' and '.join(written)} (whole)"


def _profile(a: SimpleNamespace) -> None:
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.probes.profile_report import render
    from looptrace.probes.profile_run import ProfileEngines, profile_sides, report_data, sides_to_run
    from looptrace.probes.session import ProfileConfig

    fmt = infer_format(a.fmt, a.output)
    with c.friendly_errors():
        _check_options(a)
        cfg = ProfileConfig(
            a.concurrency, a.prompt_len, a.decode_steps, level=a.level, seed=a.seed, record_shapes=a.shapes
        )
        build = c.build_request(a, recipe=a.recipe or "base")
        engines = ProfileEngines(build, build.resolve_model())
        runs = sides_to_run(a.recipe, a.sets, a.compare, a.a_set, a.b_set)
        c.check_roofline_device(a.roofline_device, "--roofline-device")
        # a status line on stderr while each side profiles (45 s at real shape on a CPU), for a terminal
        # only, and not under JSON on stdout (a script reads it; its stderr may be the same terminal)
        json_to_stdout = fmt == o.OutputFormat.json and a.output is None
        status = lambda text: c.spinner(c.err_console.is_terminal and not json_to_stdout, text)
        sides, interrupted = profile_sides(runs, cfg, engines, a.trace, a.roofline_device, status)
    if a.trace is not None:
        a.written.append(f"--trace {a.trace}")
    data = report_data(sides, a.compare is not None)
    text = render(sides, fmt, a.compare is not None)
    if interrupted:
        data["interrupted"] = True
        done = ", ".join(f"{s['header']['label']}: {'+'.join(s['windows'])}" for s in sides)
        c.note(f"reporting the windows that finished ({done})", "interrupted")
    body = text if fmt != o.OutputFormat.json else c.dumps(data)
    with c.friendly_errors():
        table = lambda: render(sides, "table", a.compare is not None)  # the terminal's view with -o X.json
        written = lambda: a.written.append(f"--output {a.output}")  # a Ctrl-C while printing knows it
        write_output(body, a.output, Console(width=140), fmt, table, on_written=written)
    if a.trace is not None and a.trace.exists():
        c.note(
            f"open {a.trace} in Perfetto (ui.perfetto.dev) or run: looptrace trace analyze {a.trace}", "next"
        )
    if interrupted:
        raise typer.Exit(c.EXIT_INTERRUPTED)


def _check_options(a: SimpleNamespace) -> None:
    """The options, checked before anything is built."""
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.probes.profile_run import check_options

    check_options(a.level, a.concurrency, a.prompt_len, a.decode_steps)
    if a.compare is not None and a.recipe is not None:  # --compare names both recipes
        raise c.UsageError(f"--recipe {a.recipe} and --compare A B: give one (--compare sets both sides)")
    recipe = a.recipe or "base"
    inputs = command_inputs(None, recipe, a.weights) + [recipe_input(r, "--compare") for r in a.compare or ()]
    check_outputs((a.output, "--output"), (a.trace, "--trace"), inputs=inputs)
    check_seed(a.seed)
    if a.compare is None and (a.a_set or a.b_set):
        raise c.UsageError("--a-set/--b-set only apply with --compare A B")
