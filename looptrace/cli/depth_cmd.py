"""`looptrace depth`: LoopDuet state-distance analysis, the (S, P) recommendation, R_layer and Amdahl.

Thin: the experiment lives in looptrace.analysis.depth_run, its text in looptrace.analysis.depth_report.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from looptrace.cli.common import EXIT_INTERRUPTED, UsageError, dumps, err_console, fail, friendly_errors
from looptrace.cli.options import (
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    OutputFormat,
    OutputOpt,
    RandomWeightsOpt,
    RecipeOpt,
    SeedOpt,
    SetOpt,
    ThreadsOpt,
    WeightsOpt,
)
from looptrace.cli.output import check_output_path, command_inputs, infer_format, write_output

EPILOG = """
[bold]EXAMPLES[/bold]

  looptrace depth --model huginn                       # built-in eval set, S_ref = the model's loops
  looptrace depth --model huginn --s-ref 16 --tau 0.24 --format json -o depth.json
  looptrace depth --model huginn --accuracy-by-depth 1,2,4,8,16 --limit 500

[bold]EXIT CODES[/bold]  0 ok · 2 bad input (tau outside (0, 1), P > S, prompts without 'prompt'/'answer')
"""

DepthListOpt = Annotated[
    str | None,
    typer.Option(
        "--accuracy-by-depth",
        help="Comma-separated loop counts: report exact-match accuracy at each depth (no analysis).",
        show_default=False,
    ),
]


def _loops_max() -> int:
    from looptrace.engine.config import LOOPS_MAX

    return LOOPS_MAX


def _depths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--accuracy-by-depth '{text}': expected comma-separated integers") from None
    if not out or min(out) < 1 or max(out) > _loops_max():
        raise UsageError(f"--accuracy-by-depth '{text}': expected loop counts from 1 to {_loops_max()}")
    return out


def _check_loops(**options: int | None) -> None:
    """--s-ref / --s / --p are loop counts: named in the error, not as the exit.* setting they become."""
    for name, value in options.items():
        if value is not None and not 1 <= value <= _loops_max():
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {value}: expected a loop count from 1 to {_loops_max()}")


class _Phases:
    """Rich progress on stderr (drawn only on a terminal): the phase running, phases done, elapsed time."""

    def __init__(self, show: bool) -> None:
        self.bar = None
        if show:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=err_console,
                transient=True,
            )
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


DepthModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="Family or preset (huginn -> huginn-tiny on CPU).")
]
PromptsOpt = Annotated[
    Path | None,
    typer.Option(help='JSONL of {"prompt": ..., "answer": ...}; default: the built-in evaluation set.'),
]
SRefOpt = Annotated[int | None, typer.Option("--s-ref", help="Reference depth (default: the model's loops).")]
SOpt = Annotated[
    int | None, typer.Option("--s", help="Decoding depth S of the recommendation (default S_ref).")
]
POpt = Annotated[
    int | None, typer.Option("--p", help="Report R_layer / Amdahl at this P (default: recommended).")
]
TauOpt = Annotated[float, typer.Option(help="Prompt-token q90 threshold, in (0, 1).")]
LimitOpt = Annotated[int, typer.Option(help="Use the first N prompts (0 = all).")]
UseGeneratedOpt = Annotated[
    bool, typer.Option("--use-generated", help="Replay the generated answers even where 'answer' is given.")
]
ValidateOpt = Annotated[
    bool,
    typer.Option(
        "--validate",
        help="Serve (S, S) and (S, P) (kv.layout=shared): throughput ratio vs R_layer, TTFT, token "
        "agreement, eval accuracy with paired SE; plus a Poisson+burst run of the queue-age controller.",
    ),
]
ValPromptLenOpt = Annotated[int, typer.Option(help="--validate: prompt tokens of the throughput workload.")]
ValAnswerLenOpt = Annotated[int, typer.Option(help="--validate: output tokens per request.")]
ValRequestsOpt = Annotated[int, typer.Option(help="--validate: requests in the throughput burst.")]
RepeatsOpt = Annotated[int, typer.Option(help="--validate: timed runs per depth (best kept).")]
ProgressOpt = Annotated[bool, typer.Option(help="Show progress on stderr (when it is a terminal).")]


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
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    recipe: RecipeOpt = "base",
    sets: SetOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = None,
    random_weights: RandomWeightsOpt = False,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
    progress: ProgressOpt = True,
) -> None:
    """State distance per loop (q90 by token role), recommended (S, P), R_layer (Eq. 3), Amdahl (Eq. 4)."""
    _depth(_DepthArgs(**locals()))  # every option, by name (the dataclass lists the same fields)


@dataclass(frozen=True)
class _DepthArgs:
    model: str
    prompts: Path | None
    s_ref: int | None
    s: int | None
    p: int | None
    tau: float
    limit: int
    use_generated: bool
    accuracy_by_depth: str | None
    validate: bool
    val_prompt_len: int
    val_answer_len: int
    val_requests: int
    repeats: int
    fmt: OutputFormat | None
    output: Path | None
    recipe: str
    sets: list[str] | None
    device: str
    dtype: str
    weights: Path | None
    random_weights: bool
    seed: int
    threads: int
    progress: bool


def _depth(a: _DepthArgs) -> None:
    from looptrace.analysis import depth_run as R

    fmt = infer_format(a.fmt, a.output)
    by_depth = a.accuracy_by_depth is not None
    report: dict[str, Any] = {}  # filled as the work goes: a Ctrl-C writes what was measured
    try:
        with friendly_errors(), _depth_errors(), _Phases(a.progress and err_console.is_terminal) as phases:
            _check_options(a)
            items = R.load_items(a.prompts, a.limit, need_answer=by_depth)
            engines = _engines(a)
            if by_depth:
                depths = _depths(a.accuracy_by_depth)
                R.check_memory(engines, depths, "--accuracy-by-depth", items)
                R.run_accuracy(engines, items, depths, report, phases)
            else:
                R.check_memory(engines, [a.s_ref] if a.s_ref else [], "--s-ref", items)
                R.run_depth(_request(a, engines, items), report, phases)
    except KeyboardInterrupt:
        _interrupted(report, fmt, a.output, by_depth=by_depth)
    _emit(report, fmt, a.output, by_depth=by_depth)


@contextmanager
def _depth_errors() -> Iterator[None]:
    """The analysis' and the evaluation set's input errors: one line, exit code 2."""
    from looptrace.analysis.depth import DepthInputError
    from looptrace.train.evaluate import EvalSetError

    try:
        yield
    except (DepthInputError, EvalSetError) as exc:
        raise fail(str(exc)) from None


def _check_options(a: _DepthArgs) -> None:
    from looptrace.analysis.depth import check_tau

    check_tau(a.tau)
    _check_loops(s_ref=a.s_ref, s=a.s, p=a.p)
    check_output_path(a.output, inputs=command_inputs(a.prompts, a.recipe, a.weights))
    if a.limit < 0:
        raise UsageError(f"--limit must be >= 0, got {a.limit}")
    if min(a.val_prompt_len, a.val_answer_len, a.val_requests, a.repeats) < 1:
        raise UsageError("--val-prompt-len, --val-answer-len, --val-requests and --repeats must be >= 1")


def _engines(a: _DepthArgs):
    from looptrace.analysis.depth_run import DepthEngines
    from looptrace.build import resolve_model

    model = resolve_model(a.model, a.device, a.weights, random_weights=a.random_weights)
    return DepthEngines(model, a.recipe, tuple(a.sets or ()), a.device, a.dtype, a.seed, a.threads)


def _request(a: _DepthArgs, engines, items):
    from looptrace.analysis.depth_run import DepthRequest, ValidateShape

    shape = ValidateShape(a.val_prompt_len, a.val_answer_len, a.val_requests, a.repeats)
    return DepthRequest(
        engines, items, a.s_ref, a.s, a.p, a.tau, a.use_generated, shape if a.validate else None
    )


def _interrupted(report: dict[str, Any], fmt: OutputFormat, output: Path | None, *, by_depth: bool):
    """Ctrl-C: write what was measured (the analysis, the --validate parts done, the depths), exit 130."""
    from rich.text import Text

    done = report.get("accuracy_by_depth") if by_depth else report.get("q90")
    if done:
        report["interrupted"] = True
        _emit(report, fmt, output, by_depth=by_depth)
        what = "interrupted: wrote what was measured before the Ctrl-C"
    else:
        what = "interrupted: nothing was measured yet"
    err_console.print(Text(what, style="yellow"), soft_wrap=True)
    raise typer.Exit(EXIT_INTERRUPTED)


def _emit(report: dict, fmt: OutputFormat, output: Path | None, *, by_depth: bool) -> None:
    from looptrace.analysis import depth_report as text

    if fmt == OutputFormat.json:
        out = dumps(report)
    elif fmt == OutputFormat.csv:
        out = text.accuracy_csv(report) if by_depth else text.q90_csv(report)
    else:
        out = text.accuracy_text(report) if by_depth else text.analysis_text(report)
    write_output(out, output, Console(highlight=False))
