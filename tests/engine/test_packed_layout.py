"""`kv.layout: packed` (ExactLoop live-slot plane packing, R0): the `planes` values at other addresses.
Plane 0 holds every layer that writes it, deeper planes only the core layers, laid one after the other in a
run of blocks; under the same batches tokens, hidden states and logits are bitwise those of `planes`, and
the same pool bytes hold ~1.9x more Huginn tokens (no effect on Ouro)."""

from __future__ import annotations

import random

import pytest
import torch

from looptrace.engine import EngineConfig, LLMEngine, SamplingParams
from looptrace.engine.kv_cache import LAYOUTS, BlockManager, PackedLayout, PlanesLayout
from looptrace.engine.model_config import PRESETS
from tests.oracle import HiddenRecorder


def test_packed_addressing_of_huginn_0125():
    spec = PRESETS["huginn-0125"]  # prelude 2 / core 4 / coda 2, 32 loops
    planes, packed = PlanesLayout(spec, 32), PackedLayout(spec, 32)
    assert planes.blocks_per_page == 32 and packed.blocks_per_page == 17  # ceil((8 + 31 * 4) / 8)
    assert (planes.reserved_slots_per_token, planes.live_slots_per_token) == (256, 132)
    assert planes.dead_slots_per_token == 124 and planes.padding_slots_per_token == 0
    assert (packed.reserved_slots_per_token, packed.live_slots_per_token) == (136, 132)
    assert packed.dead_slots_per_token == 0 and packed.padding_slots_per_token == 4  # half of block 17
    # layer l of plane p is entry unit * 136 + offset(p) + l: plane 0 = entries 0..7, plane p >= 1 holds
    # core layers 2..5 at 8 + 4(p - 1) .. 11 + 4(p - 1); every live slot is used exactly once
    assert packed.unit_entries == 17 * 8
    used = [packed.entry_offset(p) + layer for p in range(32) for layer in packed.layers_in_plane(p)]
    assert sorted(used) == list(range(132))
    assert [packed.entry_offset(p) + 2 for p in (1, 2, 31)] == [8, 12, 128]
    ouro = PRESETS["ouro-1.4b"]  # every layer is core: nothing to pack
    assert PackedLayout(ouro, 4).blocks_per_page == PlanesLayout(ouro, 4).blocks_per_page == 4
    olmo = PRESETS["olmo-retrofit-1b"]  # 4 / 6 / 4, 4 loops: ceil((14 + 3 * 6) / 14) = 3
    assert PackedLayout(olmo, 4).blocks_per_page == 3


class LogitRecorder:
    def __init__(self, engine: LLMEngine) -> None:
        self.logits: list[torch.Tensor] = []
        engine.model.lm_head.register_forward_hook(lambda mod, inp, out: self.logits.append(out.clone()))


def _run(preset: str, layout: str, **cfg_kw):
    cfg = EngineConfig(noise=cfg_kw.pop("noise", "sequential"))
    cfg.kv.layout, cfg.kv.block_size = layout, 4
    sched = cfg.scheduler
    sched.prefill_chunk_size, sched.max_num_batched_tokens, sched.max_num_seqs = 7, 12, 3
    for k, v in cfg_kw.items():
        setattr(cfg.exit, k, v)
    engine = LLMEngine.from_preset(preset, cfg, device="cpu", seed=3)
    if preset == "ouro-tiny":  # a sharper gate so tokens exit at mixed depths (plane copies run)
        with torch.no_grad():
            engine.model.model.early_exit_gate.weight.mul_(10.0)
            engine.model.model.early_exit_gate.bias.fill_(0.0)
    rec, logits = HiddenRecorder(), LogitRecorder(engine)
    engine.attach(rec)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 16, 23)]
    params = [SamplingParams(max_tokens=5, seed=i, temperature=1.0 if i % 2 else 0.0) for i in range(4)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        engine.step()
    reqs = [engine.requests[i] for i in ids]
    return engine, rec.states, logits.logits, [(r.outputs, r.exit_depths) for r in reqs]


@pytest.mark.parametrize(
    ("preset", "cfg_kw"),
    [
        ("huginn-tiny", {}),  # sequential noise: the same draws under the same batches
        ("ouro-tiny", dict(policy="gate", threshold=0.8, min_loops=1)),  # mixed exit depths
    ],
)
def test_packed_is_bitwise_planes_under_the_same_batches(preset, cfg_kw):
    e_planes, s_planes, l_planes, t_planes = _run(preset, "planes", **cfg_kw)
    e_packed, s_packed, l_packed, t_packed = _run(preset, "packed", **cfg_kw)
    assert e_packed.stats.steps_by_stage == e_planes.stats.steps_by_stage  # same batches
    assert t_packed == t_planes
    assert s_packed.keys() == s_planes.keys() and len(s_planes) > 100
    assert all(torch.equal(s_packed[k], s_planes[k]) for k in s_planes)
    assert len(l_packed) == len(l_planes) > 0
    assert all(torch.equal(a, b) for a, b in zip(l_packed, l_planes))
    if preset == "ouro-tiny":
        depths = {d for _, ds in t_planes for d in ds[1:]}
        assert len(depths) >= 2, f"expected early exits (plane copies), got depths {depths}"
    summary = e_packed.kv_summary()
    assert summary["dead_slots_per_token"] == 0
    if preset == "huginn-tiny":  # 8 loops: ceil((8 + 7 * 4) / 8) = 5 blocks per page instead of 8
        assert (summary["blocks_per_page"], e_planes.kv_summary()["blocks_per_page"]) == (5, 8)
        assert (summary["live_slots_per_token"], e_planes.kv_summary()["dead_slots_per_token"]) == (36, 28)


def _engine(preset: str, layout: str, num_blocks: int, loops: int) -> LLMEngine:
    cfg = EngineConfig(noise="zeros")
    cfg.kv.layout, cfg.kv.block_size, cfg.kv.num_blocks = layout, 16, num_blocks
    cfg.exit.max_loops = loops
    return LLMEngine.from_preset(preset, cfg, device="cpu", seed=0)


def test_packed_holds_more_huginn_tokens_in_the_same_pool():
    """Same pool bytes (num_blocks), Huginn at its full depth of 32 loops: 17 instead of 32 blocks per page,
    1.88x the tokens; admission fits 1.88x the requests. Ouro: the same capacity."""
    blocks = 32 * 17 * 4  # 2176 blocks
    planes = _engine("huginn-tiny", "planes", blocks, 32)
    packed = _engine("huginn-tiny", "packed", blocks, 32)
    sp, sk = planes.kv_summary(), packed.kv_summary()
    assert sp["pool_bytes"] == sk["pool_bytes"] and sp["num_blocks"] == sk["num_blocks"] == blocks
    assert (sp["capacity_tokens"], sk["capacity_tokens"]) == (1088, 2048)  # 2176 // 32 and // 17 pages x 16
    assert sk["capacity_tokens"] / sp["capacity_tokens"] >= 1.8
    assert sk["planes_capacity_tokens"] == sp["capacity_tokens"]
    slots = ("reserved_slots_per_token", "live_slots_per_token", "dead_slots_per_token")
    assert [sp[k] for k in slots] == [256, 132, 124]
    assert [sk[k] for k in slots] == [136, 132, 0]

    def admitted(bm: BlockManager) -> int:  # 48-token requests (3 pages) admitted until the pool is full
        n = 0
        while bm.can_admit(f"r{n}", list(range(48)), 48, 0):
            bm.admit(f"r{n}", list(range(48)), 48)
            assert bm.ensure_capacity(f"r{n}", 48)
            n += 1
        return n

    assert (admitted(planes.blocks), admitted(packed.blocks)) == (22, 42)  # 1.91x
    ouro_planes, ouro_packed = _engine("ouro-tiny", "planes", 64, 4), _engine("ouro-tiny", "packed", 64, 4)
    assert ouro_planes.kv_summary()["capacity_tokens"] == ouro_packed.kv_summary()["capacity_tokens"] == 256


def test_pool_sizing_and_poisoning_by_unit():
    """A packed allocation unit is a run of blocks: freeing it poisons all of them."""
    spec = PRESETS["huginn-tiny"]
    layout = LAYOUTS["packed"](spec, 8)
    bm = BlockManager(layout, 5 * 3 + 2, 4, prefix_caching=False)  # 3 units; 2 leftover blocks
    assert bm.num_blocks == 3 and bm.capacity_tokens == 12
    freed = []
    bm.on_freed = freed.extend
    bm.admit("r", [1, 2, 3], 8)
    assert bm.ensure_capacity("r", 8) and bm.table("r", 0) == bm.table("r", 7) == [0, 1]
    bm.free_request("r")
    assert sorted(freed) == list(range(10))
