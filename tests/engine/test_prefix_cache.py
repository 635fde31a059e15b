"""Prefix cache of the base engine (base-engine.md §5.4): full pages only, the last prompt token never cached,
publication only at full coverage of every plane and layer (so Huginn never publishes), LRU eviction only
inside a claim and only when it covers the claim, cache-only blocks available to admission; no cache in
the shared layout."""

from __future__ import annotations

import pytest
import torch

from looptrace.engine import EngineConfig, LLMEngine, Observer, SamplingParams
from looptrace.engine.kv_cache import LAYOUTS, BlockManager, PlanesLayout
from looptrace.engine.model_config import PRESETS

BS = 4


class Recorder(Observer):
    wants_hidden = True

    def __init__(self) -> None:
        self.steps = []
        self.states: dict[tuple[str, int, int], torch.Tensor] = {}

    def on_step_begin(self, info) -> None:
        self.steps.append(info)

    def on_loop_hidden(self, stage, loop_index, request_ids, positions, hidden):
        for rid, pos, row in zip(request_ids, positions, hidden, strict=True):
            self.states[(rid, pos, loop_index)] = row.clone()


def make_engine(
    preset="ouro-tiny", layout="planes", pages=64, chunk=128, publication="all_planes"
) -> tuple[LLMEngine, Recorder]:
    cfg = EngineConfig(noise="zeros")
    cfg.kv.layout, cfg.kv.block_size, cfg.kv.prefix_publication = layout, BS, publication
    spec = PRESETS[preset]
    cfg.kv.num_blocks = pages * LAYOUTS[layout](spec, spec.default_loops).blocks_per_page
    cfg.kv.poison_freed_blocks = True
    cfg.scheduler.prefill_chunk_size = chunk
    engine = LLMEngine.from_preset(preset, cfg, device="cpu", seed=1)
    rec = Recorder()
    engine.attach(rec)
    return engine, rec


def run(engine: LLMEngine, prompt: list[int], max_tokens: int = 4, rid: str | None = None) -> str:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), request_id=rid)
    while engine.has_unfinished_requests():
        engine.step()
    return rid


def cold(prompt: list[int], max_tokens: int = 4, **kw):
    engine, rec = make_engine(**kw)
    rid = run(engine, prompt, max_tokens, "cold")
    return engine.requests[rid], rec


def tokens(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 500 + 3 for i in range(n)]


BASE = tokens(40, 11)


def test_ouro_two_page_prefix_hit_matches_cold_run():
    engine, rec = make_engine()
    run(engine, BASE[:13], rid="A")  # publishes the 3 full pages of BASE[:12]
    assert len(engine.blocks.cache) == 3
    prompt = BASE[:8] + tokens(6, 300)  # shares exactly 2 pages
    rid = run(engine, prompt, rid="B")
    req = engine.requests[rid]
    assert req.num_cached == 2 * BS and engine.blocks.stats["prefix_hit_tokens"] == 2 * BS
    assert [s.num_rows for s in rec.steps if s.stage == "prefill" and s.request_ids == [rid]] == [
        len(prompt) - 8
    ]
    ref, ref_rec = cold(prompt)
    assert req.outputs == ref.outputs and req.exit_depths == ref.exit_depths
    for (r, pos, loop), h in rec.states.items():  # suffix and decode states equal the cold run's
        if r == rid:
            torch.testing.assert_close(h, ref_rec.states[("cold", pos, loop)], atol=1e-5, rtol=1e-5)
    assert not engine.blocks.seqs


@pytest.mark.parametrize(("length", "pages"), [(4, 0), (8, 1), (9, 2), (12, 2), (13, 3), (5, 1)])
def test_last_prompt_token_is_never_cached(length, pages):
    engine, rec = make_engine()
    prompt = BASE[:length]
    run(engine, prompt, max_tokens=2, rid="first")
    assert len(engine.blocks.cache) == pages == (length - 1) // BS
    rid = run(engine, prompt, max_tokens=2, rid="again")
    req = engine.requests[rid]
    assert req.num_cached == pages * BS < length
    assert [s.num_rows for s in rec.steps if s.request_ids == [rid] and s.stage == "prefill"] == [
        length - pages * BS
    ]
    assert req.outputs == engine.requests["first"].outputs


def test_publication_follows_prefill_chunks():
    engine, rec = make_engine(chunk=6)
    rid = engine.add_request(BASE[:21], SamplingParams(max_tokens=1), request_id="A")
    published = []
    while engine.has_unfinished_requests():
        engine.step()
        if rec.steps[-1].stage == "prefill":
            published.append(len(engine.blocks.cache))
    # prefilled 6, 12, 18, 21 -> min(prefilled, 20) // 4 full pages
    assert published == [1, 3, 4, 5]
    assert engine.requests[rid].finish_reason == "length"


def _bm(num_pages: int) -> BlockManager:
    return BlockManager(PlanesLayout(PRESETS["ouro-tiny"], 4), num_pages * 4, BS, prefix_caching=True)


def _prefill(bm: BlockManager, rid: str, prompt: list[int], max_kv: int | None = None) -> int:
    """What the engine does for a request: admit, claim, mark every plane written, publish."""
    max_kv = max_kv or len(prompt)
    assert bm.can_admit(rid, prompt, max_kv, 0)
    cached = bm.admit(rid, prompt, max_kv)
    assert bm.ensure_capacity(rid, len(prompt))
    for plane in range(bm.planes):
        bm.mark_written(rid, plane, "core", cached, len(prompt))
    bm.publish(rid, len(prompt), len(prompt))
    return cached


def test_lru_eviction_only_in_claims_oldest_first_and_only_if_it_covers_the_claim():
    bm = _bm(10)
    _prefill(bm, "x", tokens(9, 1))  # 3 pages claimed, 2 published
    _prefill(bm, "y", tokens(9, 2))
    bm.free_request("x")
    bm.free_request("y")
    keys = list(bm.cache)  # x0, x1, y0, y1 (oldest first)
    assert len(keys) == 4 and len(bm.free) == 40 - 16 and bm.available_blocks() == 40
    # an LRU refresh: a hit on x's pages moves them to the young end
    assert _prefill(bm, "z", tokens(9, 1)) == 8  # claims 1 fresh page; x0, x1 now shared with z
    assert list(bm.cache) == [keys[2], keys[3], keys[0], keys[1]]
    bm.free_request("z")
    free = len(bm.free)  # 24
    # admission counts cache-only blocks as available but evicts nothing
    assert bm.can_admit("w", tokens(36, 3), 36, 0)  # 9 pages = 36 blocks > 24 free
    bm.admit("w", tokens(36, 3), 36)
    assert bm.stats["evictions"] == 0 and len(bm.cache) == 4
    # a claim the free list covers evicts nothing
    assert bm.ensure_capacity("w", 6 * BS) and bm.stats["evictions"] == 0 and len(bm.free) == free - 24
    # a claim of 1 page (4 blocks) with 0 free: evicts exactly the oldest entry (y0), no more
    assert bm.ensure_capacity("w", 7 * BS)
    assert bm.stats["evictions"] == 1 and list(bm.cache) == [keys[3], keys[0], keys[1]]
    # two pages: the two next-oldest
    assert bm.ensure_capacity("w", 9 * BS)
    assert bm.stats["evictions"] == 3 and list(bm.cache) == [keys[1]]
    # a claim the cache cannot fully cover evicts nothing and fails
    bm.free_request("w")
    before = (list(bm.cache), bm.stats["evictions"], len(bm.free))
    assert before[1:] == (3, 36) and bm.available_blocks() == 40
    bm.admit("u", tokens(60, 5), 60)  # bypass can_admit: the claim itself must refuse
    assert not bm.ensure_capacity("u", 60)  # 60 blocks > 36 free + 4 evictable
    assert (list(bm.cache), bm.stats["evictions"], len(bm.free)) == before


def test_entries_held_by_a_live_request_are_not_evicted():
    bm = _bm(5)
    _prefill(bm, "x", tokens(9, 1), max_kv=9)  # 3 pages, 2 published (x holds them too)
    assert bm.available_blocks() == 8  # only the free list: x's published blocks are not cache-only
    assert not bm.ensure_capacity("x", 6 * BS)  # needs 12 more blocks: 8 free, nothing evictable
    assert len(bm.cache) == 2 and bm.stats["evictions"] == 0


def test_cache_only_blocks_are_available_for_admission_and_evicted_by_prefill_claims():
    engine, rec = make_engine(pages=8, chunk=8)
    run(engine, BASE[:25], max_tokens=1, rid="A")  # 7 pages claimed, 6 published
    bm = engine.blocks
    keys = list(bm.cache)
    assert len(keys) == 6 and len(bm.free) == 8 and bm.available_blocks() == 32
    prompt = tokens(25, 400)  # 7 pages: needs cached blocks
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4), request_id="B")  # 28 positions
    engine.step()
    assert rec.steps[-1].stage == "prefill" and rec.steps[-1].request_ids == [rid]  # admitted at once
    assert bm.stats["evictions"] == 0  # the first chunk (2 pages) fits the free list
    engine.step()
    # oldest first, only what the claim needs; B's first 4 pages are published behind them
    assert bm.stats["evictions"] == 2 and list(bm.cache)[:4] == keys[2:] and len(bm.cache) == 8
    while engine.has_unfinished_requests():
        engine.step()
    ref, _ = cold(prompt, pages=8, chunk=8)
    assert engine.requests[rid].outputs == ref.outputs
    # each later chunk evicted just what it claimed (A2, A3, then A4); B published its own 6 pages
    assert bm.stats["evictions"] == 5 and list(bm.cache)[0] == keys[5] and len(bm.cache) == 7


def test_kv_usage_counts_request_blocks_not_the_evictable_cache():
    # Before: kv_usage() counted blocks only the prefix cache held, so a bench's "peak KV usage" grew from
    # round to round of an idle engine (a finished request's published pages stayed "used").
    engine, _ = make_engine(pages=8, chunk=8)
    run(engine, BASE[:25], max_tokens=1, rid="A")  # finished; 6 pages published
    kv = engine.kv_blocks()
    assert kv["request_blocks"] == 0 and kv["cached_blocks"] == 24 and kv["used_blocks"] == 24
    assert kv["free_blocks"] == kv["num_blocks"] - 24 and engine.kv_usage() == 0.0
    rid = engine.add_request(tokens(9, 500), SamplingParams(max_tokens=4), request_id="B")
    engine.step()  # B's first chunk: 8 positions, 2 pages of 4 planes
    assert engine.requests[rid].num_prefilled == 8
    assert engine.kv_blocks()["request_blocks"] == 8 and engine.kv_usage() == 8 / kv["num_blocks"]


def test_huginn_planes_never_publishes():
    engine, _ = make_engine("huginn-tiny")
    run(engine, BASE[:21], rid="A")
    assert engine.blocks.prefix_caching and not engine.blocks.cache
    rid = run(engine, BASE[:21], rid="B")
    assert engine.requests[rid].num_cached == 0 and engine.blocks.stats["prefix_hit_tokens"] == 0
    assert engine.requests[rid].outputs == engine.requests["A"].outputs
    assert len(engine.blocks.free) == engine.blocks.num_blocks


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_shared_layout_has_no_prefix_cache(preset):
    engine, _ = make_engine(preset, layout="shared")
    assert engine.cfg.kv.prefix_caching and not engine.blocks.prefix_caching
    assert engine.kv_summary()["prefix_caching"] is False
    run(engine, BASE[:21], rid="A")
    rid = run(engine, BASE[:21], rid="B")
    assert not engine.blocks.cache and engine.requests[rid].num_cached == 0
    assert engine.requests[rid].outputs == engine.requests["A"].outputs
    assert len(engine.blocks.free) == engine.blocks.num_blocks


@pytest.mark.parametrize("layout", ["planes", "packed"])
def test_huginn_publishes_and_hits_only_under_per_plane_publication(layout):
    """Per-plane coverage (ExactLoop): a plane must cover only the layers it holds, so Huginn pages publish
    (planes >= 1 hold no prelude/coda slot, which the base rule waits for forever). Same prompts: hits only
    under `per_plane`; the hit run equals the cold run; kv_summary reports the hit rate."""
    hits = {}
    for publication in ("all_planes", "per_plane"):
        engine, rec = make_engine("huginn-tiny", layout, publication=publication)
        run(engine, BASE[:21], rid="A")
        rid = run(engine, BASE[:13] + tokens(6, 200), rid="B")  # shares 3 full pages with A
        stats = engine.kv_summary()
        hits[publication] = stats["prefix_hit_tokens"]
        assert stats["prefix_query_tokens"] == 21 + 19 and stats["prefix_publication"] == publication
        assert stats["prefix_hit_rate"] == pytest.approx(hits[publication] / 40)
        assert engine.requests[rid].num_cached == hits[publication]
        if publication == "per_plane":
            assert len(engine.blocks.cache) == 5 + 1  # A: min(21, 20) // 4 pages; B: 18 // 4 - 3 hit
            ref, ref_rec = cold(BASE[:13] + tokens(6, 200), preset="huginn-tiny", layout=layout)
            assert engine.requests[rid].outputs == ref.outputs
            for (r, pos, loop), h in rec.states.items():
                if r == rid:
                    torch.testing.assert_close(h, ref_rec.states[("cold", pos, loop)], atol=1e-5, rtol=1e-5)
            assert not any(r == rid and pos < 12 for r, pos, _ in rec.states)  # cached rows not prefilled
        else:
            assert not engine.blocks.cache
    assert hits == {"all_planes": 0, "per_plane": 12}


def test_per_plane_equals_all_planes_for_ouro():
    """Every Ouro plane holds every layer: the two rules publish the same pages."""
    caches = []
    for publication in ("all_planes", "per_plane"):
        engine, _ = make_engine(publication=publication)
        run(engine, BASE[:21], rid="A")
        caches.append(list(engine.blocks.cache))
    assert caches[0] == caches[1] and len(caches[0]) == 5
