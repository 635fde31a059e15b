"""Paged-KV bookkeeping under random request streams (hypothesis): small pools so requests wait and blocks
are reused, random arrivals and aborts at every stage, invariants checked after every engine step, and
freed blocks poisoned so stale history would change the outputs of the surviving requests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from looptrace.engine import EngineConfig, LLMEngine, SamplingParams
from looptrace.engine.kv_cache import LAYOUTS, KVPool
from looptrace.engine.model_config import PRESETS
from looptrace.engine.request import Stage
from tests.oracle import HiddenRecorder, reference_run

COMBOS = [
    ("ouro-tiny", "planes"),
    ("ouro-tiny", "shared"),
    ("ouro-tiny", "packed"),
    ("huginn-tiny", "planes"),
    ("huginn-tiny", "shared"),
    ("huginn-tiny", "packed"),
]
BLOCK = 4
ABORT_STAGES = ("waiting", "prefill", "prelude", "recurrent", "coda")


def make_engine(
    preset: str, layout: str, pages: int, exit_policy: str = "fixed", publication: str = "all_planes"
) -> LLMEngine:
    per_page = LAYOUTS[layout](PRESETS[preset], PRESETS[preset].default_loops).blocks_per_page
    cfg = EngineConfig(noise="zeros")
    cfg.kv.layout, cfg.kv.block_size, cfg.kv.num_blocks = layout, BLOCK, pages * per_page
    cfg.kv.poison_freed_blocks = True
    cfg.kv.prefix_publication = publication  # per_plane: Huginn pages publish (and hit) too
    # budget = seats x chunk: every prefill chunk is min(chunk, remaining), whatever else is in the batch
    # (the shared layout's results depend on chunk boundaries, so solo and stream runs must chunk alike)
    sched = cfg.scheduler
    sched.prefill_chunk_size, sched.max_num_seqs, sched.max_num_batched_tokens = 8, 4, 32
    if exit_policy == "gate":
        cfg.exit.policy, cfg.exit.threshold, cfg.exit.min_loops = "gate", 0.8, 1
    engine = LLMEngine.from_preset(preset, cfg, device="cpu", seed=5)
    if exit_policy == "gate":  # a sharper gate so tokens exit at mixed depths (as in test_oracle)
        with torch.no_grad():
            engine.model.model.early_exit_gate.weight.mul_(10.0)
            engine.model.model.early_exit_gate.bias.fill_(0.0)
    return engine


def check_invariants(engine: LLMEngine) -> None:
    bm = engine.blocks
    holders: Counter[int] = Counter()
    seq_holders: Counter[int] = Counter()
    for rid, seq in bm.seqs.items():
        assert len({len(t) for t in seq.tables}) == 1, f"{rid}: plane tables of unequal length"
        assert len(seq.tables[0]) <= seq.blocks_needed_total, f"{rid}: owns more pages than its budget"
        owned = [b for t in seq.tables for b in t]
        assert len(set(owned)) == len(owned), f"{rid}: a block appears twice in its own tables"
        seq_holders.update(owned)
    holders.update(seq_holders)
    cached = set()
    for blocks in bm.cache.values():
        assert len(blocks) == bm.tables  # one allocation unit per block table
        holders.update(blocks)
        cached.update(blocks)
    expected = np.zeros(bm.num_blocks, dtype=np.int64)
    for b, c in holders.items():
        expected[b] = c
    assert np.array_equal(bm.refcount, expected), "refcounts differ from the number of holders"
    assert len(set(bm.free)) == len(bm.free), "duplicate block in the free list"
    assert set(bm.free) == {b for b in range(bm.num_blocks) if bm.refcount[b] == 0}, "free/referenced overlap"
    shared = {b for b, c in seq_holders.items() if c > 1}
    assert shared <= cached, "blocks shared between requests must come from a prefix-cache entry"
    assert bm.available_blocks() - bm.reserved_growth() >= 0
    live = {rid for rid, r in engine.requests.items() if r.stage not in (Stage.WAITING, Stage.FINISHED)}
    assert set(bm.seqs) == live == set(engine.scheduler.running)
    slots = [engine.requests[rid].state_slot for rid in live]
    assert len(set(slots)) == len(slots) and -1 not in slots
    assert sorted(slots + engine.runner.free_slots) == list(range(engine.runner.state_pool.shape[0]))


def check_drained(engine: LLMEngine) -> None:
    bm = engine.blocks
    assert not bm.seqs and not engine.scheduler.running and not engine.scheduler.has_work()
    assert all(r.is_finished and r.state_slot == -1 for r in engine.requests.values())
    assert sorted(engine.runner.free_slots) == list(range(engine.runner.state_pool.shape[0]))
    cached = {b for blocks in bm.cache.values() for b in blocks}
    assert all(bm.refcount[b] == 1 for b in cached)  # held only by the cache
    assert set(bm.free) == set(range(bm.num_blocks)) - cached
    if bm.cache:  # every entry is evictable now; evicting all of them empties the pool
        assert bm._evict_for(len(cached))
    assert not bm.cache and sorted(bm.free) == list(range(bm.num_blocks)) and not bm.refcount.any()


_SOLO: dict[tuple, tuple[list[int], list[int]]] = {}


def solo(
    preset, layout, pages, exit_policy, prompt, max_tokens, publication="all_planes"
) -> tuple[list[int], list[int]]:
    key = (preset, layout, pages, exit_policy, tuple(prompt), max_tokens, publication)
    if key not in _SOLO:
        engine = make_engine(preset, layout, pages, exit_policy, publication)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
        while engine.has_unfinished_requests():
            engine.step()
        _SOLO[key] = (engine.requests[rid].outputs, engine.requests[rid].exit_depths)
    return _SOLO[key]


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    arrival: int
    abort: tuple[str, int] | None  # (stage, k): abort the k-th time it is seen in that stage


@st.composite
def streams(draw):
    preset, layout = draw(st.sampled_from(COMBOS))
    exit_policy = draw(st.sampled_from(["fixed", "gate"])) if preset == "ouro-tiny" else "fixed"
    publication = draw(st.sampled_from(["all_planes", "per_plane"])) if layout != "shared" else "all_planes"
    pages = draw(st.integers(12, 20))  # the longest request (40 + 6 - 1 positions) needs 12 pages
    base = draw(st.lists(st.integers(3, 511), min_size=40, max_size=40))  # prompts share prefixes of it
    specs = []
    for _ in range(draw(st.integers(2, 6))):
        length = draw(st.integers(1, 40))
        common = draw(st.sampled_from([0, 0, length // 2, length, min(length, 12)]))
        tail = draw(st.lists(st.integers(3, 511), min_size=length - common, max_size=length - common))
        abort = draw(st.none() | st.tuples(st.sampled_from(ABORT_STAGES), st.integers(0, 3)))
        specs.append(Spec(base[:common] + tail, draw(st.integers(1, 6)), draw(st.integers(0, 30)), abort))
    return preset, layout, exit_policy, publication, pages, specs


def _in_abort_stage(req, stage: str) -> bool:
    if stage == "prefill":  # between chunks of a chunked prefill
        return req.stage == Stage.PREFILL and 0 < req.num_prefilled < len(req.prompt)
    return req.stage.value == stage


def run_stream(engine: LLMEngine, specs: list[Spec]) -> tuple[dict[int, str], dict[int, str]]:
    ids: dict[int, str] = {}
    aborted: dict[int, str] = {}  # spec index -> stage it was aborted in
    seen = Counter()
    for step in range(5000):
        for i, s in enumerate(specs):
            if i not in ids and s.arrival <= step:
                ids[i] = engine.add_request(s.prompt, SamplingParams(max_tokens=s.max_tokens))
        for i, rid in ids.items():
            req, s = engine.requests[rid], specs[i]
            if s.abort is None or req.is_finished or not _in_abort_stage(req, s.abort[0]):
                continue
            seen[i] += 1
            if seen[i] > s.abort[1]:
                aborted[i] = req.stage.value
                engine.abort_request(rid)
                check_invariants(engine)
        if len(ids) == len(specs) and not engine.has_unfinished_requests():
            return ids, aborted
        engine.step()
        check_invariants(engine)
    raise AssertionError("the stream did not drain (admission livelock?)")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_random_streams_keep_kv_invariants(stream):
    preset, layout, exit_policy, publication, pages, specs = stream
    engine = make_engine(preset, layout, pages, exit_policy, publication)
    freed = []
    poison = engine.blocks.on_freed
    engine.blocks.on_freed = lambda blocks: (freed.extend(blocks), poison(blocks))
    ids, aborted = run_stream(engine, specs)
    note(f"aborted in stages {sorted(aborted.values())}; {len(freed)} blocks freed")
    for stage in set(aborted.values()):  # coverage: --hypothesis-show-statistics
        event(f"abort in {stage}")
    event(f"{preset} {layout} {exit_policy} {publication}")
    if engine.blocks.stats["prefix_hit_tokens"]:
        event("prefix-cache hit")
    if engine.blocks.stats["evictions"]:
        event("prefix-cache eviction")
    if len(freed) > len(set(freed)):
        event("a block freed twice (reused in between)")
    for i, s in enumerate(specs):
        req = engine.requests[ids[i]]
        if i in aborted:
            assert req.finish_reason == "abort"
            continue
        assert req.finish_reason == "length" and len(req.outputs) == s.max_tokens
        # no stale (poisoned or foreign) history is visible: same tokens and depths as alone on a fresh engine
        want = solo(preset, layout, pages, exit_policy, s.prompt, s.max_tokens, publication)
        assert (req.outputs, req.exit_depths) == want, f"request {i} differs from its solo run"
    check_drained(engine)


def _stream_body(preset, layout, exit_policy, pages, specs):
    engine = make_engine(preset, layout, pages, exit_policy)
    ids, aborted = run_stream(engine, specs)
    for i, s in enumerate(specs):
        req = engine.requests[ids[i]]
        if i not in aborted:
            assert req.finish_reason == "length"
            assert (req.outputs, req.exit_depths) == solo(
                preset, layout, pages, exit_policy, s.prompt, s.max_tokens
            )
    check_drained(engine)
    return engine, aborted


@pytest.mark.parametrize(("preset", "layout"), COMBOS)
def test_fixed_stream_aborts_in_every_stage(preset, layout):
    rng = np.random.default_rng(1)
    p = [rng.integers(3, 500, 30).tolist() for _ in range(6)]
    specs = [
        Spec(p[0], 4, 0, ("prefill", 1)),  # 9 pages; aborted after its second chunk
        Spec(p[1][:20], 6, 0, ("recurrent", 2)),  # 7 pages
        Spec(p[2][:12], 5, 0, ("waiting", 1)),  # no room: waits
        Spec(p[3][:9], 3, 2, ("prelude", 0)),
        Spec(p[4][:15], 4, 3, ("coda", 1)),
        Spec(p[5][:25], 5, 4, None),
        Spec(p[5][:12] + p[4][:6], 6, 10, None),  # shares 3 pages with the previous one
        Spec(p[0], 4, 12, None),  # the aborted prompt again (its published pages stay valid)
    ]
    engine, aborted = _stream_body(preset, layout, "fixed", 16, specs)
    assert aborted == {0: "prefill", 1: "recurrent", 2: "waiting", 3: "prelude", 4: "coda"}
    if layout in ("planes", "packed") and preset == "ouro-tiny":
        assert engine.blocks.stats["prefix_hit_tokens"] > 0


# --- deterministic reuse after poisoning, checked against the dense oracle --------------------------------
@pytest.mark.parametrize(("preset", "layout"), COMBOS)
def test_reused_poisoned_blocks_hide_no_stale_history(preset, layout):
    pages = 8  # one 32-position request fills the pool: the second reuses every block of the first
    engine = make_engine(preset, layout, pages)
    engine.blocks.prefix_caching = False  # all blocks go back to the free list
    rec = HiddenRecorder()
    engine.attach(rec)
    rng = np.random.default_rng(0)
    first, second = (rng.integers(3, 500, 27).tolist() for _ in range(2))
    a = engine.add_request(first, SamplingParams(max_tokens=6))
    b = engine.add_request(second, SamplingParams(max_tokens=6))
    tables = {}
    while engine.has_unfinished_requests():
        engine.step()
        for rid in (a, b):
            if rid in engine.blocks.seqs:
                tables[rid] = {x for t in engine.blocks.seqs[rid].tables for x in t}
        if engine.requests[a].is_finished and b not in tables:  # A done, B not admitted yet: all poisoned
            assert len(engine.blocks.free) == engine.blocks.num_blocks
            assert bool(
                (engine.pool.k_cache == KVPool.POISON).all() and (engine.pool.v_cache == KVPool.POISON).all()
            )
    assert tables[a] & tables[b] and len(tables[b]) > len(tables[a]) // 2
    for rid, prompt in ((a, first), (b, second)):
        assert (engine.requests[rid].outputs, engine.requests[rid].exit_depths) == solo(
            preset, layout, pages, "fixed", prompt, 6
        )
    if layout in ("planes", "packed"):  # the oracle implements the planes semantics
        sd = {k: v.float() for k, v in engine.model.state_dict().items()}
        req = engine.requests[b]
        oracle, logits = reference_run(
            engine.spec, sd, engine.max_loops, req.prompt, req.outputs, req.exit_depths
        )
        for (pos, loop), h in oracle.hidden.items():
            torch.testing.assert_close(rec.states[(b, pos, loop)], h.float(), atol=2e-4, rtol=2e-4)
        assert [int(x.argmax()) for x in logits] == req.outputs
    check_drained(engine)
