"""One `looptrace run`, start to end: draw the workload its options describe, build an engine sized to the
workload's longest request, serve the workload on it and return the report data:
`execute(prepare(request), request)`. No CLI here: bad input is a one-line error (`RunInputError`, the
workload's `WorkloadError`, the build's own; the CLI: exit code 2). The serving loop and its metrics (torch)
load inside the functions, so that `looptrace run`'s option checks fail before torch loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from looptrace.build import BuildRequest, EngineSetup, build, check_seed, run_header
from looptrace.drive.run_workload import (
    WorkloadKind,
    check_fits,
    check_workload_memory,
    make_workload,
    workload_max_len,
)
from looptrace.engine.request import SamplingParams

SCHEMA = "looptrace.run/1"
Progress = Callable[[int, int, int], None]  # (requests done, requests in all, tokens sampled)


class RunInputError(ValueError):
    """A run that cannot go as asked (the CLI: one line, exit code 2)."""


@dataclass(frozen=True)
class RunRequest:
    """What `looptrace run` was asked: the engine, the workload (its kind already resolved from the
    options) and the sampling of every request."""

    build: BuildRequest
    kind: WorkloadKind = WorkloadKind.burst
    concurrency: int = 8
    prompt_len: int = 64
    max_tokens: int = 32
    rate: float | None = None
    num_requests: int | None = None
    sessions: int = 4
    turns: int = 3
    turn_prompt_len: int = 16
    prompts: Path | None = None
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    def workload_options(self) -> dict[str, Any]:
        """The options `workloads.make_workload` takes, by name (the workload's seed is the run's)."""
        names = "concurrency prompt_len max_tokens rate num_requests sessions turns turn_prompt_len prompts"
        return {name: getattr(self, name) for name in names.split()} | {"seed": self.build.seed}


def check(request: RunRequest) -> None:
    """The seed and the sampling options, before anything is drawn or built."""
    check_seed(request.build.seed)
    if request.temperature < 0 or not 0 < request.top_p <= 1 or request.top_k < 0:
        raise RunInputError("sampling: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")


@dataclass
class RunSetup:
    """The engine built for the workload, and the workload."""

    setup: EngineSetup
    workload: Any  # drive.workloads.Workload


def prepare(request: RunRequest) -> RunSetup:
    """Draw the workload (its prompts within host memory) and build an engine sized to it; a request that
    cannot fit the engine's context fails here, before any is served."""
    model = request.build.resolve_model()
    workload = make_workload(
        request.kind,
        **request.workload_options(),
        vocab_size=model.spec.vocab_size,
        tokenizer_dir=request.build.weights,
    )
    check_workload_memory(request.kind, workload)
    setup = build(replace(request.build, max_model_len=workload_max_len(workload)), model)
    check_fits(workload, setup.engine.max_model_len)
    return RunSetup(setup, workload)


def batch_note(run: RunSetup, request: RunRequest) -> str | None:
    """Why the burst will not be batched whole, when the engine holds fewer rows than it has requests."""
    rows = run.setup.engine.snapshot().limits.max_num_seqs
    if request.concurrency <= rows:
        return None
    return (
        f"batches hold at most {rows} rows (scheduler.max_num_seqs); "
        f"pass --set scheduler.max_num_seqs={request.concurrency} to batch all {request.concurrency} requests"
    )


@dataclass
class RunResult:
    """The report data, and what the serving loop recorded (for the notes the CLI prints)."""

    data: dict[str, Any]
    record: Any  # drive.benchmark.RunRecord
    metrics: Any  # drive.metrics.ServingMetrics

    @property
    def interrupted(self) -> bool:
        return self.record.interrupted

    def notes(self) -> list[tuple[str, str]]:
        """(text, label) of each line worth a note: requests the engine rejected, a Ctrl-C's partial run."""
        out = []
        rejected = [r for r in self.record.requests if r.finish_reason == "rejected"]
        if rejected:
            out.append((f"{len(rejected)} request(s) rejected: {rejected[0].error}", "note"))
        if self.interrupted:
            m = self.metrics
            out.append(
                (
                    f"reporting what was measured so far ({m.tokens_sampled} tokens, {m.completed} "
                    f"request(s) completed, {m.interrupted_requests} in flight)",
                    "interrupted",
                )
            )
        return out


def execute(run: RunSetup, request: RunRequest, on_progress: Progress | None = None) -> RunResult:
    """Serve the workload (a Ctrl-C stops it and keeps what was measured) and shape the report data."""
    # deferred: torch (the serving loop, its metrics): bad options fail before it loads
    from looptrace.drive.benchmark import run_workload
    from looptrace.drive.metrics import summarize

    header = run_header(run.setup)
    header["workload"] = run.workload.describe()
    seed = request.build.seed if request.temperature else None
    params = SamplingParams(
        temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, seed=seed
    )
    engine = run.setup.engine
    record = run_workload(engine, run.workload, params=params, on_progress=on_progress)
    metrics = summarize(record)
    return RunResult(report_data(header, engine, metrics), record, metrics)


def report_data(header: dict[str, Any], engine, metrics) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "header": header,
        "metrics": metrics.to_dict(raw=False),
        "engine": {
            "steps": engine.stats.steps,
            "submissions": engine.stats.submissions,
            "steps_by_stage": engine.stats.steps_by_stage,
            "output_tokens": engine.stats.output_tokens,
        },
        "kv": engine.kv_summary() | {"prefix_cache": engine.snapshot().prefix.counters()},
        "cuda_graphs": engine.graph_counters(),
    }
