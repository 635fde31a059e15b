"""The benchmark driver against a deterministic fake engine on a fake clock (no real time passes)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from looptrace.drive.benchmark import ABORTED, INTERRUPTED, REJECTED, RunRecord, run_workload
from looptrace.drive.metrics import summarize
from looptrace.drive.protocol import ServingEngine
from looptrace.drive.workloads import BurstWorkload, PoissonWorkload, SessionWorkload, WorkItem, Workload
from looptrace.engine.hooks import Observer
from looptrace.engine.llm_engine import EngineStats, TokenOutput
from looptrace.engine.request import SamplingParams


class FakeClock:
    """Time only moves when the engine steps (`dt`) or the driver sleeps. Binary fractions keep sums exact."""

    def __init__(self, t0: float = 1000.0) -> None:
        self.t = t0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


@dataclass
class _FakeReq:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float | None
    age: int = 0  # steps seen
    outputs: list[int] = field(default_factory=list)


class FakeEngine:
    """Honours the engine contract. Each step takes `dt` seconds and `loops` submissions; a request's
    first token comes `prefill_steps` steps after submission, then one token every `period` steps. Token
    ids are a function of the prompt, so closed-loop prompts are predictable."""

    def __init__(
        self,
        clock: FakeClock,
        *,
        dt: float = 0.125,
        period: int = 1,
        prefill_steps: int = 1,
        loops: int = 3,
        max_model_len: int = 4096,
        interrupt_at_step: int | None = None,
        kv_per_request: float = 0.125,
        stop_after: int | None = None,  # emit "stop" after this many tokens
    ) -> None:
        self.clock, self.dt, self.period, self.prefill_steps, self.loops = (
            clock,
            dt,
            period,
            prefill_steps,
            loops,
        )
        self.max_model_len = max_model_len
        self.interrupt_at_step = interrupt_at_step
        self.kv_per_request = kv_per_request
        self.stop_after = stop_after
        self.stats = EngineStats(steps=5, submissions=17)  # nonzero: the driver must report deltas
        self.reqs: dict[str, _FakeReq] = {}
        self.added: list[_FakeReq] = []
        self.aborted: list[str] = []
        self._ids = itertools.count()

    def add_request(self, prompt, params, request_id=None, arrival_time=None) -> str:
        rid = request_id or f"fake-{next(self._ids)}"
        req = _FakeReq(rid, list(prompt), params, arrival_time)
        self.reqs[rid] = req
        self.added.append(req)
        return rid

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.reqs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def kv_usage(self) -> float:
        return min(1.0, self.kv_per_request * len(self.reqs))

    def attach(self, observer: Observer) -> None:
        raise NotImplementedError  # the driver never attaches observers

    def detach(self, observer: Observer) -> None:
        raise NotImplementedError

    def step(self) -> list[TokenOutput]:
        self.stats.steps += 1
        self.stats.submissions += self.loops
        self.clock.t += self.dt
        if self.stats.steps - 5 == self.interrupt_at_step:
            raise KeyboardInterrupt
        out = []
        for req in list(self.reqs.values()):
            req.age += 1
            due = req.age - self.prefill_steps
            if due < 0 or due % self.period:
                continue
            token = (sum(req.prompt) + len(req.outputs)) % 997 + 3
            req.outputs.append(token)
            n = len(req.outputs)
            stop = self.stop_after is not None and n == self.stop_after
            finished = stop or n == req.params.max_tokens
            reason = "stop" if stop else "length" if finished else None
            out.append(TokenOutput(req.rid, token, finished, reason, exit_depth=n % 4))
        for o in out:
            if o.finished:
                del self.reqs[o.request_id]
        return out


def _run(engine: ServingEngine, workload: Workload, **kw) -> RunRecord:
    return run_workload(engine, workload, clock=engine.clock, sleep=engine.clock.sleep, **kw)


# Timings ---------------------------------------------------------------------------------------------
def test_burst_records_every_token_time():
    clock = FakeClock()
    engine = FakeEngine(clock, dt=0.125, period=2, prefill_steps=1)
    rec = _run(engine, BurstWorkload(concurrency=3, prompt_len=5, max_tokens=3, seed=0, vocab_size=50))
    assert len(rec.requests) == 3 and not rec.interrupted
    for r in rec.requests:
        # steps end at 0.125 * k; tokens on steps 1, 3, 5
        assert r.token_times == [0.125, 0.375, 0.625]
        assert (r.arrival, r.submit_time, r.finish_time, r.finish_reason) == (0.0, 0.0, 0.625, "length")
        assert (r.ttft, r.e2el, r.itls) == (0.125, 0.625, [0.25, 0.25])
        assert r.output_len == 3 and r.exit_depths == [1, 2, 3] and r.prompt_len == 5
    assert rec.duration == 0.625 and rec.start_time == 1000.0
    assert (rec.steps_start, rec.steps_end, rec.engine_steps) == (5, 10, 5)
    assert (rec.submissions_start, rec.submissions_end, rec.submissions) == (17, 32, 15)
    assert rec.peak_kv_usage == 3 * 0.125  # sampled after step 1, with all three running
    assert clock.sleeps == []
    m = summarize(rec)
    assert (m.ttft.mean, m.tpot.mean, m.itl.mean, m.e2el.mean) == (125.0, 250.0, 250.0, 625.0)
    assert m.steps_per_output_token == 5 / 9 and m.submissions_per_output_token == 15 / 9


def test_engine_receives_prompt_params_and_absolute_arrival():
    clock = FakeClock()
    engine = FakeEngine(clock)
    wl = BurstWorkload(2, 4, 6, seed=3, vocab_size=40)
    _run(engine, wl, params=SamplingParams(temperature=0.7, seed=1))
    assert [a.prompt for a in engine.added] == [it.prompt for it in wl.initial_items()]
    for a in engine.added:
        assert (a.params.max_tokens, a.params.temperature, a.params.seed) == (6, 0.7, 1)
        assert a.arrival_time == 1000.0  # the start of the run on the driver's clock + scheduled offset


def test_open_loop_sleeps_until_next_arrival_and_ttft_counts_from_schedule():
    clock = FakeClock()
    engine = FakeEngine(clock, dt=0.125, prefill_steps=1)

    class Fixed(Workload):
        def total_requests(self) -> int:
            return 3

        def initial_items(self) -> list[WorkItem]:
            # the second arrives mid-step (0.0625), the third after an idle gap
            return [WorkItem([1], 2, 0.0), WorkItem([2], 2, 0.0625), WorkItem([3], 1, 2.0)]

    rec = _run(engine, Fixed())
    a, b, c = rec.requests
    assert a.token_times == [0.125, 0.25]
    # b is submitted after step 1 returns (0.125) but its TTFT counts from 0.0625
    assert (b.submit_time, b.token_times, b.ttft) == (0.125, [0.25, 0.375], 0.1875)
    assert clock.sleeps == [2.0 - 0.375]  # idle: one sleep straight to the next arrival
    assert (c.submit_time, c.token_times, c.ttft) == (2.0, [2.125], 0.125)
    assert rec.duration == 2.125


def test_poisson_run_submits_every_request_in_arrival_order():
    clock = FakeClock()
    engine = FakeEngine(clock, dt=0.03125)
    wl = PoissonWorkload(rate=5.0, num_requests=30, prompt_len=3, max_tokens=4, seed=2, vocab_size=100)
    rec = _run(engine, wl)
    arrivals = [it.arrival for it in wl.initial_items()]
    assert [r.arrival for r in rec.requests] == arrivals
    assert all(r.submit_time >= r.arrival and r.completed and r.output_len == 4 for r in rec.requests)
    assert summarize(rec).completed == 30


# Closed loop -----------------------------------------------------------------------------------------
def test_sessions_submit_next_turn_after_previous_finishes_with_its_outputs():
    clock = FakeClock()
    engine = FakeEngine(clock, dt=0.125)
    wl = SessionWorkload(
        num_sessions=2,
        turns=3,
        first_prompt_len=4,
        turn_prompt_len=2,
        max_tokens=3,
        seed=1,
        vocab_size=100,
        think_time=0.5,
    )
    progress = []
    rec = _run(engine, wl, on_progress=lambda *a: progress.append(a))
    assert len(rec.requests) == 6 and all(r.completed for r in rec.requests)
    by_rid = {a.rid: a.prompt for a in engine.added}
    for s in range(2):
        turns = sorted((r for r in rec.requests if r.session_id == s), key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        for prev, cur in itertools.pairwise(turns):
            assert cur.arrival == prev.finish_time + 0.5  # closed loop + think time
            assert cur.submit_time >= cur.arrival
            assert (
                by_rid[cur.request_id]
                == by_rid[prev.request_id] + prev.token_ids + by_rid[cur.request_id][-2:]
            )
            assert cur.prompt_len == prev.prompt_len + 3 + 2
    assert progress[0] == (0, 6, 0) and progress[-1] == (6, 6, 18)
    assert [p[0] for p in progress] == sorted(p[0] for p in progress)


def test_stop_finish_still_releases_next_turn():
    # "stop" is a normal completion: the session continues with the shorter output.
    clock = FakeClock()
    engine = FakeEngine(clock, stop_after=1)
    rec = _run(engine, SessionWorkload(1, 2, 3, 1, 4, vocab_size=20))
    assert [(r.turn, r.output_len, r.finish_reason) for r in rec.requests] == [(0, 1, "stop"), (1, 1, "stop")]


# Failures --------------------------------------------------------------------------------------------
def test_too_long_requests_are_rejected_without_submission():
    clock = FakeClock()
    engine = FakeEngine(clock, max_model_len=10)
    wl = SessionWorkload(1, 3, first_prompt_len=4, turn_prompt_len=2, max_tokens=3, vocab_size=50)
    rec = _run(engine, wl)
    t0, t1 = rec.requests  # turn 1: 4 + 3 + 2 = 9 prompt tokens + 3 - 1 > 10, so the session ends there
    assert t0.completed and t0.prompt_len + t0.max_tokens == 7
    assert (t1.finish_reason, t1.submit_time, t1.request_id) == (REJECTED, None, "")
    assert t1.error == "prompt 9 + max_tokens 3 needs 11 positions > 10"
    assert len(engine.added) == 1
    m = summarize(rec)
    assert (m.completed, m.failed) == (1, 1)


def test_engine_value_error_rejects_the_request():
    clock = FakeClock()
    engine = FakeEngine(clock)
    orig = engine.add_request

    def picky(prompt, params, **kw):
        if prompt[0] % 2:
            raise ValueError("odd first token")
        return orig(prompt, params, **kw)

    engine.add_request = picky

    class Two(Workload):
        def total_requests(self) -> int:
            return 2

        def initial_items(self) -> list[WorkItem]:
            return [WorkItem([1], 2), WorkItem([2], 2)]

    rec = _run(engine, Two())
    assert [(r.finish_reason, r.error) for r in rec.requests] == [
        (REJECTED, "odd first token"),
        ("length", None),
    ]


def test_engine_dropping_a_request_does_not_hang():
    clock = FakeClock()
    engine = FakeEngine(clock, period=100)
    orig_step = engine.step

    def forgetful_step():
        out = orig_step()
        engine.reqs.clear()  # lost without a finished token
        return out

    engine.step = forgetful_step
    rec = _run(engine, BurstWorkload(2, 2, 5, vocab_size=10))
    assert [r.finish_reason for r in rec.requests] == [ABORTED, ABORTED]
    assert all(r.output_len == 1 and "never reported" in r.error for r in rec.requests)


# Interrupts ------------------------------------------------------------------------------------------
def test_keyboard_interrupt_keeps_partial_results_and_aborts_the_rest():
    clock = FakeClock()
    engine = FakeEngine(clock, dt=0.125, interrupt_at_step=4)

    class Mixed(Workload):
        def total_requests(self) -> int:
            return 3

        def initial_items(self) -> list[WorkItem]:
            # short finishes in step 2; long is mid-generation at the interrupt; late never arrives
            return [WorkItem([1], 2), WorkItem([2], 10), WorkItem([3], 2, arrival=5.0)]

    progress = []
    rec = _run(engine, Mixed(), on_progress=lambda *a: progress.append(a))
    assert rec.interrupted
    assert len(rec.requests) == 2  # the unsubmitted item is not in the record
    short, long = rec.requests
    assert short.completed and short.token_times == [0.125, 0.25]
    assert long.finish_reason == INTERRUPTED and not long.completed  # incomplete, not failed
    assert long.token_times == [0.125, 0.25, 0.375]  # tokens from steps 1-3 kept; step 4 raised
    assert long.finish_time == 0.5 == rec.duration
    assert engine.aborted == [long.request_id] and not engine.has_unfinished_requests()
    assert rec.engine_steps == 4 and rec.submissions == 12
    assert rec.unsubmitted == 1  # `late` was still waiting for its arrival
    assert progress[-1] == (1, 3, 5)
    m = summarize(rec)
    assert (m.completed, m.failed, m.interrupted_requests, m.unsubmitted_requests) == (1, 0, 1, 1)
    assert (m.total_output_tokens, m.tokens_sampled, m.interrupted) == (2, 5, True)
    assert m.finish_reasons == {"length": 1, INTERRUPTED: 1}


def test_keyboard_interrupt_while_idle():
    clock = FakeClock()
    engine = FakeEngine(clock)

    def ctrl_c(seconds: float) -> None:
        raise KeyboardInterrupt

    wl = PoissonWorkload(rate=0.001, num_requests=2, prompt_len=2, max_tokens=1, seed=0, vocab_size=10)
    rec = run_workload(engine, wl, clock=clock, sleep=ctrl_c)
    assert rec.interrupted and len(rec.requests) == 1 and rec.requests[0].completed
    assert engine.aborted == []


def test_real_clock_smoke():
    engine = FakeEngine(FakeClock(), dt=0.0)  # the fake's own clock is unused here

    class Later(Workload):
        def total_requests(self) -> int:
            return 2

        def initial_items(self) -> list[WorkItem]:
            return [WorkItem([1], 2), WorkItem([2], 2, arrival=0.02)]

    t0 = time.perf_counter()
    rec = run_workload(engine, Later())
    assert time.perf_counter() - t0 >= 0.02 and rec.duration >= 0.02
    assert rec.requests[1].submit_time >= 0.02
    assert all(r.completed for r in rec.requests)


def test_failed_abort_still_returns_the_partial_record():
    clock = FakeClock()
    engine = FakeEngine(clock, interrupt_at_step=2)

    def broken_abort(rid: str) -> None:
        raise RuntimeError("engine gone")

    engine.abort_request = broken_abort
    rec = _run(engine, BurstWorkload(1, 2, 5, vocab_size=10))
    (r,) = rec.requests
    assert rec.interrupted and r.finish_reason == INTERRUPTED and r.token_times == [0.125]
    assert r.error == "abort_request failed (RuntimeError: engine gone)"


# Real engine -----------------------------------------------------------------------------------------
def test_real_engine_burst_and_sessions():
    from looptrace.engine import EngineConfig, LLMEngine

    engine = LLMEngine.from_preset("ouro-tiny", EngineConfig(noise="zeros"), device="cpu", seed=0)
    vocab = engine.spec.vocab_size
    out0 = engine.stats.output_tokens
    burst = run_workload(engine, BurstWorkload(3, 8, 4, seed=0, vocab_size=vocab, token_low=10))
    sessions = run_workload(engine, SessionWorkload(2, 2, 6, 3, 3, seed=0, vocab_size=vocab, token_low=10))
    assert all(r.completed and r.output_len == r.max_tokens for r in burst.requests + sessions.requests)
    assert len(sessions.requests) == 4
    assert engine.stats.output_tokens - out0 == 3 * 4 + 4 * 3
    for rec in (burst, sessions):
        m = summarize(rec)
        assert rec.engine_steps > 0 and rec.submissions > 0 and 0 < rec.peak_kv_usage <= 1
        assert m.ttft.count == m.completed and m.tpot.count == m.completed
        assert all(t > 0 for t in m.ttfts)
    assert not engine.has_unfinished_requests()


# The collector ----------------------------------------------------------------------------------------
def test_the_heap_alive_before_a_run_is_frozen_while_it_runs_and_released_after():
    """A full collection of the engine's heap paused H200 bench rounds for ~170 ms (TTFT outliers); the run
    keeps what existed before it out of the collector's reach, and puts it back afterwards (also when the
    run is interrupted)."""
    import gc

    class Watching(FakeEngine):
        def step(self):
            self.frozen.append(gc.get_freeze_count())
            return super().step()

    for interrupt in (None, 2):
        engine = Watching(FakeClock(), interrupt_at_step=interrupt)
        engine.frozen = []
        held = [object() for _ in range(1000)]  # alive before the run: part of the frozen heap
        rec = _run(engine, BurstWorkload(concurrency=2, prompt_len=3, max_tokens=3, seed=0, vocab_size=50))
        assert rec.interrupted is (interrupt is not None)
        assert engine.frozen and min(engine.frozen) >= len(held)
        assert gc.get_freeze_count() == 0


def test_the_collection_before_the_freeze_is_not_counted_in_the_run(monkeypatch):
    """The full collection `frozen_heap` runs first takes ~140 ms on a real engine's heap: it must come before
    the driver reads its start time, or every request's TTFT carries it (it did, on the H200)."""
    import gc

    from looptrace.drive import benchmark

    clock = FakeClock()
    real_collect = gc.collect

    def slow_collect(*args):
        clock.t += 1.0  # a one-second collection on the fake clock
        return real_collect(*args)

    monkeypatch.setattr(benchmark.gc, "collect", slow_collect)
    engine = FakeEngine(clock, dt=0.125, prefill_steps=1)
    rec = _run(engine, BurstWorkload(concurrency=2, prompt_len=3, max_tokens=2, seed=0, vocab_size=50))
    assert rec.start_time == 1001.0
    assert all(r.ttft == 0.125 for r in rec.requests)
