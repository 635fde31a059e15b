"""Paired A/B benchmarks (`looptrace bench`): cells, the interleaved schedule, statistics and ratios.

A *cell* is one serving shape: a model preset, a burst of C requests with P-token prompts and O output
tokens each (greedy, ignore_eos). For every cell one engine per arm is built once, then the arms run in
turn in the same process, round by round: A, B, A, B, A, B for three runs. Round 0 of each arm is a
warm-up (CUDA-graph capture, allocator growth, caches) and is dropped; the statistics cover the kept
rounds. Round r uses the same prompts for both arms, and new prompts each round (workload seed + r), so
no arm ever hits its own prefix cache from an earlier round.

The ratio of a cell is B/A of the kept means; the per-round ratios (B_r / A_r, the same round's prompts
and the closest-in-time pair) give its spread.

This module is pure (no torch, no engine imports): the engine work comes in through a `PairedBackend`,
so the orchestration and its order are tested with a fake backend.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from looptrace.engine.budget import cuda_kv_budget

ARMS: tuple[str, str] = ("a", "b")
DROPPED_ROUNDS = 1  # round 0 of each arm is the warm-up
MIN_RUNS = DROPPED_ROUNDS + 1
# (name in the JSON, label, unit) of the per-run numbers that get statistics and ratios.
METRICS: tuple[tuple[str, str, str], ...] = (
    ("output_tok_s", "output throughput", "tok/s"),
    ("ttft_p50_ms", "TTFT p50", "ms"),
    ("tpot_p50_ms", "TPOT p50", "ms"),
)
METRIC_NAMES = tuple(m[0] for m in METRICS)
CELL_SYNTAX = "[MODEL:]PROMPT/OUTPUT@C[,C...]"
CELL_EXAMPLE = "ouro-tiny:16/4@2"


class BenchInputError(ValueError):
    """A bad cell or bench setting; the message is one line."""


# Cells ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    model: str  # a preset name (or a family, before the CLI resolves it for the device)
    prompt_len: int
    output_len: int
    concurrency: int

    @property
    def label(self) -> str:
        """The cell in `--cell` syntax: `ouro-1.4b:512/128@8`."""
        return f"{self.model}:{self.prompt_len}/{self.output_len}@{self.concurrency}"

    @property
    def shape(self) -> str:
        """What a plot series shares: model and lengths (`ouro-1.4b 512/128`)."""
        return f"{self.model} {self.prompt_len}/{self.output_len}"

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.model, self.prompt_len, self.output_len, self.concurrency)


_CELL_RE = re.compile(
    r"^(?:(?P<model>[A-Za-z0-9][A-Za-z0-9._-]*):)?(?P<p>\d+)/(?P<o>\d+)@(?P<c>\d+(?:,\d+)*)$"
)


def parse_cell(text: str, default_model: str) -> list[Cell]:
    """`ouro-tiny:16/4@2` -> one cell; `@1,8` -> one cell per concurrency; MODEL defaults to
    `default_model`. Every problem is one BenchInputError line naming the cell."""
    m = _CELL_RE.match(text.strip())
    if m is None:
        raise BenchInputError(f"--cell {text!r}: expected {CELL_SYNTAX}, e.g. {CELL_EXAMPLE}")
    model = m["model"] or default_model
    prompt_len, output_len = int(m["p"]), int(m["o"])
    if prompt_len < 1:
        raise BenchInputError(f"--cell {text!r}: PROMPT must be >= 1 token, got {prompt_len}")
    if output_len < 2:
        raise BenchInputError(
            f"--cell {text!r}: OUTPUT must be >= 2 tokens (TPOT excludes the first), got {output_len}"
        )
    cells = []
    for c in m["c"].split(","):
        if int(c) < 1:
            raise BenchInputError(f"--cell {text!r}: C (concurrent requests) must be >= 1, got {int(c)}")
        cells.append(Cell(model, prompt_len, output_len, int(c)))
    return cells


def parse_cells(texts: Iterable[str], default_model: str) -> list[Cell]:
    """Every `--cell`, in order; a cell given twice is an error (it would be measured twice)."""
    out: list[Cell] = []
    for text in texts:
        for cell in parse_cell(text, default_model):
            if cell in out:
                raise BenchInputError(f"--cell {cell.label} is given twice")
            out.append(cell)
    return out


def check_unique(cells: Sequence[Cell]) -> None:
    """After the CLI resolved families to presets (`ouro` and `ouro-tiny` may name the same cell)."""
    seen: set[tuple[str, int, int, int]] = set()
    for cell in cells:
        if cell.key in seen:
            raise BenchInputError(f"--cell {cell.label} is given twice")
        seen.add(cell.key)


# Paper Table 2 (base-engine.md §10: standalone GH200, 64 graphs, 0 fallbacks). Ouro: 128 output tokens
# with 512-token prompts, 64 with 2048; Huginn: 64 output tokens, 32 loops.
@dataclass(frozen=True)
class Reference:
    base_tok_s: float
    exactloop_tok_s: float
    ratio: float  # as printed in the paper (its own rounding)
    ttft_p50_s: tuple[float, float]  # base, ExactLoop
    tpot_p50_ms: tuple[float, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": "ExactLoop paper Table 2 (base-engine.md §10), standalone GH200",
            "a_recipe": "base",
            "b_recipe": "exactloop",
            "output_tok_s": {"a": self.base_tok_s, "b": self.exactloop_tok_s, "ratio": self.ratio},
            "ttft_p50_ms": {"a": 1000 * self.ttft_p50_s[0], "b": 1000 * self.ttft_p50_s[1]},
            "tpot_p50_ms": {"a": self.tpot_p50_ms[0], "b": self.tpot_p50_ms[1]},
        }


TABLE2: dict[tuple[str, int, int, int], Reference] = {
    ("ouro-1.4b", 512, 128, 1): Reference(55.9, 109.2, 1.95, (0.19, 0.09), (16.6, 8.5)),
    ("ouro-1.4b", 512, 128, 8): Reference(339.9, 657.4, 1.93, (0.29, 0.14), (19.5, 10.2)),
    ("ouro-1.4b", 512, 128, 32): Reference(677.9, 1454.2, 2.15, (1.05, 0.51), (37.1, 17.2)),
    ("ouro-1.4b", 512, 128, 64): Reference(901.2, 1483.4, 1.65, (2.30, 1.28), (50.8, 31.7)),
    ("ouro-1.4b", 2048, 64, 8): Reference(102.4, 208.8, 2.04, (1.66, 0.81), (46.2, 22.9)),
    ("ouro-1.4b", 2048, 64, 32): Reference(129.3, 246.9, 1.91, (6.60, 3.30), (137.9, 75.1)),
    ("huginn-0125", 512, 64, 1): Reference(11.3, 19.9, 1.77, (0.30, 0.25), (85.2, 46.9)),
    ("huginn-0125", 512, 64, 8): Reference(48.3, 109.3, 2.26, (1.23, 0.43), (129.7, 58.5)),
    ("huginn-0125", 512, 64, 32): Reference(72.7, 206.6, 2.84, (4.72, 2.02), (227.9, 118.2)),
    ("huginn-0125", 512, 64, 64): Reference(65.0, 205.3, 3.16, (22.66, 3.95), (270.1, 121.0)),
}
CELL_SETS = {"table2": [Cell(*key) for key in TABLE2]}


def expand_cell_set(name: str) -> list[Cell]:
    """`table2`, or `table2:MODEL` for the rows of one model (`table2:huginn`, `table2:ouro-1.4b`)."""
    set_name, _, model = name.strip().partition(":")
    try:
        cells = list(CELL_SETS[set_name.lower()])
    except KeyError:
        raise BenchInputError(
            f"--cells {name!r}: expected one of {', '.join(CELL_SETS)}[:MODEL] (or give --cell {CELL_SYNTAX})"
        ) from None
    if model:
        m = model.lower()
        cells = [c for c in cells if c.model == m or c.model.startswith(m + "-")]
        if not cells:
            models = sorted({c.model for c in CELL_SETS[set_name.lower()]})
            raise BenchInputError(
                f"--cells {name!r}: no row of {set_name} is for {model!r}; models: {', '.join(models)}"
            )
    return cells


def reference_for(cell: Cell) -> Reference | None:
    return TABLE2.get(cell.key)


# Per-cell engine settings ---------------------------------------------------------------------------
PREFILL_BATCHES = ("whole", "recipe")


def cell_defaults(cell: Cell, prefill_batch: str = "whole") -> list[str]:
    """The settings a burst cell gives both arms before anything the user sets.

    Every request of the burst is admitted at once (scheduler.max_num_seqs=C). With prefill_batch
    `whole` (the default) the burst's prompts are also prefilled as one batch: a token budget of C x
    PROMPT and chunks of a whole prompt, as vllm-rlt's device-loop benchmark sets its engine
    (`max_num_batched_tokens = max(128, C * prompt_len)`, `prefill_chunk_size = prompt_len`); the
    ExactLoop paper's Table 2 TTFTs match one such prefill step per burst, not C x PROMPT / 128
    round-robin chunks. `recipe` keeps the recipe's serving budget (128-token chunks)."""
    items = [f"scheduler.max_num_seqs={cell.concurrency}"]
    if prefill_batch == "whole":
        items += [
            f"scheduler.max_num_batched_tokens={max(128, cell.concurrency * cell.prompt_len)}",
            f"scheduler.prefill_chunk_size={cell.prompt_len}",
        ]
    elif prefill_batch != "recipe":
        raise BenchInputError(
            f"--prefill-batch {prefill_batch!r}: expected one of {', '.join(PREFILL_BATCHES)}"
        )
    return items


def arm_overrides(
    cell: Cell,
    shared: Sequence[str],
    arm: Sequence[str],
    auto: Sequence[str] = (),
    prefill_batch: str = "whole",
) -> list[str]:
    """The `section.key=value` items an arm's engine is built with for `cell`, in the order they apply
    (a later item wins): the cell's defaults (`cell_defaults`), `auto` (e.g. the KV pool split on CUDA),
    then the user's --set, then the arm's own --a-set / --b-set."""
    return [*cell_defaults(cell, prefill_batch), *auto, *shared, *arm]


def sets_key(items: Iterable[str], key: str) -> bool:
    """Whether any `section.key=value` item sets `key`."""
    return any(item.split("=", 1)[0].strip() == key for item in items)


GIB = 1 << 30


def kv_bytes_per_arm(
    free: int, total: int, utilization: float, weight_bytes: int, arms: int = 2, reserve: int = GIB
) -> int:
    """KV-pool bytes each arm gets when `arms` engines share one GPU (CUDA only).

    The engine alone sizes its pool as `free - (1 - utilization) * total - 1 GiB`, which would give the
    first engine built nearly everything and the second nothing. Here the same budget, less every arm's
    weights and a `reserve` (graphs, activations) per arm, is split evenly: equal bytes, so a layout that
    packs more tokens into the same bytes (ExactLoop's `packed`) keeps that advantage. `free` is measured
    before any arm's weights are loaded. The engine's rule is `budget.cuda_kv_budget` (its own reserve
    taken here per arm, after the weights)."""
    budget = cuda_kv_budget(free, total, utilization, reserve=0) - weight_bytes - arms * reserve
    return max(0, int(budget // arms))


# Schedule and statistics ----------------------------------------------------------------------------
def interleave(runs: int, arms: Sequence[str] = ARMS) -> list[tuple[int, str]]:
    """(round, arm) in execution order: A, B, A, B, ... one round per run."""
    if runs < MIN_RUNS:
        raise BenchInputError(
            f"--runs must be >= {MIN_RUNS} (the first run of each arm is a dropped warm-up), got {runs}"
        )
    return [(r, arm) for r in range(runs) for arm in arms]


@dataclass(frozen=True)
class Spread:
    mean: float
    std: float  # sample standard deviation (n - 1); 0 for one value
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        vals = [float(v) for v in values]
        if not vals:
            nan = math.nan
            return cls(nan, nan, nan, nan, 0)
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return cls(statistics.fmean(vals), std, min(vals), max(vals), len(vals))

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "spread": {"min": self.min, "max": self.max, "std": self.std}, "n": self.n}


def _div(num: float, den: float) -> float:
    return num / den if den and math.isfinite(den) and math.isfinite(num) else math.nan


@dataclass
class RunResult:
    round: int
    arm: str
    metrics: dict[str, Any]  # METRIC_NAMES and whatever else the backend measured

    @property
    def dropped(self) -> bool:
        return self.round < DROPPED_ROUNDS

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "arm": self.arm, "dropped": self.dropped, **self.metrics}


@dataclass
class CellResult:
    cell: Cell
    runs: list[RunResult]
    arms: dict[str, Any] = field(default_factory=dict)  # what the backend says about each arm's engine

    def kept(self, arm: str) -> list[RunResult]:
        return [r for r in self.runs if r.arm == arm and not r.dropped]

    def stats(self) -> dict[str, dict[str, Spread]]:
        return {
            arm: {name: Spread.of([r.metrics[name] for r in self.kept(arm)]) for name in METRIC_NAMES}
            for arm in ARMS
        }

    def ratios(self) -> dict[str, dict[str, float]]:
        """Per metric: B/A of the kept means, and the min/max of the per-round ratios B_r / A_r."""
        stats = self.stats()
        by_round = {arm: {r.round: r.metrics for r in self.kept(arm)} for arm in ARMS}
        rounds = sorted(set(by_round["a"]) & set(by_round["b"]))
        out: dict[str, dict[str, float]] = {}
        for name in METRIC_NAMES:
            per_round = [_div(by_round["b"][r][name], by_round["a"][r][name]) for r in rounds]
            finite = [v for v in per_round if math.isfinite(v)]
            out[name] = {
                "mean": _div(stats["b"][name].mean, stats["a"][name].mean),
                "min": min(finite) if finite else math.nan,
                "max": max(finite) if finite else math.nan,
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        ref = reference_for(self.cell)
        stats = self.stats()
        return {
            "cell": self.cell.label,
            "model": self.cell.model,
            "prompt_len": self.cell.prompt_len,
            "output_len": self.cell.output_len,
            "concurrency": self.cell.concurrency,
            "arms": self.arms,
            "runs": [r.to_dict() for r in self.runs],
            "stats": {arm: {k: s.to_dict() for k, s in per.items()} for arm, per in stats.items()},
            "ratio": self.ratios(),
            "reference": ref.to_dict() if ref else None,
        }


# Orchestration --------------------------------------------------------------------------------------
class PairedBackend(Protocol):
    """What `run_paired` needs from the engine side (the CLI's real one builds LLMEngines)."""

    def build(self, cell: Cell, arm: str) -> Any:
        """The arm's engine (or any handle) for `cell`; built once per cell and arm."""

    def describe(self, handle: Any) -> dict[str, Any]:
        """JSON-able facts about a built arm (settings, KV pool) for the report."""

    def run(self, handle: Any, cell: Cell, arm: str, round: int) -> dict[str, Any]:
        """One run of the cell's workload (round `round`'s prompts) -> per-run numbers (METRIC_NAMES at
        least). Raises KeyboardInterrupt when the run was interrupted."""

    def release(self) -> None:
        """Called after a cell's handles are dropped (gc, CUDA cache)."""


RunEvent = Callable[[Cell, int, str, "dict[str, Any] | None"], None]  # metrics None: the run starts


def run_paired(
    cells: Sequence[Cell], runs: int, backend: PairedBackend, on_run: RunEvent | None = None
) -> Iterator[CellResult]:
    """Measure each cell: build both arms, run the interleaved schedule, free both arms, yield the cell.

    A KeyboardInterrupt (from a build or a run) propagates after the cell's engines are released; the
    caller keeps the cells already yielded."""
    order = interleave(runs)
    for cell in cells:
        handles: dict[str, Any] = {}
        try:
            for arm in ARMS:
                handles[arm] = backend.build(cell, arm)
            result = CellResult(cell, [], {arm: backend.describe(handles[arm]) for arm in ARMS})
            for rnd, arm in order:
                if on_run is not None:
                    on_run(cell, rnd, arm, None)
                metrics = backend.run(handles[arm], cell, arm, rnd)
                result.runs.append(RunResult(rnd, arm, metrics))
                if on_run is not None:
                    on_run(cell, rnd, arm, metrics)
        finally:
            handles.clear()  # the last references: the engines go before the next cell is built
            backend.release()
        yield result


# Saved reports ----------------------------------------------------------------------------------------
def merge_reports(reports: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """One `looptrace bench` JSON report from several (runs split across jobs): the first one's header with
    every command, every report's cells in order. They must compare the same recipes with the same
    overrides, and a cell may appear once; `names` (the files) name the reports in the one-line errors."""
    first, seen = reports[0], {}
    arms = {arm: (a["recipe"], a["overrides"]) for arm, a in first["header"]["arms"].items()}
    for data, name in zip(reports, names):
        other = {arm: (a["recipe"], a["overrides"]) for arm, a in data["header"]["arms"].items()}
        if other != arms or data["header"]["shared_overrides"] != first["header"]["shared_overrides"]:
            raise BenchInputError(f"{name}: its arms differ from {names[0]}'s; merge runs of one comparison")
        for cell in data["cells"]:
            if cell["cell"] in seen:
                raise BenchInputError(f"{name}: cell {cell['cell']} is also in {seen[cell['cell']]}")
            seen[cell["cell"]] = name
    if len(reports) == 1:
        return first
    header = dict(first["header"])
    header["commands"] = [d["header"]["command"] for d in reports]
    header["merged_from"] = list(names)
    header["interrupted"] = any(d["header"]["interrupted"] for d in reports)
    header["cells_planned"] = [c for d in reports for c in d["header"]["cells_planned"]]
    return {"schema": first["schema"], "header": header, "cells": [c for d in reports for c in d["cells"]]}
