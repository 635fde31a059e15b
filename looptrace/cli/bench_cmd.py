"""`looptrace bench`: paired A/B serving benchmark, arms interleaved in one process (issue #8, Table 2).

The cells, schedule, statistics and ratios live in `looptrace.drive.paired`; this module builds the
engines, drives them and renders the report (table, JSON, CSV) and the speedup plot.
"""

from __future__ import annotations

import csv
import gc
import io
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from looptrace.build import (
    DEFAULT_MODEL,
    build_engine,
    check_seed,
    device_name,
    resolve_device,
    resolve_dtype,
    resolve_model,
    versions,
)
from looptrace.cli.common import (
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    EXIT_NO_ENV,
    UsageError,
    dumps,
    err_console,
    fail,
    friendly_errors,
    interrupt_exit,
    note,
)
from looptrace.cli.options import (
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    OutputFormat,
    OutputOpt,
    RandomWeightsOpt,
    SeedOpt,
    ThreadsOpt,
)
from looptrace.cli.output import infer_format, write_output

SCHEMA = "looptrace.bench/1"
TABLE2_SETS = ("cuda_graphs.max_graphs=64",)  # what `--cells table2` sets on both arms
PLOT_FORMATS = (".svg", ".png", ".pdf")

EPILOG = """\
[bold]EXAMPLES[/]

  looptrace bench --cell ouro-tiny:64/16@1,8                   # base vs exactloop on CPU
  looptrace bench --a base --b base --b-set scheduler.max_num_seqs=1 --cell ouro-tiny:16/4@4
  looptrace bench --cell huginn-tiny:32/8@2 --runs 5 -o bench.json --plot speedup.svg
  looptrace bench --a base --b exactloop --cells table2 --output bench/results/table2_h200.json \\
      --plot bench/results/table2_h200.svg                         # the paper's Table 2 (CUDA)

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
""" + EXIT_CODES_HELP.replace("missing", "missing (no CUDA for --device cuda, no matplotlib for --plot)")


def _arm_opt(flag: str, arm: str):
    return typer.Option(flag, help=f"Override a setting of arm {arm}: section.key=value (repeatable).")


SetList = list[str] | None


@dataclass
class Plan:
    cells: list  # list[paired.Cell], models resolved to presets
    runs: int
    recipes: dict[str, str]  # arm -> recipe name or path as given
    loaded: dict[str, Any]  # arm -> Recipe (with the user's overrides), for the header
    shared: list[str]
    arm_sets: dict[str, list[str]]
    device: Any  # torch.device
    dtype: Any
    seed: int
    threads: int
    random_weights: bool
    notes: list[str] = field(default_factory=list)
    prefill_batch: str = "whole"  # paired.cell_defaults: the burst's prompts in one prefill batch


def bench(
    a: Annotated[
        str, typer.Option("--a", help="Recipe of arm A (the baseline): name or YAML path.")
    ] = "base",
    b: Annotated[str, typer.Option("--b", help="Recipe of arm B: name or YAML path.")] = "exactloop",
    a_sets: Annotated[SetList, _arm_opt("--a-set", "A")] = None,
    b_sets: Annotated[SetList, _arm_opt("--b-set", "B")] = None,
    sets: Annotated[
        SetList, typer.Option("--set", help="Override a setting of both arms (repeatable).")
    ] = None,
    model: Annotated[
        str, typer.Option("--model", "-m", help="Model of cells that name none (family or preset).")
    ] = DEFAULT_MODEL,
    cells: Annotated[
        str | None,
        typer.Option(
            "--cells",
            help="A named cell set: table2 (the paper's rows, CUDA), or table2:MODEL for one model's rows.",
            show_default=False,
        ),
    ] = None,
    cell: Annotated[
        SetList,
        typer.Option(
            "--cell",
            help="[MODEL:]PROMPT/OUTPUT@C[,C...], e.g. ouro-tiny:16/4@2 (repeatable).",
            show_default=False,
        ),
    ] = None,
    runs: Annotated[int, typer.Option(help="Runs per arm and cell; the first of each arm is dropped.")] = 3,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
    random_weights: RandomWeightsOpt = False,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Write the speedup plot (B/A vs C per model) here: .svg, .png or .pdf.", show_default=False
        ),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show progress and per-cell lines on stderr.")] = True,
    prefill_batch: Annotated[
        str,
        typer.Option(
            "--prefill-batch",
            help="whole: the burst's prompts prefill as one batch (token budget C x PROMPT, the paper's "
            "harness); recipe: the recipe's own budget (128-token chunks).",
        ),
    ] = "whole",
    from_json: Annotated[
        list[Path] | None,
        typer.Option(
            "--from",
            help="Run nothing: render saved `looptrace bench --format json` files (table, CSV, JSON, plot); "
            "repeat it to merge runs split across jobs into one table.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Paired benchmark of two recipes: arms interleaved in one process, first run dropped, mean and
    spread of the rest, B/A per cell; table/JSON/CSV and a speedup plot."""
    if from_json:
        given = [flag for flag, value in (("--cell", cell), ("--cells", cells)) if value]
        if given:  # --from runs nothing: a cell given with it would be silently ignored
            raise fail(f"--from renders saved reports and runs nothing: leave out {' and '.join(given)}")
        _render_saved(from_json, fmt, output, plot)
        return
    with interrupt_exit():
        fmt = infer_format(fmt, output)
        with friendly_errors():
            plan = prepare(
                a,
                b,
                a_sets,
                b_sets,
                sets,
                model,
                cells,
                cell,
                runs,
                device,
                dtype,
                seed,
                threads,
                random_weights,
                output,
                plot,
                prefill_batch,
            )
        for text in plan.notes:
            note(text)
        done, interrupted = measure(plan, progress)
        if interrupted and not done:
            err_console.print("[yellow]interrupted:[/] no cell completed; nothing written")
            raise typer.Exit(EXIT_INTERRUPTED)
        if interrupted:
            err_console.print(
                f"[yellow]interrupted:[/] writing the {len(done)} completed cell(s) of {len(plan.cells)}"
            )
        data = report_data(plan, done, interrupted)
        text = render(data, fmt)
        with friendly_errors():
            if plot is not None:
                write_plot(data, plot)
            write_output(text, output, Console(width=160))
        if interrupted:
            raise typer.Exit(EXIT_INTERRUPTED)


# A saved report missing a key or holding a value of the wrong type fails while it is read or drawn.
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError)


def _render_saved(paths: list[Path], fmt, output, plot) -> None:
    """`--from FILE...`: committed JSON of earlier runs, merged and rendered again (nothing is measured)."""
    fmt = infer_format(fmt, output)
    with friendly_errors():
        from looptrace.cli.output import check_outputs

        check_outputs((output, "--output"), (plot, "--plot"), inputs=[(p, "--from") for p in paths])
        if plot is not None:
            _check_plot(plot)
        from looptrace.drive import paired

        reports = [_load_saved(p) for p in paths]
        try:
            data = paired.merge_reports(reports, [str(p) for p in paths])
            text = render(data, fmt)
        except paired.BenchInputError as exc:
            raise UsageError(f"--from {exc}") from None
        except _MALFORMED as exc:
            raise UsageError(f"--from {', '.join(map(str, paths))}: {_malformed(exc)}") from None
        if plot is not None:
            write_plot(data, plot)
        write_output(text, output, Console(width=160))


def _malformed(exc: Exception) -> str:
    what = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
    return f"not a complete `looptrace bench --format json` report ({what})"


def _check_saved(data: dict[str, Any], path: Path) -> None:
    """Every part the table and the CSV read is there (so the error names the file that lacks it)."""
    try:
        for arm in data["header"]["arms"].values():
            _arm_text(arm)
        _table(data)
        _csv(data)
    except _MALFORMED as exc:
        raise UsageError(f"--from {path}: {_malformed(exc)}") from None


def _load_saved(path: Path) -> dict[str, Any]:
    import json

    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--from {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--from {path}: not a JSON file ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("cells"), list):
        raise UsageError(f"--from {path}: expected a `looptrace bench --format json` file (schema {SCHEMA})")
    _check_saved(data, path)
    return data


# Preparation: everything that can be wrong is found before an engine is built ------------------------
def prepare(
    a,
    b,
    a_sets,
    b_sets,
    sets,
    model,
    cells,
    cell,
    runs,
    device,
    dtype,
    seed,
    threads,
    random_weights,
    output,
    plot,
    prefill_batch="whole",
) -> Plan:
    from looptrace.cli.output import check_outputs
    from looptrace.drive import paired
    from looptrace.engine.model_config import UnknownModelError, resolve_preset
    from looptrace.recipes import load_recipe

    check_seed(seed)
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    recipe_files = [(Path(r), flag) for r, flag in ((a, "--a"), (b, "--b")) if Path(r).is_file()]
    check_outputs((output, "--output"), (plot, "--plot"), inputs=recipe_files)
    if plot is not None:
        _check_plot(plot)
    try:
        paired.interleave(runs)  # --runs
        if cells is not None and cell:
            raise paired.BenchInputError("give either --cells NAME or --cell ..., not both")
        if cells is None and not cell:
            raise paired.BenchInputError(
                f"no cells: give --cell {paired.CELL_SYNTAX} (e.g. --cell {paired.CELL_EXAMPLE}) "
                "or --cells table2 (CUDA)"
            )
        wanted = paired.expand_cell_set(cells) if cells is not None else paired.parse_cells(cell, model)
    except paired.BenchInputError as exc:
        raise UsageError(str(exc)) from None
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if cells is not None and dev.type != "cuda":
        raise UsageError(
            f"--cells {cells} runs the paper's real shapes (ouro-1.4b, huginn-0125): hours on {dev.type}; "
            f"run it on CUDA, or here use --cell with a tiny preset, e.g. --cell ouro-tiny:64/16@1,8"
        )
    resolved = []
    for c in wanted:
        try:
            spec = resolve_preset(c.model, dev.type)
        except UnknownModelError as exc:
            raise UsageError(f"--cell {c.label}: {exc}") from None
        if c.prompt_len + c.output_len - 1 > spec.max_position:
            raise UsageError(
                f"--cell {c.label}: PROMPT + OUTPUT - 1 = {c.prompt_len + c.output_len - 1} positions "
                f"exceed {spec.name}'s {spec.max_position}"
            )
        resolved.append(paired.Cell(spec.name, c.prompt_len, c.output_len, c.concurrency))
    try:
        paired.check_unique(resolved)
    except paired.BenchInputError as exc:
        raise UsageError(str(exc)) from None
    # The paper's Table 2 ran both arms with 64 CUDA graphs (base-engine.md §10); --set still wins.
    shared = (list(TABLE2_SETS) if cells is not None else []) + list(sets or [])
    arm_sets = {"a": list(a_sets or []), "b": list(b_sets or [])}
    recipes = {"a": a, "b": b}
    loaded = {arm: load_recipe(recipes[arm], shared + arm_sets[arm]) for arm in paired.ARMS}
    notes = []
    if dev.type == "cpu":
        from looptrace.engine.model_config import FAMILY_PRESETS

        real = sorted({c.model for c in resolved} & {cuda for _, cuda in FAMILY_PRESETS.values()})
        if real:
            notes.append(f"real-shape preset(s) {', '.join(real)} on CPU: expect a long run")
    if prefill_batch not in paired.PREFILL_BATCHES:
        raise UsageError(
            f"--prefill-batch {prefill_batch!r}: expected one of {', '.join(paired.PREFILL_BATCHES)}"
        )
    for c in resolved:
        _check_cell_memory(c, recipes, shared, arm_sets, prefill_batch, dev, dt)
    return Plan(
        resolved,
        runs,
        recipes,
        loaded,
        shared,
        arm_sets,
        dev,
        dt,
        seed,
        threads,
        random_weights,
        notes,
        prefill_batch,
    )


def _check_cell_memory(cell, recipes, shared, arm_sets, prefill_batch, dev, dt) -> None:
    """Before any engine: C within the settings' range, and each arm's engine plus the burst's prompts
    within the memory the device has (a one-line error naming the cell, not a MemoryError mid-run)."""
    from looptrace.build import check_engine_memory
    from looptrace.drive.paired import ARMS, arm_overrides
    from looptrace.engine.budget import check_memory, workload_needs
    from looptrace.engine.config import COUNT_MAX
    from looptrace.engine.model_config import PRESETS
    from looptrace.recipes import load_recipe

    if cell.concurrency * max(cell.prompt_len, 1) > COUNT_MAX:
        raise UsageError(
            f"--cell {cell.label}: C x PROMPT = {cell.concurrency * cell.prompt_len} tokens in one burst; "
            f"expected at most {COUNT_MAX}"
        )
    where = f"--cell {cell.label}"
    check_memory(workload_needs(cell.concurrency, cell.prompt_len, "C"), dev, context=where)
    for arm in ARMS:
        sets = arm_overrides(cell, shared, arm_sets[arm], (), prefill_batch)
        config = load_recipe(recipes[arm], sets).config
        check_engine_memory(PRESETS[cell.model], config, dev, dt, context=f"{where}, arm {arm.upper()}")


def _check_plot(plot: Path) -> None:
    if plot.suffix.lower() not in PLOT_FORMATS:
        raise UsageError(
            f"--plot {plot}: expected a {', '.join(PLOT_FORMATS)} file (the suffix picks the format)"
        )
    try:
        import matplotlib  # noqa: F401  (only checked here; drawn after the runs)
    except ImportError:
        raise fail(
            "--plot needs matplotlib: pip install 'looptrace[plot]' (or matplotlib), or leave --plot out",
            EXIT_NO_ENV,
        ) from None


# The engine side of the paired run -------------------------------------------------------------------
@dataclass
class _Arm:
    engine: Any
    recipe: Any
    overrides: list[str]
    weights: Any


class EngineBackend:
    """`paired.PairedBackend` on real LLMEngines (built through `looptrace.build.build_engine`)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._auto: dict[str, list[str]] = {}

    def build(self, cell, arm: str) -> _Arm:
        from looptrace.drive.paired import arm_overrides

        p = self.plan
        if arm == "a":  # before the cell's first engine: its memory split is measured on a free GPU
            self._auto = self._pool_sets(cell)
        sets = arm_overrides(cell, p.shared, p.arm_sets[arm], self._auto.get(arm, []), p.prefill_batch)
        with friendly_errors():
            setup = build_engine(
                resolve_model(cell.model, p.device, None, random_weights=p.random_weights),
                recipe=p.recipes[arm],
                sets=sets,
                device=p.device,
                dtype=str(p.dtype).replace("torch.", ""),
                seed=p.seed,
                threads=p.threads,
                max_model_len=cell.prompt_len + cell.output_len,
            )
        need = cell.prompt_len + cell.output_len - 1
        if need > setup.engine.max_model_len:
            del setup
            raise fail(
                f"--cell {cell.label}: arm {arm.upper()} holds at most {need - 1} positions per request "
                f"(max_model_len), the cell needs {need}"
            )
        return _Arm(setup.engine, setup.recipe, sets, setup.weights)

    def _pool_sets(self, cell) -> dict[str, list[str]]:
        """CUDA: equal KV bytes per arm as kv.num_blocks (see paired.kv_bytes_per_arm), unless the arm's
        own settings size its pool."""
        p = self.plan
        if p.device.type != "cuda":
            return {}
        import torch

        from looptrace.drive.paired import ARMS, arm_overrides, kv_bytes_per_arm, sets_key
        from looptrace.engine.budget import pool_geometry
        from looptrace.engine.model_config import PRESETS
        from looptrace.engine.weights import create_model
        from looptrace.recipes import load_recipe

        spec = PRESETS[cell.model]
        meta = create_model(spec, torch.device("meta"), p.dtype)  # shapes only: no memory
        weight_bytes = sum(t.numel() * t.element_size() for t in meta.parameters())
        del meta
        user = {arm: p.shared + p.arm_sets[arm] for arm in ARMS}
        sized = [
            arm
            for arm in ARMS
            if not (sets_key(user[arm], "kv.num_blocks") or sets_key(user[arm], "kv.gpu_memory_utilization"))
        ]
        if not sized:
            return {}
        cfgs = {
            arm: load_recipe(p.recipes[arm], arm_overrides(cell, [], user[arm], (), p.prefill_batch)).config
            for arm in ARMS
        }
        free, total = torch.cuda.mem_get_info(p.device)
        util = min(cfgs[arm].kv.gpu_memory_utilization for arm in ARMS)
        per_arm = kv_bytes_per_arm(free, total, util, len(ARMS) * weight_bytes)
        out = {}
        for arm in sized:
            geo = pool_geometry(spec, cfgs[arm], p.dtype.itemsize)
            blocks = geo.blocks_for_bytes(per_arm)
            if blocks < geo.blocks_per_page:
                raise fail(
                    f"--cell {cell.label}: two engines' weights leave no KV memory for arm {arm.upper()} "
                    f"({free / 2**30:.1f} GiB free); size the pools with --set kv.num_blocks=N"
                )
            out[arm] = [f"kv.num_blocks={blocks}"]
        return out

    def describe(self, handle: _Arm) -> dict[str, Any]:
        e = handle.engine
        kv = e.kv_summary()
        return {
            "recipe": handle.recipe.name,
            "overrides": handle.overrides,
            "preset": e.spec.name,
            "weights": str(handle.weights) if handle.weights else "random (seeded)",
            "loops": e.max_loops,
            "max_num_seqs": e.cfg.scheduler.max_num_seqs,
            "checked_rungs": dict(e.checked_rungs),
            "kv": {
                k: kv[k] for k in ("layout", "num_blocks", "capacity_tokens", "pool_bytes", "max_model_len")
            },
        }

    def run(self, handle: _Arm, cell, arm: str, round: int) -> dict[str, Any]:
        from looptrace.drive.benchmark import run_workload
        from looptrace.drive.metrics import summarize
        from looptrace.drive.workloads import BurstWorkload
        from looptrace.engine.request import SamplingParams

        e = handle.engine
        wl = BurstWorkload(
            concurrency=cell.concurrency,
            prompt_len=cell.prompt_len,
            max_tokens=cell.output_len,
            seed=self.plan.seed + round,
            vocab_size=e.spec.vocab_size,
        )
        before = _graph_totals(e)
        record = run_workload(e, wl, params=SamplingParams(temperature=0.0, ignore_eos=True))
        if record.interrupted:
            raise KeyboardInterrupt
        m = summarize(record)
        after = _graph_totals(e)
        return {
            "output_tok_s": m.output_throughput,
            "ttft_p50_ms": m.ttft.median,
            "tpot_p50_ms": m.tpot.median,
            "duration_s": m.duration,
            "completed": m.completed,
            "failed": m.failed,
            "output_tokens": m.total_output_tokens,
            "steps_per_output_token": m.steps_per_output_token,
            "peak_kv_usage": m.peak_kv_usage,
            **{f"graph_{k}": after[k] - before[k] for k in ("captures", "replays", "fallbacks")},
            # which graph fell back and why (e.g. `prefill/oversized_batch`: a whole-burst prefill step has
            # more rows than cuda_graphs.max_batch_size and runs eagerly, as the paper's prefill always does)
            "graph_fallback_reasons": {
                k: n - before["reasons"].get(k, 0)
                for k, n in after["reasons"].items()
                if n != before["reasons"].get(k, 0)
            },
        }

    def release(self) -> None:
        gc.collect()
        if self.plan.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()


def _graph_totals(engine) -> dict[str, Any]:
    """Captures, replays and fallbacks over every graph cache, and fallbacks by `graph/reason`."""
    totals: dict[str, Any] = {"captures": 0, "replays": 0, "fallbacks": 0, "reasons": {}}
    for name, counters in engine.graph_counters().items():
        for k in ("captures", "replays", "fallbacks"):
            totals[k] += counters.get(k, 0)
        for reason, n in counters.get("fallback_reasons", {}).items():
            totals["reasons"][f"{name}/{reason}"] = n
    return totals


def measure(plan: Plan, show: bool) -> tuple[list, bool]:
    """Run every cell; (completed cells, interrupted)."""
    from looptrace.drive.paired import run_paired

    done: list = []
    total = len(plan.cells) * plan.runs * 2
    columns = (
        TextColumn("[bold]bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("runs  {task.description}"),
        TimeElapsedColumn(),
    )
    bar = Progress(*columns, console=err_console, transient=True, disable=not show)
    task = bar.add_task("building engines", total=total)

    def on_run(cell, rnd: int, arm: str, metrics) -> None:
        if metrics is None:
            what = "warm-up" if rnd == 0 else f"round {rnd}"
            bar.update(task, description=f"{cell.label}  arm {arm.upper()}  {what}")
        else:
            bar.advance(task)

    backend = EngineBackend(plan)
    try:
        with bar:
            for result in run_paired(plan.cells, plan.runs, backend, on_run):
                done.append(result)
                if show:
                    err_console.print(_cell_line(result), highlight=False)
                bar.update(task, description="building engines")
    except KeyboardInterrupt:
        return done, True
    return done, False


def _cell_line(result) -> str:
    st, ratio = result.stats(), result.ratios()["output_tok_s"]
    a, b = st["a"]["output_tok_s"].mean, st["b"]["output_tok_s"].mean
    return f"{result.cell.label}: A {a:.1f} tok/s, B {b:.1f} tok/s, B/A {_num(ratio['mean'], 2)}"


# Report -------------------------------------------------------------------------------------------------
def report_data(plan: Plan, done: list, interrupted: bool) -> dict[str, Any]:
    from looptrace.drive.paired import DROPPED_ROUNDS

    arms = {
        arm: {
            "recipe": rec.name,
            "recipe_arg": plan.recipes[arm],
            "source": rec.source,
            "description": rec.description,
            "overrides": rec.overrides,
        }
        for arm, rec in plan.loaded.items()
    }
    header = {
        "tool": "looptrace bench",
        "command": " ".join(["looptrace", *sys.argv[1:]]),
        "versions": versions(),
        "device": device_name(plan.device),
        "dtype": str(plan.dtype).replace("torch.", ""),
        "models": sorted({c.model for c in plan.cells}),
        "arms": arms,
        "shared_overrides": plan.shared,
        "seed": plan.seed,
        "runs": plan.runs,
        "dropped_runs_per_arm": DROPPED_ROUNDS,
        "order": "interleaved in one process, one round at a time: A, B, A, B, ...",
        "workload": "burst: C requests at t=0, PROMPT random token ids (seed + round, the same for both "
        "arms), OUTPUT tokens each, greedy, ignore_eos",
        "cell_defaults": ["scheduler.max_num_seqs=C"]
        + (
            ["scheduler.max_num_batched_tokens=max(128, C*PROMPT)", "scheduler.prefill_chunk_size=PROMPT"]
            if plan.prefill_batch == "whole"
            else []
        )
        + (["kv.num_blocks: equal KV bytes per arm (CUDA)"] if plan.device.type == "cuda" else []),
        "cells_planned": [c.label for c in plan.cells],
        "interrupted": interrupted,
    }
    return {"schema": SCHEMA, "header": header, "cells": [_finite(r.to_dict()) for r in done]}


def _finite(obj):
    """NaN/inf -> None, so the JSON is strict (an empty sample has no mean)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def render(data: dict[str, Any], fmt: OutputFormat) -> str:
    if fmt == OutputFormat.json:
        return dumps(data)
    if fmt == OutputFormat.csv:
        return _csv(data)
    console = Console(width=160, record=True, file=io.StringIO(), force_terminal=False)
    console.print(Group(*_table(data)))
    return console.export_text().rstrip()


def _num(value, digits: int = 1) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and not math.isfinite(value))
        else f"{value:.{digits}f}"
    )


def _spread(s: dict, digits: int = 1) -> str:
    sp = s["spread"]
    return f"{_num(s['mean'], digits)} [{_num(sp['min'], digits)}-{_num(sp['max'], digits)}]"


def _arm_text(arm: dict) -> str:
    return arm["recipe"] + (f" + {', '.join(arm['overrides'])}" if arm["overrides"] else "")


def _table(data: dict[str, Any]) -> list:
    from rich.markup import escape

    h = data["header"]
    kept = h["runs"] - h["dropped_runs_per_arm"]
    arm_a, arm_b = (escape(_arm_text(h["arms"][arm])) for arm in ("a", "b"))
    head = (
        f"A = [bold]{arm_a}[/]   B = [bold]{arm_b}[/]\n"
        f"device {escape(h['device'])}  dtype {h['dtype']}  looptrace {h['versions']['looptrace']}  "
        f"torch {h['versions']['torch']}\n"
        f"{h['runs']} runs per arm, interleaved A,B; each arm's first run dropped; "
        f"{escape('mean [min-max]')} of the other {kept}\n"
        + "\n".join(f"[dim]{escape(cmd)}[/]" for cmd in h.get("commands", [h["command"]]))
    )
    out: list = [Panel(head, title="looptrace bench", expand=False)]
    if h["interrupted"]:
        out.append(
            f"[bold yellow]INTERRUPTED[/]: {len(data['cells'])} of {len(h['cells_planned'])} cells completed"
        )
    refs = any(c["reference"] for c in data["cells"])
    title = "Output throughput (tok/s), TTFT p50 and TPOT p50 (ms)" + (
        "; [dim]paper[/]: Table 2, base / ExactLoop on a GH200" if refs else ""
    )
    t = Table(title=title, title_justify="left")
    for col in ("cell", "A tok/s", "B tok/s", escape("B/A [per round]"), "TTFT A / B", "TPOT A / B"):
        t.add_column(col, justify="left" if col == "cell" else "right")
    for c in data["cells"]:
        sa, sb, r = c["stats"]["a"], c["stats"]["b"], c["ratio"]["output_tok_s"]
        row = [
            c["cell"],
            _spread(sa["output_tok_s"]),
            _spread(sb["output_tok_s"]),
            f"{_num(r['mean'], 2)} [{_num(r['min'], 2)}-{_num(r['max'], 2)}]",
            f"{_num(sa['ttft_p50_ms']['mean'])} / {_num(sb['ttft_p50_ms']['mean'])}",
            f"{_num(sa['tpot_p50_ms']['mean'], 2)} / {_num(sb['tpot_p50_ms']['mean'], 2)}",
        ]
        ref = c["reference"]
        if ref:  # the paper's number under the measured one, same units
            tok, ttft, tpot = ref["output_tok_s"], ref["ttft_p50_ms"], ref["tpot_p50_ms"]
            paper = [
                "",
                f"{tok['a']:.1f}",
                f"{tok['b']:.1f}",
                f"{tok['ratio']:.2f}",
                f"{ttft['a']:.1f} / {ttft['b']:.1f}",
                f"{tpot['a']:.2f} / {tpot['b']:.2f}",
            ]
            row = [m if not p else f"{m}\n[dim]paper {p}[/]" for m, p in zip(row, paper)]
        t.add_row(*row)
    out.append(t)
    failed = [c["cell"] for c in data["cells"] if any(run.get("failed") for run in c["runs"])]
    if failed:
        out.append(f"[bold red]failed requests[/] in {', '.join(failed)} (see the JSON runs)")
    return out


CSV_COLUMNS = (
    "cell", "model", "prompt_len", "output_len", "concurrency", "metric",
    "a_mean", "a_min", "a_max", "a_std", "b_mean", "b_min", "b_max", "b_std",
    "ratio", "ratio_min", "ratio_max", "kept_runs", "paper_a", "paper_b", "paper_ratio",
)  # fmt: skip


def _csv(data: dict[str, Any]) -> str:
    from looptrace.drive.paired import METRIC_NAMES

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for c in data["cells"]:
        for name in METRIC_NAMES:
            a, b, r = c["stats"]["a"][name], c["stats"]["b"][name], c["ratio"][name]
            ref = (c["reference"] or {}).get(name, {})
            writer.writerow([
                c["cell"], c["model"], c["prompt_len"], c["output_len"], c["concurrency"], name,
                a["mean"], a["spread"]["min"], a["spread"]["max"], a["spread"]["std"],
                b["mean"], b["spread"]["min"], b["spread"]["max"], b["spread"]["std"],
                r["mean"], r["min"], r["max"], a["n"],
                ref.get("a", ""), ref.get("b", ""), ref.get("ratio", ""),
            ])  # fmt: skip
    return buf.getvalue().rstrip()


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# Plot ---------------------------------------------------------------------------------------------------
def write_plot(data: dict[str, Any], path: Path) -> None:
    """Speedup B/A (output tok/s) vs C, one series per model and shape; the paper's ratios, where a cell
    has one, as hollow markers on a dashed line. matplotlib (not plotext, which draws only in the
    terminal): the file is a figure for the committed results. Figure() draws without pyplot's global
    state or a GUI backend."""
    from matplotlib.figure import Figure

    from looptrace.cli.output import atomic_path

    h = data["header"]
    series: dict[str, list[dict]] = {}
    for c in data["cells"]:
        series.setdefault(f"{c['model']} {c['prompt_len']}/{c['output_len']}", []).append(c)
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    ax.axhline(1.0, color="0.6", linewidth=0.8)
    xs_all: set[int] = set()
    for i, (name, cs) in enumerate(series.items()):
        cs = sorted(cs, key=lambda c: c["concurrency"])
        color = f"C{i % 10}"
        pts = [
            (c["concurrency"], c["ratio"]["output_tok_s"]) for c in cs if c["ratio"]["output_tok_s"]["mean"]
        ]
        if pts:
            xs = [x for x, _ in pts]
            ys = [r["mean"] for _, r in pts]
            lo = [max(0.0, y - (r["min"] if r["min"] is not None else y)) for y, (_, r) in zip(ys, pts)]
            hi = [max(0.0, (r["max"] if r["max"] is not None else y) - y) for y, (_, r) in zip(ys, pts)]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", color=color, capsize=3, label=f"{name} measured")
            xs_all.update(xs)
        refs = [(c["concurrency"], c["reference"]["output_tok_s"]["ratio"]) for c in cs if c["reference"]]
        if refs:
            ax.plot(
                *zip(*refs),
                linestyle="--",
                marker="o",
                markerfacecolor="none",
                color=color,
                label=f"{name} paper (GH200)",
            )
            xs_all.update(x for x, _ in refs)
    ax.set_xscale("log", base=2)
    if xs_all:
        ax.set_xticks(sorted(xs_all), [str(x) for x in sorted(xs_all)])
    ax.set_xlabel("concurrent requests C")
    ax.set_ylabel("speedup B/A (output tok/s)")
    arms = [_shorten(f"{arm.upper()} = {_arm_text(h['arms'][arm])}", 60) for arm in ("b", "a")]
    ax.set_title(f"{arms[0]}  vs  {arms[1]}\n{h['device']}", fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fmt = path.suffix.lower().lstrip(".")
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt)  # reproducible files
    with atomic_path(path, "--plot") as tmp:
        fig.savefig(tmp, format=fmt, metadata=metadata)
