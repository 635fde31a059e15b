"""`looptrace bench`: paired A/B serving benchmark, arms interleaved in one process (the paper's Table 2).

The run lives in `looptrace.drive.bench_run` (`prepare`, `measure`, `report_data`, `render_saved`), the
table, CSV and plot in `looptrace.drive.bench_report`; this module holds the options, the progress on
stderr and the mapping of errors to exit codes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from looptrace.build import DEFAULT_MODEL
from looptrace.cli import common as c
from looptrace.cli import options as o
from looptrace.cli.output import check_outputs, infer_format, write_output

EPILOG = """\
[bold]EXAMPLES[/]

  looptrace bench --cell ouro-tiny:64/16@1,8                   # base vs exactloop on CPU
  looptrace bench --a base --b base --b-set scheduler.max_num_seqs=1 --cell ouro-tiny:16/4@4
  looptrace bench --cell huginn-tiny:32/8@2 --runs 5 -o bench.json --plot speedup.svg
  looptrace bench --a base --b exactloop --cells table2 --output bench/results/h200/table2/table2_h200.json \\
      --plot bench/results/h200/table2/table2_h200.svg             # the paper's Table 2 (CUDA)

[bold]CELLS[/]  --cell [MODEL:]PROMPT/OUTPUT@C[,C...]: a burst of C requests at t=0 with PROMPT-token
random prompts and OUTPUT tokens each (greedy, ignore_eos); MODEL is a preset or a family (default
--model). --cells table2: the paper's rows on their real shapes (ouro-1.4b 512/128 @1,8,32,64, ouro-1.4b
2048/64 @8,32, huginn-0125 512/64 @1,8,32,64), CUDA only; the paper's numbers are printed beside them.
--cells table2:ouro or table2:huginn: one model's rows (each a shorter job).

[bold]METHOD[/]  Per cell, one engine per arm is built once (same weights and seed), then the arms run in
turn in this process: A, B, A, B, ... --runs times each. Each arm's first run is a dropped warm-up; mean
and spread (min-max, std) cover the rest. Round r gives both arms the same prompts (seed + r). B/A is the
ratio of the means; its range is that of the per-round ratios. Every arm gets scheduler.max_num_seqs=C
(the burst is admitted whole) and, with --prefill-batch whole (the default, as the paper's harness),
max_num_batched_tokens=C*PROMPT and prefill_chunk_size=PROMPT (the burst's prompts prefill as one batch;
--prefill-batch recipe keeps the recipe's 128-token chunks), unless --set/--a-set/--b-set say otherwise;
on CUDA the two arms split the
KV memory evenly (kv.num_blocks, equal bytes) unless an arm sets kv.num_blocks or
kv.gpu_memory_utilization.

[bold]OUTPUT[/]  Table, JSON (schema looptrace.bench/1: header, then per cell every run marked dropped or
kept, mean, spread and ratio) or CSV; -o FILE picks by suffix. --plot FILE (.svg, .png, .pdf) draws
speedup B/A vs C per model (needs matplotlib). Ctrl-C writes the completed cells and exits 130.
""" + c.EXIT_CODES_HELP.replace("missing", "missing (no CUDA for --device cuda, no matplotlib for --plot)")

SetList = list[str] | None


def _arm_opt(flag: str, arm: str):
    return o.opt(SetList, flag, help=f"Override a setting of arm {arm}: section.key=value (repeatable).")


AOpt = o.opt(str, "--a", help="Recipe of arm A (the baseline): name or YAML path.")
BOpt = o.opt(str, "--b", help="Recipe of arm B: name or YAML path.")
ASetsOpt, BSetsOpt = _arm_opt("--a-set", "A"), _arm_opt("--b-set", "B")
SetsOpt = o.opt(SetList, "--set", help="Override a setting of both arms (repeatable).")
ModelOpt = o.opt(
    str, "--model", "-m", parser=o.non_empty, help="Model of cells that name none (family or preset)."
)
CellsOpt = o.opt(
    str | None,
    "--cells",
    help="A named cell set: table2 (the paper's rows, CUDA), or table2:MODEL for one model's rows.",
    show_default=False,
)
CellOpt = o.opt(
    SetList,
    "--cell",
    help="[MODEL:]PROMPT/OUTPUT@C[,C...], e.g. ouro-tiny:16/4@2 (repeatable).",
    show_default=False,
)
RunsOpt = o.opt(int, help="Runs per arm and cell; the first of each arm is dropped.")
PlotOpt = o.opt(
    Path | None,
    parser=o.output_path,
    help="Write the speedup plot (B/A vs C per model) here: .svg, .png or .pdf.",
    show_default=False,
)
ProgressOpt = o.opt(bool, help="Show progress and per-cell lines on stderr.")
PrefillBatchOpt = o.opt(
    str,
    "--prefill-batch",
    help="whole: the burst's prompts prefill as one batch (token budget C x PROMPT, the paper's "
    "harness); recipe: the recipe's own budget (128-token chunks).",
)
FromOpt = o.opt(
    list[Path] | None,
    "--from",
    help="Run nothing: render saved `looptrace bench --format json` files (table, CSV, JSON, plot); "
    "repeat it to merge runs split across jobs into one table.",
    show_default=False,
)


def bench(
    a: AOpt = "base",
    b: BOpt = "exactloop",
    a_sets: ASetsOpt = None,
    b_sets: BSetsOpt = None,
    sets: SetsOpt = None,
    model: ModelOpt = DEFAULT_MODEL,
    cells: CellsOpt = None,
    cell: CellOpt = None,
    runs: RunsOpt = 3,
    device: o.DeviceOpt = "auto",
    dtype: o.DtypeOpt = "auto",
    seed: o.SeedOpt = 0,
    threads: o.ThreadsOpt = 1,
    random_weights: o.RandomWeightsOpt = False,
    fmt: o.FormatOpt = None,
    output: o.OutputOpt = None,
    plot: PlotOpt = None,
    progress: ProgressOpt = True,
    prefill_batch: PrefillBatchOpt = "whole",
    from_json: FromOpt = None,
) -> None:
    """Paired benchmark of two recipes: arms interleaved in one process, first run dropped, mean and
    spread of the rest, B/A per cell; table/JSON/CSV and a speedup plot."""
    if from_json:
        given = [flag for flag, value in (("--cell", cell), ("--cells", cells)) if value]
        if given:  # --from runs nothing: a cell given with it would be silently ignored
            raise c.fail(f"--from renders saved reports and runs nothing: leave out {' and '.join(given)}")
        _render_saved(from_json, infer_format(fmt, output), output, plot)
        return
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.drive.bench_run import BenchRequest

    with c.interrupt_exit():
        _bench(BenchRequest(**c.fields_of(BenchRequest, locals())), infer_format(fmt, output), progress)


def _bench(req, fmt: o.OutputFormat, progress: bool) -> None:
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.drive import bench_run

    with _errors():
        plan = bench_run.prepare(req)
    for text in plan.notes:
        c.note(text)
    got = _measure(plan, progress)
    done, interrupted = got.done, got.interrupted
    failure = {"cell": got.failed_cell, "error": got.error} if got.failed_cell else None
    stop = (
        "interrupted" if interrupted else (f"cell {got.failed_cell} failed: {got.error}" if failure else "")
    )
    if stop and not done:
        c.err_console.print(
            f"[yellow]{escape(stop)}[/]; no cell completed; nothing written", highlight=False, soft_wrap=True
        )
        raise typer.Exit(c.EXIT_INTERRUPTED if interrupted else c.EXIT_CHECK_FAILED)
    if stop:
        c.err_console.print(
            f"[yellow]{escape(stop)}[/]: writing the {len(done)} completed cell(s) of {len(plan.cells)}",
            highlight=False,
            soft_wrap=True,
        )
    data = bench_run.report_data(plan, done, interrupted, failure)
    _write(data, fmt, req.output, req.plot)
    if stop:
        raise typer.Exit(c.EXIT_INTERRUPTED if interrupted else c.EXIT_CHECK_FAILED)


def _measure(plan, show: bool):
    """`bench_run.measure` under a transient progress bar, a line per completed cell on stderr."""
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.drive import bench_run
    from looptrace.drive.bench_report import cell_line

    columns = (
        TextColumn("[bold]bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("runs  {task.description}"),
        TimeElapsedColumn(),
    )
    bar = Progress(*columns, console=c.err_console, transient=True, disable=not show)
    task = bar.add_task("building engines", total=len(plan.cells) * plan.runs * 2)

    def on_run(cell, rnd: int, arm: str, metrics) -> None:
        if metrics is None:
            what = "warm-up" if rnd == 0 else f"round {rnd}"
            bar.update(task, description=f"{cell.label}  arm {arm.upper()}  {what}")
        else:
            bar.advance(task)

    def on_cell(result) -> None:
        if show:
            c.err_console.print(cell_line(result), highlight=False)
        bar.update(task, description="building engines")

    backend = bench_run.EngineBackend(plan)
    with bar, _errors():  # an error's line is printed under the bar, as the runs' lines
        return bench_run.measure(plan, on_run, on_cell, backend=backend)


def _render_saved(paths: list[Path], fmt: o.OutputFormat, output: Path | None, plot: Path | None) -> None:
    """`--from FILE...`: committed JSON of earlier runs, merged and rendered again (nothing is measured)."""
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.drive.bench_report import check_plot
    from looptrace.drive.bench_run import render_saved

    with _errors():
        check_outputs((output, "--output"), (plot, "--plot"), inputs=[(p, "--from") for p in paths])
        if plot is not None:
            check_plot(plot)
        data, _ = render_saved(paths, fmt)
    _write(data, fmt, output, plot)


def _write(data: dict, fmt: o.OutputFormat, output: Path | None, plot: Path | None) -> None:
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.drive.bench_report import render, write_plot

    with c.friendly_errors():
        if plot is not None:
            write_plot(data, plot)
        table = lambda: render(data, "table")  # what the terminal shows when -o gets JSON or CSV
        write_output(render(data, fmt), output, Console(width=160), fmt, table)


@contextmanager
def _errors() -> Iterator[None]:
    """The bench's input errors (`BenchInputError`) and the engine's: one line, exit 2; a missing
    matplotlib for --plot or device: exit 3."""
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.drive.bench_report import PlotUnavailableError
    from looptrace.drive.paired import BenchInputError

    with c.friendly_errors():
        try:
            yield
        except BenchInputError as exc:
            raise c.fail(str(exc)) from None
        except PlotUnavailableError as exc:
            raise c.fail(str(exc), c.EXIT_NO_ENV) from None
