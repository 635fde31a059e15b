"""`LLMEngine.snapshot()`: the typed view clients read between steps, checked against a real tiny run with
counts derived by hand (ouro: 4 layers, 4 loops, block 16, `planes` layout = 4 pool blocks per page)."""

from __future__ import annotations

import dataclasses

import pytest

from looptrace.engine import SamplingParams
from looptrace.engine.snapshot import (
    DecodeMode,
    GraphFamily,
    PlaneSlots,
    QueueCounts,
    RequestOutputs,
    SchedulerLimits,
)
from tests.helpers import build_engine, stand_in_graphs

PROMPT = list(range(1, 21))  # 20 tokens; with max_tokens 2, 21 KV positions: 2 pages of 16


@pytest.fixture
def engine():
    eng = build_engine("ouro", scheduler__max_num_seqs=2, scheduler__max_model_len=128)
    for i in range(3):
        eng.add_request(PROMPT, SamplingParams(max_tokens=2), request_id=f"r{i}")
    return eng


def test_before_any_step_every_request_waits_and_the_pool_is_free(engine):
    snap = engine.snapshot()
    assert snap.queues == QueueCounts(waiting=3, running=0)
    assert [r.request_id for r in snap.requests] == ["r0", "r1", "r2"]
    assert snap.by_stage() == {"waiting": 3} and snap.by_loop() == {0: 3}
    assert (snap.stats.steps, snap.stats.submissions, snap.stats.output_tokens) == (0, 0, 0)
    assert (snap.kv.num_blocks, snap.kv.used_blocks, snap.kv.free_blocks) == (2048, 0, 2048)
    assert snap.kv.usage == 0.0 and snap.prefix.query_tokens == 0


def test_after_the_prefill_step_two_requests_run_with_their_pages(engine):
    engine.step()  # admits r0, r1 (max_num_seqs 2) and prefills both prompts through all 4 loops
    snap = engine.snapshot()
    assert snap.queues == QueueCounts(waiting=1, running=2)
    scheduler = engine.scheduler
    assert (snap.queues.waiting, snap.queues.running) == (len(scheduler.waiting), len(scheduler.running))
    assert snap.by_stage() == {"coda": 2, "waiting": 1} and snap.by_loop() == {4: 2, 0: 1}
    r0 = snap.requests[0]
    assert (r0.stage, r0.loop, r0.tokens, r0.max_tokens, r0.prompt_tokens) == ("coda", 4, 0, 2, 20)
    assert r0.arrival_time == engine.requests["r0"].arrival_time
    assert (snap.stats.steps, snap.stats.submissions, dict(snap.stats.steps_by_stage)) == (
        1,
        1,
        {"prefill": 1},
    )
    # 2 requests x 2 pages x 4 planes = 16 blocks; per plane 16 / 4 * 16 = 64 tokens x 4 live layers
    assert (snap.kv.layout, snap.kv.num_planes, snap.kv.blocks_per_page, snap.kv.block_size) == (
        "planes",
        4,
        4,
        16,
    )
    assert (snap.kv.used_blocks, snap.kv.request_blocks, snap.kv.cached_blocks, snap.kv.free_blocks) == (
        16,
        16,
        0,
        2032,
    )
    assert snap.kv.planes == tuple(PlaneSlots(p, 256, 0) for p in range(4))
    assert snap.kv.usage == 16 / 2048
    kv = engine.kv_blocks()
    assert {k: getattr(snap.kv, k) for k in kv} == kv
    assert (snap.prefix.enabled, snap.prefix.hit_tokens, snap.prefix.query_tokens) == (True, 0, 40)


def test_decode_steps_move_requests_loop_by_loop(engine):
    engine.step()
    engine.step()  # coda: the first token of r0 and r1
    engine.step()  # prelude of the second token
    assert engine.snapshot().by_loop() == {0: 3}
    engine.step()  # first recurrent loop
    snap = engine.snapshot()
    assert snap.by_stage() == {"recurrent": 2, "waiting": 1} and snap.by_loop() == {1: 2, 0: 1}
    assert snap.stats.output_tokens == 2 and snap.requests[0].tokens == 1
    assert dict(snap.stats.steps_by_stage) == {"prefill": 1, "coda": 1, "prelude": 1, "recurrent": 1}


def test_finished_requests_leave_the_snapshot_and_the_prefix_cache_hits(engine):
    for _ in range(8):  # prefill, coda, prelude, 4 loops, coda: r0 and r1 finish (max_tokens 2)
        engine.step()
    snap = engine.snapshot()
    assert snap.queues == QueueCounts(waiting=1, running=0) and [r.request_id for r in snap.requests] == [
        "r2"
    ]
    # the one full page of the shared prompt stays in the prefix cache: 1 page x 4 planes
    assert (snap.kv.used_blocks, snap.kv.request_blocks, snap.kv.cached_blocks) == (4, 0, 4)
    assert snap.prefix.cached_blocks == 4 and snap.kv.planes == tuple(PlaneSlots(p, 0, 0) for p in range(4))
    engine.step()  # r2 is admitted with the cached page (16 of its 20 prompt tokens)
    snap = engine.snapshot()
    assert (snap.prefix.hit_tokens, snap.prefix.query_tokens, snap.prefix.hit_rate) == (16, 60, 16 / 60)
    assert snap.prefix.counters() == dict(engine.blocks.stats)
    assert (snap.kv.request_blocks, snap.kv.cached_blocks) == (8, 0)


def test_a_snapshot_is_a_copy_that_later_steps_do_not_change(engine):
    engine.step()
    snap = engine.snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.stats.steps = 5  # type: ignore[misc]
    engine.step()
    assert snap.stats.steps == 1 and dict(snap.stats.steps_by_stage) == {"prefill": 1}
    assert snap.requests[0].stage == "coda" and engine.snapshot().requests[0].stage == "prelude"


def test_an_engine_without_a_persistent_loop_op_reports_no_loop_routes(engine):
    engine.step()
    assert engine.snapshot().loop_routes == {}  # a CPU engine: the loop op is never attached


def test_limits_are_the_scheduler_settings_and_the_resolved_context(engine):
    # max_num_seqs and max_model_len as the fixture set them; the token budget and chunk size by default
    assert engine.snapshot().limits == SchedulerLimits(
        max_num_seqs=2, max_num_batched_tokens=128, prefill_chunk_size=128, max_model_len=128
    )
    small = build_engine("ouro", scheduler__prefill_chunk_size=8, scheduler__max_num_batched_tokens=16)
    limits = small.snapshot().limits
    assert (limits.max_num_seqs, limits.prefill_chunk_size, limits.max_num_batched_tokens) == (8, 8, 16)
    assert limits.max_model_len == small.max_model_len


def test_request_view_follows_one_request_to_its_finish_and_is_a_copy(engine):
    waiting = engine.request_view("r0")
    assert waiting == RequestOutputs("r0", "waiting", None, prompt_tokens=20, cached_tokens=0, outputs=())
    assert (waiting.finished, waiting.context_tokens) == (False, 20)
    emitted: dict[str, list[int]] = {}
    for _ in range(8):  # prefill, coda, prelude, 4 loops, coda: r0 and r1 finish (max_tokens 2)
        for out in engine.step():
            emitted.setdefault(out.request_id, []).append(out.token_id)
    done = engine.request_view("r0")
    assert (done.stage, done.finish_reason, done.finished) == ("finished", "length", True)
    assert list(done.outputs) == emitted["r0"] and len(done.outputs) == 2 and done.context_tokens == 22
    engine.step()  # r2 is admitted with the cached page (16 of its 20 prompt tokens) and prefilled
    r2 = engine.request_view("r2")
    assert (r2.stage, r2.cached_tokens, r2.outputs) == ("coda", 16, ())
    engine.step()  # r2's first token: the view taken before does not change
    assert r2.outputs == () and len(engine.request_view("r2").outputs) == 1
    engine.forget("r0")
    with pytest.raises(KeyError):
        engine.request_view("r0")


@pytest.mark.parametrize(
    "settings, mode, steps_per_token",
    [
        ({}, DecodeMode(4, fuse_loops=False, whole_token=False, async_gate=True, async_decode=False), 6),
        (
            {"loop_fusion": True},
            DecodeMode(4, fuse_loops=True, whole_token=False, async_gate=False, async_decode=False),
            3,
        ),
        (
            {"loop_fusion": True, "whole_token": True, "async_decode": True},
            DecodeMode(4, fuse_loops=True, whole_token=True, async_gate=False, async_decode=True),
            1,
        ),
    ],
)
def test_decode_mode_reports_the_resolved_settings(settings, mode, steps_per_token):
    eng = build_engine("ouro-tiny", **{f"scheduler__{k}": v for k, v in settings.items()})
    assert eng.snapshot().decode == mode
    assert mode.steps_per_token == steps_per_token


def test_graph_families_count_captures_replays_and_held_graphs():
    eng = build_engine(
        "ouro-tiny",
        noise="zeros",
        scheduler__loop_fusion=True,
        scheduler__whole_token=True,
        scheduler__max_model_len=64,
    )
    assert eng.snapshot().graphs == ()  # CPU: no graph caches
    eng.runner.token_graphs = stand_in_graphs("whole_token", eng.runner.passes.token_pass)
    eng.runner.fixed_width = -(-eng.max_model_len // eng.cfg.kv.block_size)  # as on CUDA
    eng.generate([[3, 4, 5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=4))
    # prefill, coda (token 1 of both), then tokens 2-4 as whole-token steps of 2 rows: 1 capture, 3 replays
    assert dict(eng.stats.steps_by_stage) == {"prefill": 1, "coda": 1, "token": 3}
    family = GraphFamily(
        "whole_token", graphs=1, captures=1, replays=3, fallbacks=0, evictions=0, fallback_reasons={}
    )
    assert eng.snapshot().graphs == (family,)
    counters = eng.graph_counters()["whole_token"]
    assert {k: getattr(family, k) for k in counters} == counters
