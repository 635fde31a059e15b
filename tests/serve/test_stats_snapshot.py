"""The engine loop's stats snapshot (/v1/stats, /metrics, the dashboard) built from `LLMEngine.snapshot()`,
without a server: `EngineLoop` publishes one at construction."""

from __future__ import annotations

import pytest

from looptrace.engine import SamplingParams
from looptrace.serve.engine_loop import EngineLoop
from tests.helpers import build_engine, stand_in_graphs


@pytest.mark.parametrize(
    "settings, family, runner_attr, pass_name",
    [
        ({"loop_fusion": True}, "recurrent_fused", "fused_graphs", "fused_pass"),
        ({"loop_fusion": True, "whole_token": True}, "whole_token", "token_graphs", "token_pass"),
    ],
)
def test_stats_count_the_graphs_each_family_holds(settings, family, runner_attr, pass_name):
    # The snapshot looked the caches up as `runner.<family>_graphs`: the fused and whole-token caches are
    # `fused_graphs` and `token_graphs`, so their held graphs always showed 0 whatever was captured.
    eng = build_engine(
        "ouro-tiny",
        noise="zeros",
        scheduler__max_model_len=64,
        **{f"scheduler__{k}": v for k, v in settings.items()},
    )
    setattr(eng.runner, runner_attr, stand_in_graphs(family, getattr(eng.runner.passes, pass_name)))
    eng.runner.fixed_width = -(-eng.max_model_len // eng.cfg.kv.block_size)  # as on CUDA
    eng.generate([[3, 4, 5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=4))
    cache = EngineLoop(eng).snapshot()["graphs"]["caches"][family]
    assert cache["captures"] == 1 and cache["replays"] == 3
    assert cache["graphs"] == 1


def test_stats_sections_match_the_engine_counters():
    eng = build_engine("ouro-tiny", scheduler__max_num_seqs=2, scheduler__max_model_len=128)
    for i in range(3):
        eng.add_request(list(range(1, 21)), SamplingParams(max_tokens=2), request_id=f"r{i}")
    eng.step()
    snap = EngineLoop(eng).snapshot()
    assert (snap["requests"]["running"], snap["requests"]["waiting"]) == (2, 1)
    assert [r["id"] for r in snap["requests"]["list"]] == ["r0", "r1", "r2"]
    assert snap["requests"]["list"][0] | {"age_s": 0} == {
        "id": "r0",
        "stage": "coda",
        "loop": 4,
        "max_loops": 4,
        "tokens": 0,
        "max_tokens": 2,
        "prompt_tokens": 20,
        "age_s": 0,
    }
    kv = eng.kv_blocks()
    assert {k: snap["kv"][k] for k in kv} == kv and snap["kv"]["usage"] == kv["request_blocks"] / kv[
        "num_blocks"
    ]
    assert snap["engine"] == {
        "steps": 1,
        "submissions": 1,
        "output_tokens": 0,
        "steps_per_token": None,
        "submissions_per_token": None,
        "steps_by_stage": {"prefill": 1},
    }
    assert snap["prefix"] == {
        "enabled": True,
        "hit_tokens": 0,
        "query_tokens": 40,
        "hit_rate": 0.0,
        "evictions": 0,
    }
    assert snap["graphs"] == {"enabled": False, "caches": {}} and snap["prefill_depth"] == 4.0
