"""Exact behaviour of the base RefillPolicy and the request stage machine (base-engine.md §2-§3), observed
through the engine's `Observer` hooks: one stage per step, one loop per recurrent step, prefill chunking,
seat/token caps, admission by block budget (incl. bypasses), aborts and EOS."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from looptrace.engine import EngineConfig, EngineInputError, LLMEngine, SamplingParams
from looptrace.engine.model_config import PRESETS, with_overrides
from tests.helpers import Recorder, build_engine, drain


def make_engine(preset: str = "ouro-tiny", spec=None, **settings) -> tuple[LLMEngine, Recorder]:
    rec = Recorder()
    return build_engine(preset, spec=spec, observers=(rec,), **settings), rec


def prompt(n: int, start: int = 10) -> list[int]:
    return [start + i % 400 for i in range(n)]


# --- stage machine: steps per token -----------------------------------------------------------------------
@pytest.mark.parametrize(("preset", "depth"), [("ouro-tiny", 4), ("huginn-tiny", 8)])
def test_single_request_costs_depth_plus_two_steps_per_token(preset, depth):
    engine, rec = make_engine(preset)
    n = 4
    engine.add_request(prompt(5), SamplingParams(max_tokens=n))
    drain(engine)
    per_token = ["prelude"] + ["recurrent"] * depth + ["coda"]
    assert rec.stages == ["prefill", "coda"] + per_token * (n - 1)
    recurrent = [s.loop_indices for s in rec.steps if s.stage == "recurrent"]
    assert recurrent == [[t] for t in range(depth)] * (n - 1)  # exactly one loop per step
    assert engine.stats.steps == engine.stats.submissions == 2 + (depth + 2) * (n - 1)
    assert engine.stats.steps_by_stage == {
        "prefill": 1,
        "coda": n,
        "prelude": n - 1,
        "recurrent": depth * (n - 1),
    }
    assert engine.stats.steps / engine.stats.output_tokens == pytest.approx((2 + (depth + 2) * (n - 1)) / n)
    req = next(iter(engine.requests.values()))
    assert req.exit_depths == [depth] * n  # the first token (prefill) is full depth too
    assert all(s.num_rows == 1 for s in rec.steps[1:])


def test_each_step_reports_the_context_of_its_rows():
    """StepInfo.context_tokens: per row, the prompt and the tokens sampled before the step began (what the
    row's attention reads; the probes' `lt.kv` marker sums it)."""
    engine, rec = make_engine()
    engine.add_request(prompt(5), SamplingParams(max_tokens=3), request_id="A")
    drain(engine)
    per_token = 1 + 4 + 1  # prelude, 4 recurrent loops, coda
    assert [s.context_tokens for s in rec.steps] == [[5], [5]] + [[6]] * per_token + [[7]] * per_token


def test_one_stage_per_batch_and_recurrent_mixes_depths():
    engine, rec = make_engine()
    engine.add_request(prompt(3), SamplingParams(max_tokens=3), request_id="A")
    for _ in range(4):  # prefill, coda, prelude, recurrent loop 0
        engine.step()
    engine.add_request(prompt(3, 50), SamplingParams(max_tokens=2), request_id="B")
    drain(engine)
    got = [(s.stage, s.request_ids, s.loop_indices) for s in rec.steps]
    assert got == [
        ("prefill", ["A"], []),
        ("coda", ["A"], []),
        ("prelude", ["A"], []),
        ("recurrent", ["A"], [0]),
        # recurrent work exists but no prefill since the last core step is due -> admit + prefill B first
        ("prefill", ["B"], []),
        ("coda", ["B"], []),  # CODA (min_coda_batch_size=1) beats a due RECURRENT
        ("prelude", ["B"], []),
        ("recurrent", ["A", "B"], [1, 0]),  # one core launch, two depths
        ("recurrent", ["A", "B"], [2, 1]),
        ("recurrent", ["A", "B"], [3, 2]),
        ("coda", ["A"], []),
        ("prelude", ["A"], []),
        ("recurrent", ["B", "A"], [3, 0]),
        ("coda", ["B"], []),
        ("recurrent", ["A"], [1]),
        ("recurrent", ["A"], [2]),
        ("recurrent", ["A"], [3]),
        ("coda", ["A"], []),
    ]
    assert engine.requests["A"].exit_depths == [4, 4, 4]
    assert engine.requests["B"].exit_depths == [4, 4]


# --- prefill chunking ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("length", "chunk", "budget"), [(30, 8, 128), (30, 128, 7), (16, 4, 4), (9, 128, 128)]
)
def test_prefill_chunk_is_min_of_budget_chunk_and_remaining(length, chunk, budget):
    engine, rec = make_engine(scheduler__prefill_chunk_size=chunk, scheduler__max_num_batched_tokens=budget)
    engine.add_request(prompt(length), SamplingParams(max_tokens=1))
    drain(engine)
    step = min(chunk, budget)
    rows = [s.num_rows for s in rec.steps if s.stage == "prefill"]
    assert len(rows) == math.ceil(length / step)
    assert rows == [min(step, length - i * step) for i in range(len(rows))]
    assert rec.stages == ["prefill"] * len(rows) + ["coda"]


_LETTER = {"prefill": "p", "prelude": "l", "recurrent": "r", "coda": "c"}


@pytest.mark.parametrize(
    ("every", "expected"),
    [
        # A decodes (6 tokens) while B's 24-token prompt prefills in 6 chunks of 4
        (1, "pclrprprprclprprpcrrclrrrrclrrrrclrrrrc"),
        (2, "pclprpprpprpcrclrrrrclrrrrclrrrrclrrrrc"),
    ],
)
def test_prefill_batches_before_decode(every, expected):
    engine, rec = make_engine(
        scheduler__prefill_chunk_size=4, scheduler__max_prefill_batches_before_decode=every
    )
    engine.add_request(prompt(3), SamplingParams(max_tokens=6), request_id="A")
    for _ in range(3):  # prefill, coda, prelude: A now waits in RECURRENT
        engine.step()
    engine.add_request(prompt(24, 80), SamplingParams(max_tokens=1), request_id="B")
    drain(engine)
    assert "".join(_LETTER[s] for s in rec.stages) == expected
    # while both have work, runs of prefill between core steps are exactly `every` long
    both = "".join(_LETTER[s] for s in rec.stages if s in ("prefill", "recurrent"))
    runs = [len(r) for r in both.split("r")[1:-1] if r]
    assert runs and set(runs[:-1]) == {every}
    assert all(s.num_rows == 4 for s in rec.steps if s.stage == "prefill" and s.request_ids == ["B"])


def test_max_num_seqs_caps_rows_and_token_budget_caps_prefill():
    engine, rec = make_engine(
        scheduler__max_num_seqs=2, scheduler__max_num_batched_tokens=10, scheduler__prefill_chunk_size=6
    )
    for i in range(5):
        engine.add_request(prompt(7, 10 + 20 * i), SamplingParams(max_tokens=3))
    drain(engine)
    assert max(len(s.request_ids) for s in rec.steps) == 2
    assert all(len(s.request_ids) <= 2 for s in rec.steps)
    prefill = [s for s in rec.steps if s.stage == "prefill"]
    assert all(s.num_rows <= 10 for s in prefill)
    assert any(len(s.request_ids) == 2 for s in prefill)  # a 6-row chunk + a 4-row remainder of the budget
    assert any(s.num_rows == 10 for s in prefill)
    # every decode stage ran with two rows at some point
    assert {s.stage for s in rec.steps if len(s.request_ids) == 2} >= {"prelude", "recurrent", "coda"}


# --- admission by block budget ---------------------------------------------------------------------------
def _pool_engine(pages: int, **kw):
    # ouro-tiny planes: 4 planes, block_size 4 -> a page of 4 positions costs 4 blocks
    return make_engine(kv__block_size=4, kv__num_blocks=4 * pages, kv__prefix_caching=False, **kw)


def test_second_request_waits_until_first_finishes():
    engine, rec = _pool_engine(5)
    # 10 + 3 - 1 = 12 positions = 3 pages = 12 blocks; two need 24 > 20
    engine.add_request(prompt(10), SamplingParams(max_tokens=3), request_id="A")
    engine.add_request(prompt(10, 200), SamplingParams(max_tokens=3), request_id="B")
    drain(engine)
    kinds = [(e.kind, e.request_id) for e in rec.events if e.kind in ("admitted", "finished")]
    assert kinds == [("admitted", "A"), ("finished", "A"), ("admitted", "B"), ("finished", "B")]
    # the one-request budget (exact fit) is admitted while the pool is empty
    engine.add_request(prompt(17), SamplingParams(max_tokens=4), request_id="C")  # 20 positions = 5 pages
    drain(engine)
    assert engine.requests["C"].finish_reason == "length"


def test_request_bigger_than_pool_is_rejected():
    engine, _ = _pool_engine(5)
    assert engine.max_model_len == 20
    with pytest.raises(EngineInputError, match="max context is 20"):
        engine.add_request(prompt(20), SamplingParams(max_tokens=2))  # 21 positions
    engine.add_request(prompt(20), SamplingParams(max_tokens=1))  # 20 positions: fits exactly
    drain(engine)


def test_blocked_head_request_is_bypassed_at_most_max_admission_bypasses_times():
    engine, rec = _pool_engine(8, scheduler__max_admission_bypasses=2)
    engine.add_request(prompt(17), SamplingParams(max_tokens=4), request_id="A")  # 5 pages
    engine.add_request(prompt(21), SamplingParams(max_tokens=4), request_id="H")  # 6 pages: not now
    for i in range(4):
        engine.add_request(prompt(2, 300 + i), SamplingParams(max_tokens=1), request_id=f"S{i}")  # 1 page
    engine.step()
    assert rec.kinds("admitted") == ["A", "S0", "S1"] and engine.scheduler.bypasses["H"] == 2
    s2 = engine.requests["S2"]  # it would fit, but H has used up its bypasses: S2 waits behind H
    assert engine.blocks.can_admit("S2", s2.prompt, s2.max_kv_tokens, 0)
    drain(engine)
    assert rec.kinds("admitted") == ["A", "S0", "S1", "H", "S2", "S3"]
    done = rec.kinds("finished")
    assert done.index("A") < done.index("H") and rec.kinds("admitted").index("H") == 3
    assert all(r.finish_reason == "length" for r in engine.requests.values())


def test_zero_bypasses_keeps_strict_fcfs():
    engine, rec = _pool_engine(8, scheduler__max_admission_bypasses=0)
    engine.add_request(prompt(17), SamplingParams(max_tokens=4), request_id="A")
    engine.add_request(prompt(21), SamplingParams(max_tokens=4), request_id="H")
    engine.add_request(prompt(2), SamplingParams(max_tokens=1), request_id="S")
    drain(engine)
    assert rec.kinds("admitted") == ["A", "H", "S"]  # strict FCFS: S never passes H


# --- aborts ---------------------------------------------------------------------------------------------
def _step_until(engine: LLMEngine, rid: str, pred, limit: int = 500) -> None:
    for _ in range(limit):
        if pred(engine.requests[rid]):
            return
        engine.step()
    raise AssertionError(f"{rid} never reached the wanted state")


@pytest.mark.parametrize(
    "where", ["waiting", "prefill_mid_chunk", "coda_first", "prelude", "recurrent", "coda"]
)
def test_abort_at_each_stage_frees_blocks_immediately(where):
    engine, rec = make_engine(
        kv__block_size=4, kv__num_blocks=4 * 12, kv__prefix_caching=False, scheduler__prefill_chunk_size=4
    )
    engine.add_request(prompt(30), SamplingParams(max_tokens=3), request_id="big")  # 8 pages of 12
    engine.add_request(prompt(9, 100), SamplingParams(max_tokens=4), request_id="X")  # 3 pages
    pred = {
        "waiting": lambda r: True,
        "prefill_mid_chunk": lambda r: r.stage.value == "prefill" and 0 < r.num_prefilled < len(r.prompt),
        "coda_first": lambda r: r.stage.value == "coda" and not r.outputs,
        "prelude": lambda r: r.stage.value == "prelude",
        "recurrent": lambda r: r.stage.value == "recurrent" and r.loops_done == 2,
        "coda": lambda r: r.stage.value == "coda" and len(r.outputs) == 2,
    }[where]
    if where == "waiting":
        engine.add_request(prompt(9, 150), SamplingParams(max_tokens=4), request_id="W")  # no room yet
        engine.step()
        rid = "W"
        assert engine.requests["W"].stage.value == "waiting"
    else:
        rid = "X"
        _step_until(engine, rid, pred)
    req = engine.requests[rid]
    held = sum(len(t) for t in engine.blocks.seqs[rid].tables) if rid in engine.blocks.seqs else 0
    free_before, slots_before = len(engine.blocks.free), len(engine.runner.free_slots)
    n_steps = len(rec.steps)
    engine.abort_request(rid)
    assert rid not in engine.blocks.seqs
    assert len(engine.blocks.free) == free_before + held
    assert len(engine.runner.free_slots) == slots_before + (where != "waiting")
    assert req.stage.value == "finished" and req.finish_reason == "abort" and req.state_slot == -1
    aborted = [e for e in rec.events if e.kind == "aborted"]
    assert [(e.request_id, e.reason) for e in aborted] == [(rid, "abort")]
    assert all(rid not in q for q in (engine.scheduler.waiting, *engine.scheduler.queues.values()))
    engine.abort_request(rid)  # idempotent
    assert len([e for e in rec.events if e.kind == "aborted"]) == 1
    drain(engine)
    assert all(rid not in s.request_ids for s in rec.steps[n_steps:])
    assert engine.requests["big"].finish_reason == "length"
    assert len(engine.blocks.free) == engine.blocks.num_blocks and not engine.blocks.seqs


# --- EOS ----------------------------------------------------------------------------------------------------
def test_eos_stops_unless_ignored():
    p = prompt(11, 33)
    engine, _ = make_engine()
    free_run = engine.generate([p], SamplingParams(max_tokens=6))[0]
    # the first token that differs from all earlier ones becomes the EOS id
    idx = next(i for i, t in enumerate(free_run) if i > 0 and t not in free_run[:i])
    spec = with_overrides(PRESETS["ouro-tiny"], eos_token_ids=(free_run[idx],))
    engine, rec = make_engine(spec=spec)
    rid = engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=False))
    drain(engine)
    req = engine.requests[rid]
    assert req.outputs == free_run[: idx + 1] and req.finish_reason == "stop"
    assert [(e.kind, e.reason) for e in rec.events if e.kind == "finished"] == [("finished", "stop")]
    assert not engine.blocks.seqs
    # same EOS on the first token: stops after one token; ignore_eos=True runs to max_tokens
    spec0 = with_overrides(PRESETS["ouro-tiny"], eos_token_ids=(free_run[0],))
    engine, _ = make_engine(spec=spec0)
    a = engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=False))
    b = engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
    drain(engine)
    assert engine.requests[a].outputs == free_run[:1] and engine.requests[a].finish_reason == "stop"
    assert engine.requests[b].outputs == free_run and engine.requests[b].finish_reason == "length"


def test_request_that_passes_validation_is_eventually_served_with_a_watermark():
    """Regression: max_model_len ignored kv.watermark_blocks, so a request that fit the pool but not
    pool - watermark passed add_request and then was never admitted (the engine spun forever)."""
    engine, _ = _pool_engine(5, kv__watermark_blocks=4)  # 20 blocks, 4 kept free at admission
    with pytest.raises(EngineInputError, match="max context is 16"):
        engine.add_request(prompt(17), SamplingParams(max_tokens=4))  # 20 positions = the whole pool
    rid = engine.add_request(prompt(13), SamplingParams(max_tokens=4))  # 16 positions = pool - watermark
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert engine.requests[rid].finish_reason == "length"


# --- active-request cap, round-robin prefill, gate default ---------------------------------------------
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seats=st.integers(1, 5),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=14),
    aborts=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 40)), max_size=6),
)
def test_active_requests_never_exceed_max_num_seqs(seats, lengths, aborts):
    """Requests beyond `max_num_seqs` wait; aborts free seats; nothing crashes; every request ends."""
    engine, rec = make_engine(scheduler__max_num_seqs=seats)
    ids = [engine.add_request(prompt(n, 10 + i), SamplingParams(max_tokens=3)) for i, n in enumerate(lengths)]
    abort_at = {step: ids[i % len(ids)] for i, step in aborts}
    for step in range(5000):
        if step in abort_at:
            engine.abort_request(abort_at[step])
        active = [r for r in engine.requests.values() if r.stage.value not in ("waiting", "finished")]
        assert len(active) == len(engine.scheduler.running) <= seats
        assert len(engine.runner.free_slots) == seats - len(active)
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert all(r.is_finished for r in engine.requests.values())
    admitted_at_once = 0
    live: set[str] = set()
    for e in rec.events:
        if e.kind == "admitted":
            live.add(e.request_id)
        elif e.kind in ("finished", "aborted"):
            live.discard(e.request_id)
        admitted_at_once = max(admitted_at_once, len(live))
    assert admitted_at_once <= seats


def test_more_requests_than_any_slot_pool_wait_instead_of_crashing():
    """4,200 one-token requests (the old engine crashed past 4,096 admitted: 'no carried-state slot')."""
    engine, rec = make_engine(scheduler__max_num_seqs=64)
    for i in range(4200):
        engine.add_request([3 + i % 400], SamplingParams(max_tokens=1))
    drain(engine, limit=100_000)
    assert len(rec.kinds("finished")) == 4200
    assert max(s.num_rows for s in rec.steps) <= 64


def test_unfinished_prefill_chunks_go_to_the_tail_round_robin():
    """Two 400-token prompts with a 128-token budget: A, B, A, B, A, B, then both tails in one batch."""
    engine, rec = make_engine(scheduler__max_num_batched_tokens=128, scheduler__prefill_chunk_size=128)
    engine.add_request(prompt(400), SamplingParams(max_tokens=1), request_id="A")
    engine.add_request(prompt(400, 20), SamplingParams(max_tokens=1), request_id="B")
    drain(engine)
    prefills = [s.request_ids for s in rec.steps if s.stage == "prefill"]
    assert prefills == [["A"], ["B"], ["A"], ["B"], ["A"], ["B"], ["A", "B"]]


def test_gate_policy_is_the_default_and_reads_the_gate_back_every_recurrent_step():
    from looptrace.recipes import load_recipe

    assert EngineConfig().exit.policy == "gate" == load_recipe("base").config.exit.policy
    calls = {}
    for policy in ("gate", "fixed"):
        engine, rec = make_engine(exit__policy=policy)
        count = [0]
        engine.runner.ops.gate_readback.register_forward_hook(lambda *a, c=count: c.__setitem__(0, c[0] + 1))
        engine.add_request(prompt(5), SamplingParams(max_tokens=4))
        drain(engine)
        calls[policy] = (count[0], engine.requests[next(iter(engine.requests))].outputs)
    recurrent_steps = 4 * 3  # 3 decoded tokens x 4 loops
    assert calls["gate"][0] == recurrent_steps and calls["fixed"][0] == 0
    assert calls["gate"][1] == calls["fixed"][1]  # threshold 1.0: the same tokens (R0)
    # Huginn has no gate: `gate` runs every token to max_loops, with no readback.
    engine, _ = make_engine("huginn-tiny")
    assert not engine.exit_policy.needs_gate
