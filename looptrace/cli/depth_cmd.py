"""`looptrace depth`: LoopDuet state-distance analysis, the (S, P) recommendation, R_layer and Amdahl.

Thin: the experiment lives in looptrace.analysis.depth_run, its text in looptrace.analysis.depth_report.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer
from rich.console import Console
from rich.progress import MofNCompleteColumn
from rich.text import Text

from looptrace.cli import options as o
from looptrace.cli.common import (
    EXIT_INTERRUPTED,
    UsageError,
    build_request,
    err_console,
    friendly_errors,
    progress_bar,
)
from looptrace.cli.output import check_output, command_inputs, infer_format, write_output

EPILOG = """
[bold]EXAMPLES[/bold]

  looptrace depth --model huginn                       # built-in eval set, S_ref = the model's loops
  looptrace depth --model huginn --s-ref 16 --tau 0.24 --format json -o depth.json
  looptrace depth --model huginn --accuracy-by-depth 1,2,4,8,16 --limit 500

[bold]EXIT CODES[/bold]  0 ok · 2 bad input (tau outside (0, 1), P > S, prompts without 'prompt'/'answer')
"""

DepthListOpt = o.opt(
    str | None,
    "--accuracy-by-depth",
    help="Comma-separated loop counts: report exact-match accuracy at each depth (no analysis).",
)


class _Phases:
    """Rich progress on stderr (drawn only on a terminal): the phase running, phases done, elapsed time."""

    def __init__(self, show: bool) -> None:
        self.bar = progress_bar(err_console, MofNCompleteColumn()) if show else None
        if self.bar is not None:
            self.task = self.bar.add_task("starting", total=None)

    def plan(self, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, total=total, completed=0)

    def start(self, what: str, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=what, completed=done)
            self.bar.refresh()  # draw each phase now: a fast phase may end before the next 10 Hz refresh

    def __enter__(self) -> _Phases:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


DepthModelOpt = o.opt(
    str, "--model", "-m", parser=o.non_empty, help="Family or preset (huginn -> huginn-tiny on CPU)."
)
PromptsOpt = o.opt(
    Path | None, help='JSONL of {"prompt": ..., "answer": ...}; default: the built-in evaluation set.'
)
SRefOpt = o.opt(int | None, "--s-ref", help="Reference depth (default: the model's loops).")
SOpt = o.opt(int | None, "--s", help="Decoding depth S of the recommendation (default S_ref).")
POpt = o.opt(int | None, "--p", help="Report R_layer / Amdahl at this P (default: recommended).")
TauOpt = o.opt(float, help="Prompt-token q90 threshold, in (0, 1).")
LimitOpt = o.opt(int, help="Use the first N prompts (0 = all).")
UseGeneratedOpt = o.opt(
    bool, "--use-generated", help="Replay the generated answers even where 'answer' is given."
)
ValidateOpt = o.opt(
    bool,
    "--validate",
    help="Serve (S, S) and (S, P) (kv.layout=shared): throughput ratio vs R_layer, TTFT, token agreement, "
    "eval accuracy with paired SE; plus a Poisson+burst run of the queue-age controller.",
)
ValPromptLenOpt = o.opt(int, help="--validate: prompt tokens of the throughput workload.")
ValAnswerLenOpt = o.opt(int, help="--validate: output tokens per request.")
ValRequestsOpt = o.opt(int, help="--validate: requests in the throughput burst.")
RepeatsOpt = o.opt(int, help="--validate: timed runs per depth (best kept).")


def depth(
    model: DepthModelOpt = "huginn",
    prompts: PromptsOpt = None,
    s_ref: SRefOpt = None,
    s: SOpt = None,
    p: POpt = None,
    tau: TauOpt = 0.24,
    limit: LimitOpt = 64,
    use_generated: UseGeneratedOpt = False,
    accuracy_by_depth: DepthListOpt = None,
    validate: ValidateOpt = False,
    val_prompt_len: ValPromptLenOpt = 192,
    val_answer_len: ValAnswerLenOpt = 4,
    val_requests: ValRequestsOpt = 4,
    repeats: RepeatsOpt = 2,
    fmt: o.FormatOpt = None,
    output: o.OutputOpt = None,
    recipe: o.RecipeOpt = "base",
    sets: o.SetOpt = None,
    device: o.DeviceOpt = "cpu",
    dtype: o.DtypeOpt = "auto",
    weights: o.WeightsOpt = None,
    random_weights: o.RandomWeightsOpt = False,
    seed: o.SeedOpt = 0,
    threads: o.ThreadsOpt = 1,
    progress: o.ProgressOpt = True,
) -> None:
    """State distance per loop (q90 by token role), recommended (S, P), R_layer (Eq. 3), Amdahl (Eq. 4)."""
    _depth(SimpleNamespace(**locals()))  # every option, by name


def _depth(a: SimpleNamespace) -> None:
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.analysis import depth_run as R

    fmt = infer_format(a.fmt, a.output)
    by_depth = a.accuracy_by_depth is not None
    report: dict[str, Any] = {}  # filled as the work goes: a Ctrl-C writes what was measured
    shape = R.ValidateShape(a.val_prompt_len, a.val_answer_len, a.val_requests, a.repeats)
    try:
        with friendly_errors(), _Phases(a.progress and err_console.is_terminal) as phases:
            R.check_loops(a.tau, s_ref=a.s_ref, s=a.s, p=a.p)
            if a.random_weights and a.weights is not None:  # one would be silently ignored
                raise UsageError("--random-weights and --weights: give one (--weights loads that checkpoint)")
            if by_depth:
                R.parse_depths(a.accuracy_by_depth)  # before the model loads
            check_output(a.output, inputs=command_inputs(a.prompts, a.recipe, a.weights))
            R.check_sizes(a.limit, shape)
            items = R.load_items(a.prompts, a.limit, need_answer=by_depth)
            build = build_request(a)
            engines = R.DepthEngines(build, build.resolve_model())
            if by_depth:
                depths = R.parse_depths(a.accuracy_by_depth)
                R.check_memory(engines, depths, "--accuracy-by-depth", items)
                R.run_accuracy(engines, items, depths, report, phases)
            else:
                R.check_memory(engines, [a.s_ref] if a.s_ref else [], "--s-ref", items)
                val = shape if a.validate else None
                request = R.DepthRequest(engines, items, a.s_ref, a.s, a.p, a.tau, a.use_generated, val)
                R.run_depth(request, report, phases)
    except KeyboardInterrupt:
        _interrupted(report, fmt, a.output, by_depth=by_depth)
    _emit(report, fmt, a.output, by_depth=by_depth)


def _interrupted(report: dict[str, Any], fmt: o.OutputFormat, output: Path | None, *, by_depth: bool):
    """Ctrl-C: write what was measured (the analysis, the --validate parts done, the depths), exit 130."""
    done = report.get("accuracy_by_depth") if by_depth else report.get("q90")
    if done:
        report["interrupted"] = True
        _emit(report, fmt, output, by_depth=by_depth)
        what = "interrupted: wrote what was measured before the Ctrl-C"
    else:
        what = "interrupted: nothing was measured yet"
    err_console.print(Text(what, style="yellow"), soft_wrap=True)
    raise typer.Exit(EXIT_INTERRUPTED)


def _emit(report: dict, fmt: o.OutputFormat, output: Path | None, *, by_depth: bool) -> None:
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.analysis.depth_report import render

    with friendly_errors():  # an unwritable -o (a full disk): one line, exit 2
        write_output(render(report, fmt, by_depth=by_depth), output, Console(highlight=False))
