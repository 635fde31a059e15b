"""The engine plan (engine/plan.py): every effective choice resolved once, read by the engine, the runner and
the snapshot; and `LLMEngine.forget`, which drops a finished request's record."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from looptrace.engine import SamplingParams
from looptrace.engine.model_config import resolve_preset
from looptrace.engine.plan import (
    ASYNC_GATE,
    ASYNC_WHOLE_TOKEN,
    FUSED_LOOPS,
    RECURRENT,
    WHOLE_TOKEN,
    resolve_plan,
)
from looptrace.engine.request import Stage
from tests.helpers import build_config, build_engine

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "settings, mode",
    [
        ({}, ASYNC_GATE),
        ({"scheduler__async_gate": False}, RECURRENT),
        ({"kv__layout": "shared"}, RECURRENT),  # a speculative loop cannot be rolled back there
        ({"scheduler__loop_fusion": True}, FUSED_LOOPS),
        ({"scheduler__loop_fusion": True, "scheduler__whole_token": True}, WHOLE_TOKEN),
        (
            {"scheduler__loop_fusion": True, "scheduler__whole_token": True, "scheduler__async_decode": True},
            ASYNC_WHOLE_TOKEN,
        ),
    ],
)
def test_one_decode_mode_holds_for_each_recipe(settings, mode):
    plan = resolve_plan(build_config(**settings), resolve_preset("ouro-tiny", "cpu"), CPU, kernels_on=False)
    assert plan.decode_mode == mode
    whole_token = mode in (WHOLE_TOKEN, ASYNC_WHOLE_TOKEN)
    assert plan.decode_entry == (Stage.RECURRENT if whole_token else Stage.PRELUDE)


def test_settings_without_effect_on_cpu_are_in_the_plan():
    cfg = build_config(kernels__exact=True, kernels__attention="triton", kernels__residual_norm=True)
    plan = resolve_plan(cfg, resolve_preset("ouro-tiny", "cpu"), CPU, kernels_on=False)
    assert list(plan.inactive_settings) == [
        "kernels.exact",
        "kernels.attention",
        "kernels.residual_norm",
        "cuda_graphs",
    ]
    assert not plan.exact_kernels and not plan.triton_attention and plan.fused_tails == ()
    assert plan.graphs == frozenset()


def test_the_engine_and_its_runner_read_one_plan():
    eng = build_engine("ouro-tiny", scheduler__loop_fusion=True, scheduler__whole_token=True)
    assert eng.runner.plan is eng.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        eng.plan.whole_token = False  # type: ignore[misc]
    assert eng.whole_token and eng.fuse_loops and not eng.async_gate
    assert eng.max_loops == eng.plan.max_loops == eng.runner.max_loops
    assert eng.snapshot().decode.whole_token and eng.snapshot().decode.steps_per_token == 1


def test_forget_drops_a_finished_request_and_keeps_a_running_one():
    eng = build_engine("ouro-tiny")
    done = eng.add_request([3, 4, 5], SamplingParams(max_tokens=2))
    running = eng.add_request([6, 7, 8], SamplingParams(max_tokens=50))
    while not eng.requests[done].is_finished:
        eng.step()
    eng.forget(running)  # still running: kept
    eng.forget(done)
    eng.forget("no-such-request")
    assert done not in eng.requests and running in eng.requests
    eng.abort_request(running)
    eng.forget(running)
    assert eng.requests == {} and not eng.has_unfinished_requests()
