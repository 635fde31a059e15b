"""Prefill chunks as CUDA graphs (cuda_graphs.prefill, R0). On CPU a stand-in graph cache runs the captured
body eagerly on static buffers (what a replay computes), so the graphed prefill path (metadata over every
plane, prelude, depth-major loops, eager noise draw, coda fill, state hand-off) is checked against the
eager chunk bit for bit. The real capture: tests/engine/test_gpu_graphs.py."""

from __future__ import annotations

import pytest
import torch

from looptrace.engine import LLMEngine, Observer, SamplingParams
from looptrace.engine.cuda_graphs import GraphCache
from tests.helpers import build_engine, stand_in_graphs

PROMPTS = [[3 + i + j for j in range(5 + 4 * i)] for i in range(4)]


def stand_in(eng: LLMEngine) -> GraphCache:
    """A prefill graph cache whose capture keeps static buffers and whose replay re-runs the body."""
    return stand_in_graphs("prefill", eng.runner.passes.prefill_pass)


def run(preset: str, graphed: bool, **settings):
    # max_model_len 64: full-width tables of 4 pages, 2 more than the longest request needs (the default 4096
    # gives 256-page tables, and the stand-in replays attend over all of them: 10x the time on CPU)
    eng = build_engine(
        preset, noise="sequential", scheduler__prefill_chunk_size=7, scheduler__max_model_len=64, **settings
    )
    if graphed:  # as on CUDA: graphs gather full-width tables
        eng.runner.prefill_graphs = stand_in(eng)
        eng.runner.fixed_width = -(-eng.max_model_len // eng.cfg.kv.block_size)
    tokens = eng.generate(PROMPTS, SamplingParams(max_tokens=4, seed=5))
    kv = (eng.pool.k_cache.clone(), eng.pool.v_cache.clone())
    return eng, tokens, kv


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"])
@pytest.mark.parametrize("layout", ["planes", "packed", "shared"])
def test_graphed_prefill_equals_the_eager_chunk_bitwise(preset, layout):
    eager, tokens, kv = run(preset, False, kv__layout=layout)
    graphed, g_tokens, g_kv = run(preset, True, kv__layout=layout)
    assert g_tokens == tokens
    assert torch.equal(g_kv[0], kv[0]) and torch.equal(g_kv[1], kv[1])  # every KV slot, every plane
    counters = graphed.runner.prefill_graphs.counters
    # one replay per prefill chunk (the shared layout: per position of the chunk), none eager
    assert counters.replays >= graphed.stats.steps_by_stage["prefill"] >= 3 and counters.fallbacks == 0


def test_hidden_observers_and_split_depth_keep_the_eager_chunk():
    eng = build_engine("huginn-tiny", noise="zeros", kv__layout="shared", depth__prefill_loops=2)
    eng.runner.prefill_graphs = stand_in(eng)
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=2))
    assert eng.runner.prefill_graphs.counters.replays == 0  # split depth (S, P): eager

    eng = build_engine("ouro-tiny")
    eng.runner.prefill_graphs = stand_in(eng)
    seen = []

    class Hidden(Observer):
        wants_hidden = True

        def on_loop_hidden(self, stage, loop_index, request_ids, positions, hidden):
            seen.append((stage, loop_index))

    eng.attach(Hidden())
    eng.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    assert eng.runner.prefill_graphs.counters.replays == 0
    assert [t for st, t in seen if st == "prefill"] == list(range(eng.max_loops))
