"""CUDA-graph behaviour on a GPU: capture/replay/fallback counters and graph replay == eager, bit for bit."""

from __future__ import annotations

import pytest
import torch

from looptrace.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu


def _engine(preset: str, graphs: bool, **exit_kw) -> LLMEngine:
    cfg = EngineConfig()
    cfg.cuda_graphs.enabled = graphs
    cfg.scheduler.max_model_len = 256
    cfg.kv.num_blocks = 4096
    for k, v in exit_kw.items():
        setattr(cfg.exit, k, v)
    return LLMEngine.from_preset(preset, cfg, device="cuda", seed=1)


def test_huginn_one_request_five_positions_three_depths_counts():
    """Base-engine check: 5 fed-back positions x 3 loops = 15 recurrent steps -> 1 capture, 15 replays."""
    eng = _engine("huginn-tiny", True, max_loops=3)
    eng.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(max_tokens=6, seed=7))
    rec = eng.graph_counters()["recurrent"]
    assert (rec["captures"], rec["replays"], rec["fallbacks"]) == (1, 15, 0)


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"])
def test_graph_replay_equals_eager_bitwise(preset):
    prompts = [[3 + i + j for j in range(5 + 3 * i)] for i in range(5)]
    outs = []
    for graphs in (True, False):
        eng = _engine(preset, graphs)
        outs.append(eng.generate(prompts, SamplingParams(max_tokens=8, seed=11)))
    assert outs[0] == outs[1]


def test_budget_full_falls_back_with_reason():
    cfg = EngineConfig()
    cfg.cuda_graphs.max_graphs = 1
    cfg.cuda_graphs.coda = False
    cfg.scheduler.max_model_len = 128
    eng = LLMEngine.from_preset("ouro-tiny", cfg, device="cuda", seed=1)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    while eng.has_unfinished_requests():
        eng.step()
    [eng.add_request([4, 5, 6 + i], SamplingParams(max_tokens=3)) for i in range(2)]
    while eng.has_unfinished_requests():
        eng.step()
    rec = eng.graph_counters()["recurrent"]
    assert rec["captures"] == 1 and rec["fallbacks"] > 0
    assert set(rec["fallback_reasons"]) == {"budget_full"}
    torch.cuda.synchronize()
