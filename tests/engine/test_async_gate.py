"""Async gate readback (scheduler.async_gate, R1; the base engine's `_step_async` for Ouro): the next loop is
submitted before the last gate logit is read, and a token found to have exited one loop late is rolled
back to its exit loop."""

from __future__ import annotations

import pytest

from looptrace.engine import LLMEngine, Observer, SamplingParams
from tests.helpers import Recorder, build_engine

PROMPTS = [[5 + i, 9, 13 + 2 * i, 7, 21, 3 + i] for i in range(6)]


def engine(async_gate: bool, threshold: float = 1.0, **settings) -> LLMEngine:
    return build_engine(
        "ouro-tiny",
        scheduler__async_gate=async_gate,
        exit__threshold=threshold,
        exit__min_loops=1,
        **settings,
    )


def run(eng: LLMEngine) -> tuple[list, list, list]:
    batched = eng.generate(PROMPTS, SamplingParams(max_tokens=10))
    solo = [eng.generate([p], SamplingParams(max_tokens=10))[0] for p in PROMPTS[:2]]
    depths = [r.exit_depths for r in eng.requests.values()]
    return batched, solo, depths


@pytest.mark.parametrize("threshold", [1.0, 0.5, 0.3])
def test_same_tokens_and_exit_depths_as_the_synchronous_gate(threshold, monkeypatch):
    sync = run(engine(False, threshold))
    eng = engine(True, threshold)
    rolled = []
    real = eng.runner.rollback
    monkeypatch.setattr(eng.runner, "rollback", lambda reqs: (rolled.extend(reqs), real(reqs)))
    assert run(eng) == sync
    depths = [d for ds in sync[2] for d in ds]
    if threshold < 1.0:  # early exits happened, and some were found after a speculative loop had run
        assert min(depths) < eng.max_loops and rolled
    else:
        assert set(depths) == {eng.max_loops} and not rolled


def test_at_full_depth_the_steps_are_those_of_the_synchronous_gate():
    stages = []
    for async_gate in (False, True):
        eng = engine(async_gate)
        log = Recorder()
        eng.attach(log)
        eng.generate(PROMPTS[:3], SamplingParams(max_tokens=6))
        stages.append(log.stages)
    assert stages[0] == stages[1]


def test_only_models_with_a_gate_defer_it():
    assert engine(True).async_gate
    assert not engine(True, exit__policy="fixed").async_gate
    assert not build_engine("huginn-tiny", scheduler__async_gate=True).async_gate
    assert not engine(True, scheduler__loop_fusion=True).async_gate  # fused rows read no gate
    # shared layout: a speculative loop would overwrite the token's one KV slot (a hypothesis stream of
    # tests/engine/test_kv_invariants.py found the corrupted token when it was allowed)
    assert not engine(True, kv__layout="shared").async_gate
    assert engine(True, kv__layout="packed").async_gate


def test_abort_with_a_gate_in_flight_frees_the_request():
    eng = engine(True, 0.3)
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=20))
    other = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=4))
    while eng.decode.in_flight is None:  # run until a recurrent step left its gate unread
        eng.step()
    eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.requests[rid].finish_reason == "abort" and len(eng.requests[other].outputs) == 4
    assert not eng.blocks.seqs  # every request's KV released


class Hidden(Observer):
    wants_hidden = True

    def __init__(self) -> None:
        self.loops: list = []

    def on_loop_hidden(self, stage, loop_index, request_ids, positions, hidden):
        self.loops.append((stage, loop_index, tuple(request_ids)))


def test_hidden_state_observers_see_no_speculative_loop():
    seen = {}
    for async_gate in (False, True):
        eng = engine(async_gate, 0.3)
        hidden = Hidden()
        eng.attach(hidden)
        eng.generate(PROMPTS[:2], SamplingParams(max_tokens=6))
        seen[async_gate] = hidden.loops
    assert seen[True] == seen[False]
