"""LoopDuet split depth (S, P) on the shared KV layout (phase 2): (S, S) is bitwise the uniform
engine, (S, P) runs P loops on ordinary prompt rows and S on every chunk endpoint, and the queue-age
controller sets P before each step and reports it through the hooks."""

from __future__ import annotations

import time

import pytest
import torch

from looptrace.engine.config import ConfigError, DepthConfig, EngineConfig, KVConfig, SchedulerConfig
from looptrace.engine.hooks import Observer
from looptrace.engine.llm_engine import EngineInputError, LLMEngine
from looptrace.engine.request import SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((20, 13, 9))]


class Recorder(Observer):
    wants_hidden = True

    def __init__(self) -> None:
        self.hidden: dict[tuple[str, str, int, int], torch.Tensor] = {}
        self.depth: list = []

    def on_loop_hidden(self, stage, loop_index, request_ids, positions, hidden) -> None:
        for i, (rid, pos) in enumerate(zip(request_ids, positions)):
            self.hidden[(stage, rid, loop_index, pos)] = hidden[i].clone()

    def on_depth(self, event) -> None:
        self.depth.append(event)


def _run(depth: DepthConfig | None, chunk: int = 8, prompts=PROMPTS):
    cfg = EngineConfig(
        kv=KVConfig(layout="shared"),
        scheduler=SchedulerConfig(prefill_chunk_size=chunk, max_num_batched_tokens=16),
        depth=depth or DepthConfig(),
    )
    engine = LLMEngine.from_preset("huginn-tiny", cfg, device="cpu", seed=0)
    rec = Recorder()
    engine.attach(rec)
    out = engine.generate(prompts, SamplingParams(max_tokens=3))
    return out, rec, engine


def test_s_s_is_bitwise_uniform_depth():
    torch.set_num_threads(1)
    base, rb, _ = _run(None)
    same, rs, _ = _run(DepthConfig(prefill_loops=8))
    assert base == same
    assert rb.hidden.keys() == rs.hidden.keys()
    assert all(torch.equal(rb.hidden[k], rs.hidden[k]) for k in rb.hidden)


def test_split_runs_p_loops_except_chunk_endpoints():
    out, rec, engine = _run(DepthConfig(prefill_loops=3))
    s = engine.max_loops
    assert s == 8
    for (stage, rid, loop, pos), _ in rec.hidden.items():
        if stage != "prefill" or loop < 3:
            continue
        req = engine.requests[rid]
        endpoint = pos == len(req.prompt) - 1 or (pos + 1) % 8 == 0  # chunks of 8 end at 7, 15, ... and L-1
        assert endpoint, (rid, loop, pos)
    # every prompt position has its P loops; endpoints all S loops
    for rid, req in engine.requests.items():
        for pos in range(len(req.prompt)):
            loops = {loop for (st, r, loop, q) in rec.hidden if st == "prefill" and r == rid and q == pos}
            endpoint = pos == len(req.prompt) - 1 or (pos + 1) % 8 == 0
            assert loops == set(range(s if endpoint else 3)), (rid, pos, sorted(loops))
    assert all(len(o) == 3 for o in out)


def test_split_changes_arithmetic_only_for_p_below_s():
    base, _, _ = _run(None)
    split, _, _ = _run(DepthConfig(prefill_loops=2))
    assert len(split) == len(base)  # runs; tokens may differ (R3)


def test_queue_age_controller_drops_under_load_and_recovers():
    cfg = EngineConfig(
        kv=KVConfig(layout="shared"),
        depth=DepthConfig(controller="queue_age", p_max=8, p_min=2),
    )
    engine = LLMEngine.from_preset("huginn-tiny", cfg, device="cpu", seed=0)
    rec = Recorder()
    engine.attach(rec)
    params = SamplingParams(max_tokens=2)
    engine.add_request(PROMPTS[1], params)  # fresh: q ~ 0 -> P_max
    engine.step()
    assert rec.depth[-1].prefill_loops == 8
    while engine.has_unfinished_requests():
        engine.step()
    now = time.perf_counter()
    for prompt in PROMPTS:  # a burst that has already waited 3 s (z = 1) -> P_min
        engine.add_request(prompt, params, arrival_time=now - 3.0)
    engine.step()
    assert rec.depth[-1].prefill_loops == 2 and rec.depth[-1].queue_age_s >= 3.0
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(PROMPTS[2], params)  # the burst is served: P recovers
    engine.step()
    assert rec.depth[-1].prefill_loops == 8
    assert [e.decode_loops for e in rec.depth] == [8] * len(rec.depth)


def test_depth_config_errors():
    with pytest.raises(ConfigError, match="kv.layout=shared"):
        EngineConfig(depth=DepthConfig(prefill_loops=2))
    with pytest.raises(ConfigError, match="q_high"):
        DepthConfig(q_low=1.0, q_high=0.5)
    cfg = EngineConfig(kv=KVConfig(layout="shared"), depth=DepthConfig(prefill_loops=9))
    with pytest.raises(EngineInputError, match="exceeds S"):
        LLMEngine.from_preset("huginn-tiny", cfg, device="cpu")
