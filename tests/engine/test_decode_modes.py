"""One class per stage and per decode mode (engine/decode_modes.py), picked by the plan's decode mode."""

from __future__ import annotations

import pytest

from looptrace.engine import SamplingParams, plan
from looptrace.engine.decode_modes import (
    DECODE_MODES,
    AsyncGate,
    AsyncWholeToken,
    FusedLoops,
    OneLoop,
    WholeToken,
)
from looptrace.engine.request import Stage
from tests.helpers import build_engine

MODES = [
    ({"scheduler__async_gate": False}, plan.RECURRENT, OneLoop),
    ({"scheduler__async_gate": True, "exit__threshold": 0.5}, plan.ASYNC_GATE, AsyncGate),
    ({"scheduler__loop_fusion": True}, plan.FUSED_LOOPS, FusedLoops),
    ({"scheduler__loop_fusion": True, "scheduler__whole_token": True}, plan.WHOLE_TOKEN, WholeToken),
    (
        {"scheduler__loop_fusion": True, "scheduler__whole_token": True, "scheduler__async_decode": True},
        plan.ASYNC_WHOLE_TOKEN,
        AsyncWholeToken,
    ),
]


def test_every_decode_mode_of_the_plan_has_a_class():
    modes = {plan.RECURRENT, plan.ASYNC_GATE, plan.FUSED_LOOPS, plan.WHOLE_TOKEN, plan.ASYNC_WHOLE_TOKEN}
    assert set(DECODE_MODES) == modes


@pytest.mark.parametrize("settings, mode, cls", MODES, ids=[m for _, m, _ in MODES])
def test_the_engine_runs_recurrent_batches_with_its_decode_mode(settings, mode, cls):
    engine = build_engine("ouro-tiny", **settings)
    assert engine.plan.decode_mode == mode and type(engine.decode) is cls
    assert engine.stage_runs[Stage.RECURRENT] is engine.decode
    out = engine.generate([[5, 9, 13, 7]], SamplingParams(max_tokens=3))
    assert len(out[0]) == 3 and engine.decode.in_flight is None  # every read in flight was settled


def test_a_read_in_flight_keeps_its_request_unfinished_until_drained():
    engine = build_engine(
        "ouro-tiny", scheduler__loop_fusion=True, scheduler__whole_token=True, scheduler__async_decode=True
    )
    engine.add_request([5, 9, 13, 7], SamplingParams(max_tokens=2))
    while engine.decode.in_flight is None:
        engine.step()
    assert engine.has_unfinished_requests() and engine.decode.holds_requests()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.decode.in_flight is None and not engine.decode.holds_requests()
