"""One `looptrace bench`, start to end: check the request and plan the cells (`prepare`), build both arms'
engines per cell and run them interleaved (`measure`, through `EngineBackend`), and return the report data
(`report_data`); `load_saved` reads saved reports back for `--from`.

The cells, schedule, statistics and ratios live in `looptrace.drive.paired`, the rendering in
`looptrace.drive.bench_report`. No CLI here: input errors are `paired.BenchInputError` (the CLI: exit 2).
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looptrace.build import (
    DEFAULT_MODEL,
    BuildRequest,
    build,
    check_engine_memory,
    check_seed,
    device_name,
    resolve_device,
    resolve_dtype,
    versions,
)
from looptrace.drive import paired
from looptrace.drive.bench_report import arm_text, check_plot, csv_text, render, table
from looptrace.drive.paired import ARMS, BenchInputError
from looptrace.engine.budget import check_memory, pool_geometry, workload_needs
from looptrace.engine.config import COUNT_MAX
from looptrace.engine.model_config import FAMILY_PRESETS, PRESETS, UnknownModelError, resolve_preset
from looptrace.engine.request import SamplingParams
from looptrace.input_files import InputError, read_json, recipe_file
from looptrace.output_files import check_outputs
from looptrace.recipes import load_recipe

SCHEMA = "looptrace.bench/1"
TABLE2_SETS = ("cuda_graphs.max_graphs=64",)  # what `--cells table2` sets on both arms


@dataclass(frozen=True)
class BenchRequest:
    """What `looptrace bench` was asked (the CLI's options)."""

    a: str = "base"  # recipe of arm A: name or YAML path
    b: str = "exactloop"
    a_sets: list[str] | None = None
    b_sets: list[str] | None = None
    sets: list[str] | None = None  # both arms
    model: str = DEFAULT_MODEL  # of cells that name none
    cells: str | None = None  # a named cell set (table2, table2:MODEL)
    cell: list[str] | None = None  # [MODEL:]PROMPT/OUTPUT@C[,C...]
    runs: int = 3
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    threads: int = 1
    random_weights: bool = False
    output: Path | None = None  # checked (never an input), written by the caller
    plot: Path | None = None
    prefill_batch: str = "whole"


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


# Preparation: everything that can be wrong is found before an engine is built ------------------------
def prepare(req: BenchRequest) -> Plan:
    _check_options(req)
    wanted = _wanted_cells(req)
    dev = resolve_device(req.device)
    dt = resolve_dtype(req.dtype, dev)
    if req.cells is not None and dev.type != "cuda":
        raise BenchInputError(
            f"--cells {req.cells} runs the paper's real shapes (ouro-1.4b, huginn-0125): hours on "
            f"{dev.type}; run it on CUDA, or here use --cell with a tiny preset, e.g. "
            "--cell ouro-tiny:64/16@1,8"
        )
    resolved = _resolve_cells(wanted, dev.type)
    # The paper's Table 2 ran both arms with 64 CUDA graphs (base-engine.md §10); --set still wins.
    shared = (list(TABLE2_SETS) if req.cells is not None else []) + list(req.sets or [])
    arm_sets = {"a": list(req.a_sets or []), "b": list(req.b_sets or [])}
    recipes = {"a": req.a, "b": req.b}
    loaded = {arm: load_recipe(recipes[arm], shared + arm_sets[arm]) for arm in ARMS}
    notes = _cpu_notes(resolved) if dev.type == "cpu" else []
    if req.prefill_batch not in paired.PREFILL_BATCHES:
        raise BenchInputError(
            f"--prefill-batch {req.prefill_batch!r}: expected one of {', '.join(paired.PREFILL_BATCHES)}"
        )
    plan = Plan(
        resolved,
        req.runs,
        recipes,
        loaded,
        shared,
        arm_sets,
        dev,
        dt,
        req.seed,
        req.threads,
        req.random_weights,
        notes,
        req.prefill_batch,
    )
    for c in resolved:
        check_cell_memory(c, plan)
    return plan


def _check_options(req: BenchRequest) -> None:
    """Seed, threads, output paths and --plot, in that order (before the cells)."""
    check_seed(req.seed)
    if req.threads < 1:
        raise BenchInputError(f"--threads must be >= 1, got {req.threads}")
    recipe_files = [(recipe_file(r), flag) for r, flag in ((req.a, "--a"), (req.b, "--b"))]
    check_outputs((req.output, "--output"), (req.plot, "--plot"), inputs=recipe_files)
    if req.plot is not None:
        check_plot(req.plot)


def _wanted_cells(req: BenchRequest) -> list:
    """--runs, then --cells NAME or --cell ... as given (models not resolved yet)."""
    paired.interleave(req.runs)  # --runs
    if req.cells is not None and req.cell:
        raise BenchInputError("give either --cells NAME or --cell ..., not both")
    if req.cells is None and not req.cell:
        raise BenchInputError(
            f"no cells: give --cell {paired.CELL_SYNTAX} (e.g. --cell {paired.CELL_EXAMPLE}) "
            "or --cells table2 (CUDA)"
        )
    return (
        paired.expand_cell_set(req.cells)
        if req.cells is not None
        else paired.parse_cells(req.cell, req.model)
    )


def _resolve_cells(wanted: list, device_type: str) -> list:
    """Each cell's model -> the preset it runs on this device; every cell within its model's positions."""
    resolved = []
    for c in wanted:
        try:
            spec = resolve_preset(c.model, device_type)
        except UnknownModelError as exc:
            raise BenchInputError(f"--cell {c.label}: {exc}") from None
        if c.prompt_len + c.output_len - 1 > spec.max_position:
            raise BenchInputError(
                f"--cell {c.label}: PROMPT + OUTPUT - 1 = {c.prompt_len + c.output_len - 1} positions "
                f"exceed {spec.name}'s {spec.max_position}"
            )
        resolved.append(paired.Cell(spec.name, c.prompt_len, c.output_len, c.concurrency))
    paired.check_unique(resolved)
    return resolved


def _cpu_notes(cells: list) -> list[str]:
    real = sorted({c.model for c in cells} & {cuda for _, cuda in FAMILY_PRESETS.values()})
    return [f"real-shape preset(s) {', '.join(real)} on CPU: expect a long run"] if real else []


def check_cell_memory(cell, plan: Plan) -> None:
    """Before any engine: C within the settings' range, and each arm's engine plus the burst's prompts
    within the memory the device has (a one-line error naming the cell, not a MemoryError mid-run)."""
    if cell.concurrency * max(cell.prompt_len, 1) > COUNT_MAX:
        raise BenchInputError(
            f"--cell {cell.label}: C x PROMPT = {cell.concurrency * cell.prompt_len} tokens in one burst; "
            f"expected at most {COUNT_MAX}"
        )
    where = f"--cell {cell.label}"
    check_memory(workload_needs(cell.concurrency, cell.prompt_len, "C"), plan.device, context=where)
    for arm in ARMS:
        sets = paired.arm_overrides(cell, plan.shared, plan.arm_sets[arm], (), plan.prefill_batch)
        config = load_recipe(plan.recipes[arm], sets).config
        context = f"{where}, arm {arm.upper()}"
        check_engine_memory(PRESETS[cell.model], config, plan.device, plan.dtype, context=context)


# The engine side of the paired run -------------------------------------------------------------------
@dataclass
class _Arm:
    engine: Any
    recipe: Any
    overrides: list[str]
    weights: Any


class EngineBackend:
    """`paired.PairedBackend` on real LLMEngines (built through `looptrace.build.build`)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._auto: dict[str, list[str]] = {}

    def build(self, cell, arm: str) -> _Arm:
        p = self.plan
        if arm == "a":  # before the cell's first engine: its memory split is measured on a free GPU
            self._auto = self._pool_sets(cell)
        sets = paired.arm_overrides(cell, p.shared, p.arm_sets[arm], self._auto.get(arm, []), p.prefill_batch)
        request = BuildRequest(
            model=cell.model,
            random_weights=p.random_weights,
            recipe=p.recipes[arm],
            sets=tuple(sets),
            device=p.device,
            dtype=p.dtype,
            seed=p.seed,
            threads=p.threads,
            max_model_len=cell.prompt_len + cell.output_len,
        )
        setup = build(request)
        need = cell.prompt_len + cell.output_len - 1
        if need > setup.engine.max_model_len:
            del setup
            raise BenchInputError(
                f"--cell {cell.label}: arm {arm.upper()} holds at most {need - 1} positions per request "
                f"(max_model_len), the cell needs {need}"
            )
        return _Arm(setup.engine, setup.recipe, sets, setup.weights)

    def _pool_sets(self, cell) -> dict[str, list[str]]:
        """CUDA: equal KV bytes per arm as kv.num_blocks (paired.kv_bytes_per_arm, with the pool geometry
        of engine/budget.py), unless the arm's own settings size its pool."""
        p = self.plan
        if p.device.type != "cuda":
            return {}
        # deferred: torch loads with the engine, not with this module
        import torch

        user = {arm: p.shared + p.arm_sets[arm] for arm in ARMS}
        sized = [arm for arm in ARMS if not _sizes_own_pool(user[arm])]
        if not sized:
            return {}
        spec = PRESETS[cell.model]
        cfgs = {
            arm: load_recipe(
                p.recipes[arm], paired.arm_overrides(cell, [], user[arm], (), p.prefill_batch)
            ).config
            for arm in ARMS
        }
        free, total = torch.cuda.mem_get_info(p.device)
        util = min(cfgs[arm].kv.gpu_memory_utilization for arm in ARMS)
        per_arm = paired.kv_bytes_per_arm(free, total, util, len(ARMS) * _weight_bytes(spec, p.dtype))
        out = {}
        for arm in sized:
            geo = pool_geometry(spec, cfgs[arm], p.dtype.itemsize)
            blocks = geo.blocks_for_bytes(per_arm)
            if blocks < geo.blocks_per_page:
                raise BenchInputError(
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
            "max_num_seqs": e.snapshot().limits.max_num_seqs,
            "checked_rungs": dict(e.checked_rungs),
            "kv": {
                k: kv[k] for k in ("layout", "num_blocks", "capacity_tokens", "pool_bytes", "max_model_len")
            },
        }

    def run(self, handle: _Arm, cell, arm: str, round: int) -> dict[str, Any]:
        # deferred: loads torch
        from looptrace.drive.benchmark import run_workload
        from looptrace.drive.metrics import summarize
        from looptrace.drive.workloads import make_workload

        e = handle.engine
        wl = make_workload(
            "burst",
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
        return _run_metrics(summarize(record), before, _graph_totals(e))

    def release(self) -> None:
        gc.collect()
        if self.plan.device.type == "cuda":
            # deferred: torch loads with the engine, not with this module
            import torch

            torch.cuda.empty_cache()


def _sizes_own_pool(items: Sequence[str]) -> bool:
    return paired.sets_key(items, "kv.num_blocks") or paired.sets_key(items, "kv.gpu_memory_utilization")


def _weight_bytes(spec, dtype) -> int:
    """The model's parameter bytes, exactly (a meta-device model: shapes only, no memory). Not
    budget.weight_bytes, which leaves out the norms: the split would move by their bytes."""
    # deferred: torch loads with the engine, not with this module
    import torch

    from looptrace.engine.weights import create_model

    meta = create_model(spec, torch.device("meta"), dtype)
    return sum(t.numel() * t.element_size() for t in meta.parameters())


def _run_metrics(m, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One run's record: its summary (`metrics.summarize`) and the graph counters' deltas over the run."""
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


def _graph_totals(engine) -> dict[str, Any]:
    """Captures, replays and fallbacks over every graph cache, and fallbacks by `graph/reason`."""
    totals: dict[str, Any] = {"captures": 0, "replays": 0, "fallbacks": 0, "reasons": {}}
    for name, counters in engine.graph_counters().items():
        for k in ("captures", "replays", "fallbacks"):
            totals[k] += counters.get(k, 0)
        for reason, n in counters.get("fallback_reasons", {}).items():
            totals["reasons"][f"{name}/{reason}"] = n
    return totals


@dataclass
class Measured:
    """What `measure` got: the completed cells, and why it stopped early (Ctrl-C, or a cell's error)."""

    done: list
    interrupted: bool = False
    failed_cell: str | None = None
    error: str | None = None


def measure(
    plan: Plan,
    on_run: paired.RunEvent | None = None,
    on_cell: Callable[[Any], None] | None = None,
    backend: Any = None,
) -> Measured:
    """Run every cell (on `backend`, default an `EngineBackend`). `on_run` is `paired.run_paired`'s event,
    `on_cell` sees each completed `paired.CellResult`. A Ctrl-C or an error inside a cell (a step that
    failed on the device, out of memory) stops the runs; the cells completed before it are kept."""
    done: list = []
    backend = EngineBackend(plan) if backend is None else backend
    try:
        for result in paired.run_paired(plan.cells, plan.runs, backend, on_run):
            done.append(result)
            if on_cell is not None:
                on_cell(result)
    except KeyboardInterrupt:
        return Measured(done, interrupted=True)
    except (paired.BenchInputError, ImportError):
        raise  # bad input and missing packages keep their own messages and exit codes
    except Exception as exc:  # noqa: BLE001 - any cell failure: report it, keep what was measured
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return Measured(
            done, failed_cell=plan.cells[len(done)].label, error=f"{type(exc).__name__}: {first_line}"
        )
    return Measured(done)


# Report -------------------------------------------------------------------------------------------------
def report_data(plan: Plan, done: list, interrupted: bool, failure: dict | None = None) -> dict[str, Any]:
    header = {
        "tool": "looptrace bench",
        "command": " ".join(["looptrace", *sys.argv[1:]]),
        "versions": versions(),
        "device": device_name(plan.device),
        "dtype": str(plan.dtype).replace("torch.", ""),
        "models": sorted({c.model for c in plan.cells}),
        "arms": {arm: _arm_header(rec, plan.recipes[arm]) for arm, rec in plan.loaded.items()},
        "shared_overrides": plan.shared,
        "seed": plan.seed,
        "runs": plan.runs,
        "dropped_runs_per_arm": paired.DROPPED_ROUNDS,
        "order": "interleaved in one process, one round at a time: A, B, A, B, ...",
        "workload": "burst: C requests at t=0, PROMPT random token ids (seed + round, the same for both "
        "arms), OUTPUT tokens each, greedy, ignore_eos",
        "cell_defaults": _cell_defaults_header(plan),
        "cells_planned": [c.label for c in plan.cells],
        "interrupted": interrupted,
        "failed_cell": failure,  # {"cell", "error"} when a cell's run raised; the later cells never ran
    }
    return {"schema": SCHEMA, "header": header, "cells": [_finite(r.to_dict()) for r in done]}


def _arm_header(rec, recipe_arg: str) -> dict[str, Any]:
    return {
        "recipe": rec.name,
        "recipe_arg": recipe_arg,
        "source": rec.source,
        "description": rec.description,
        "overrides": rec.overrides,
    }


def _cell_defaults_header(plan: Plan) -> list[str]:
    whole = ["scheduler.max_num_batched_tokens=max(128, C*PROMPT)", "scheduler.prefill_chunk_size=PROMPT"]
    return (
        ["scheduler.max_num_seqs=C"]
        + (whole if plan.prefill_batch == "whole" else [])
        + (["kv.num_blocks: equal KV bytes per arm (CUDA)"] if plan.device.type == "cuda" else [])
    )


def _finite(obj):
    """NaN/inf -> None, so the JSON is strict (an empty sample has no mean)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# Saved reports (--from) ---------------------------------------------------------------------------------
# A saved report missing a key or holding a value of the wrong type fails while it is read or drawn.
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError)


def malformed(exc: Exception) -> str:
    what = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
    return f"not a complete `looptrace bench --format json` report ({what})"


def load_saved(path: Path) -> dict[str, Any]:
    """One saved `looptrace bench --format json` report, checked whole (the error names the file)."""
    try:  # a regular file, within the nesting/number limits (a fifo would block, a 5,000-deep list crash)
        data = read_json(path, "--from")
    except InputError as exc:
        raise BenchInputError(str(exc).replace("invalid JSON", "not a JSON file")) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("cells"), list):
        raise BenchInputError(
            f"--from {path}: expected a `looptrace bench --format json` file (schema {SCHEMA})"
        )
    _check_saved(data, path)
    return data


def _check_saved(data: dict[str, Any], path: Path) -> None:
    """Every part the table and the CSV read is there (so the error names the file that lacks it)."""
    try:
        for arm in data["header"]["arms"].values():
            arm_text(arm)
        table(data)
        csv_text(data)
    except MALFORMED as exc:
        raise BenchInputError(f"--from {path}: {malformed(exc)}") from None


def render_saved(paths: Sequence[Path], fmt: str) -> tuple[dict[str, Any], str]:
    """`--from FILE...`: the saved reports, checked, merged and rendered as `fmt` (nothing is measured)."""
    reports = [load_saved(p) for p in paths]
    try:
        data = paired.merge_reports(reports, [str(p) for p in paths])
        return data, render(data, fmt)
    except BenchInputError as exc:
        raise BenchInputError(f"--from {exc}") from None
    except MALFORMED as exc:
        raise BenchInputError(f"--from {', '.join(map(str, paths))}: {malformed(exc)}") from None
