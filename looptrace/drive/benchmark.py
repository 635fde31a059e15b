"""Drive an engine through a workload and record per-request timings (the input of `metrics.summarize`).

The driver is a client in the same process: it submits each item once its scheduled arrival has passed,
steps the engine, and timestamps every token when the step that sampled it returns. All times in a
`RunRecord` are seconds from the start of the run on the given clock. TTFT and E2EL count from the
*scheduled* arrival, so time a request waited for the driver (an arrival during a long step) is charged
to the engine, as LoopDuet does.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from looptrace.drive.protocol import ServingEngine
from looptrace.drive.workloads import WorkItem, Workload
from looptrace.engine.request import SamplingParams

ProgressFn = Callable[[int, int, int], None]  # (done_requests, total_requests, output_tokens)

ABORTED = "abort"
REJECTED = "rejected"  # never submitted: longer than max_model_len, or add_request raised ValueError
INTERRUPTED = "interrupted"  # in flight at a Ctrl-C: neither completed nor failed, its tokens still count
FAILED_REASONS = frozenset({ABORTED, REJECTED})
INCOMPLETE_REASONS = FAILED_REASONS | {INTERRUPTED}


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    max_tokens: int
    arrival: float  # scheduled arrival
    submit_time: float | None = None  # when add_request was called (None: rejected before submission)
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None  # the engine's ("stop", "length", ...) or ABORTED/REJECTED/INTERRUPTED
    error: str | None = None
    session_id: int | None = None
    turn: int | None = None

    @property
    def output_len(self) -> int:
        return len(self.token_ids)

    @property
    def completed(self) -> bool:
        """Finished normally; only completed requests enter latency and throughput metrics (vLLM)."""
        return self.finish_time is not None and self.finish_reason not in INCOMPLETE_REASONS

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2el(self) -> float | None:
        return self.finish_time - self.arrival if self.finish_time is not None else None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive tokens."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]


@dataclass
class RunRecord:
    requests: list[RequestRecord]
    duration: float  # seconds from start until the last request finished (or the interrupt)
    start_time: float  # clock value at the start, to line the run up with other traces
    steps_start: int
    steps_end: int
    submissions_start: int
    submissions_end: int
    peak_kv_usage: float  # max of engine.kv_usage() after each step, in [0, 1]
    interrupted: bool = False
    workload: str = ""  # repr of the workload, for reports
    unsubmitted: int = 0  # items still waiting for their arrival at the interrupt (not in `requests`)

    @property
    def engine_steps(self) -> int:
        return self.steps_end - self.steps_start

    @property
    def submissions(self) -> int:
        return self.submissions_end - self.submissions_start


class _Driver:
    """State of one run; `run_workload` is the public entry point."""

    def __init__(
        self, engine: ServingEngine, workload: Workload, clock: Callable[[], float], params: SamplingParams
    ):
        self.engine, self.workload, self.clock, self.params = engine, workload, clock, params
        self.pending: list[tuple[float, int, WorkItem]] = []  # heap by (arrival, submission order)
        self.order = itertools.count()
        self.running: dict[str, tuple[WorkItem, RequestRecord]] = {}
        self.records: list[RequestRecord] = []
        self.done = 0
        self.output_tokens = 0
        self.peak_kv = 0.0
        self.start = clock()
        self.steps_start = engine.stats.steps
        self.submissions_start = engine.stats.submissions
        for item in workload.initial_items():
            self.push(item)

    def now(self) -> float:
        return self.clock() - self.start

    def push(self, item: WorkItem) -> None:
        heapq.heappush(self.pending, (item.arrival, next(self.order), item))

    # Submission --------------------------------------------------------------------------------------
    def submit_due(self, due: float = 0.0) -> None:
        """Submit every item whose arrival is <= max(now, due)."""
        now = max(self.now(), due)
        while self.pending and self.pending[0][0] <= now:
            self.submit(heapq.heappop(self.pending)[2], now)

    def submit(self, item: WorkItem, now: float) -> None:
        rec = RequestRecord(
            "", len(item.prompt), item.max_tokens, item.arrival, session_id=item.session_id, turn=item.turn
        )
        self.records.append(rec)
        # The engine's rule: the final sampled token is never fed back, so it needs no KV position.
        need, limit = len(item.prompt) + item.max_tokens - 1, self.engine.max_model_len
        if need > limit:
            why = f"prompt {len(item.prompt)} + max_tokens {item.max_tokens} needs {need} positions > {limit}"
            self.reject(rec, now, why)
            return
        params = dataclasses.replace(self.params, max_tokens=item.max_tokens)
        try:
            rid = self.engine.add_request(list(item.prompt), params, arrival_time=self.start + item.arrival)
        except ValueError as e:  # the engine's own validation
            self.reject(rec, now, str(e))
            return
        rec.request_id, rec.submit_time = rid, now
        self.running[rid] = (item, rec)

    def reject(self, rec: RequestRecord, now: float, why: str) -> None:
        rec.finish_time, rec.finish_reason, rec.error = now, REJECTED, why
        self.done += 1

    # Stepping ----------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step; returns whether any token was produced or any request ended."""
        outputs = self.engine.step()
        t = self.now()
        self.peak_kv = max(self.peak_kv, float(self.engine.kv_usage()))
        changed = False
        for out in outputs:
            entry = self.running.get(out.request_id)
            if entry is None:  # a request somebody else submitted to this engine
                continue
            item, rec = entry
            rec.token_times.append(t)
            rec.token_ids.append(out.token_id)
            rec.exit_depths.append(out.exit_depth)
            self.output_tokens += 1
            changed = True
            if out.finished:
                self.finish(item, rec, t, out.finish_reason)
        if self.running and not self.engine.has_unfinished_requests():
            self.drop_lost(t)  # never spin on requests the engine no longer holds
            changed = True
        return changed

    def finish(self, item: WorkItem, rec: RequestRecord, t: float, reason: str | None) -> None:
        del self.running[rec.request_id]
        rec.finish_time, rec.finish_reason = t, reason or "stop"
        self.done += 1
        if rec.completed:
            for follow_up in self.workload.next_items(item, list(rec.token_ids), t):
                self.push(follow_up)

    def drop_lost(self, t: float) -> None:
        for _, rec in self.running.values():
            rec.finish_time, rec.finish_reason = t, ABORTED
            rec.error = "the engine has no unfinished requests but never reported this one finished"
            self.done += 1
        self.running.clear()

    def abort_all(self) -> None:
        """Ctrl-C: abort what is in flight; those requests are INTERRUPTED (not failed), tokens kept."""
        t = self.now()
        for rid, (_, rec) in list(self.running.items()):
            rec.finish_time, rec.finish_reason = t, INTERRUPTED
            try:
                self.engine.abort_request(rid)
            except Exception as e:  # keep the partial record: it is what the user interrupted to see
                rec.error = f"abort_request failed ({type(e).__name__}: {e})"
        self.running.clear()

    # Loop --------------------------------------------------------------------------------------------
    def loop(self, sleep: Callable[[float], None], on_progress: ProgressFn | None) -> None:
        total = self.workload.total_requests()

        def report() -> None:
            if on_progress is not None:
                on_progress(self.done, total, self.output_tokens)

        report()
        while self.pending or self.running:
            done_before = self.done
            self.submit_due()
            if not self.running and self.pending:
                self.idle_until_next_arrival(sleep)
            produced = bool(self.running) and self.step()
            if produced or self.done != done_before:
                report()

    def idle_until_next_arrival(self, sleep: Callable[[float], None]) -> None:
        nxt = self.pending[0][0]
        sleep(max(0.0, nxt - self.now()))
        # Submit even if the clock reads a hair early (float rounding, an early wake-up): otherwise we
        # would spin on ever smaller sleeps.
        self.submit_due(due=nxt)

    def record(self, interrupted: bool) -> RunRecord:
        stats = self.engine.stats
        return RunRecord(
            requests=self.records,
            duration=self.now(),
            start_time=self.start,
            steps_start=self.steps_start,
            steps_end=stats.steps,
            submissions_start=self.submissions_start,
            submissions_end=stats.submissions,
            peak_kv_usage=self.peak_kv,
            interrupted=interrupted,
            workload=repr(self.workload),
            unsubmitted=len(self.pending) if interrupted else 0,
        )


def run_workload(
    engine: ServingEngine,
    workload: Workload,
    *,
    on_progress: ProgressFn | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    params: SamplingParams | None = None,
) -> RunRecord:
    """Run `workload` on `engine` to completion and return what was measured.

    `params` is the sampling template for every request (its max_tokens is replaced by each item's;
    default: greedy, ignore_eos). Ctrl-C stops stepping, aborts the outstanding requests (finish reason
    INTERRUPTED, their tokens kept) and returns the partial record with `interrupted=True`; items not yet
    submitted are left out of it and counted in `unsubmitted`.
    """
    with frozen_heap():  # before the driver starts its clock: the collection is not the run's time
        driver = _Driver(engine, workload, clock, params or SamplingParams())
        interrupted = False
        try:
            driver.loop(sleep, on_progress)
        except KeyboardInterrupt:
            interrupted = True
            driver.abort_all()
        return driver.record(interrupted)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Everything alive before the run (engines, weights, compiled kernels, CUDA graphs) is moved out of
    the cyclic collector's reach while it runs (`gc.freeze`), and put back after. Why: a full collection
    of that heap paused the engine for 155-189 ms in the middle of H200 bench rounds, the TTFT outliers of
    single rounds (bench/results/h200/ttft-spikes/). Objects the run creates are collected
    as usual. `run_workload` enters it before the driver reads its clock, so the collection before the
    freeze is not counted in the run."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
