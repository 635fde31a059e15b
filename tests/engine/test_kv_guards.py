"""KV fidelity guards: the written-state guard is per (plane, layer), so a partial write of a
layer range is caught on read; the exit-plane copy checks that the exit plane wrote the position (every core
layer at the exit depth, as the base engine's `finalize_token`) before copying it deeper."""

from __future__ import annotations

import pytest

from looptrace.engine import EngineConfig, LLMEngine, SamplingParams
from looptrace.engine.kv_cache import BlockManager, KVHistoryError, PackedLayout, PlanesLayout
from looptrace.engine.llm_engine import StepError
from looptrace.engine.model_config import PRESETS
from looptrace.engine.request import Stage

HUGINN = PRESETS["huginn-tiny"]  # layers: prelude 0-1, core 2-5, coda 6-7
BS = 4


@pytest.mark.parametrize("layout_cls", [PlanesLayout, PackedLayout])
def test_partial_layer_write_is_caught_on_read(layout_cls):
    layout = layout_cls(HUGINN, 8)
    bm = BlockManager(layout, 64 * layout.blocks_per_page, BS, prefix_caching=False)
    bm.admit("r", list(range(10)), 12)
    assert bm.ensure_capacity("r", 12)
    # plane 3: only core layers 2 and 3 wrote positions 0..7 (a partial write of the core range)
    bm.mark_written("r", 3, [2, 3], 0, 8)
    bm.check_history("r", 3, [2, 3], 8)  # the layers that wrote may be read
    with pytest.raises(KVHistoryError, match="uninitialized KV history.*plane 3 layer 4"):
        bm.check_history("r", 3, "core", 8)
    bm.mark_written("r", 3, [4, 5], 0, 7)  # the rest of the range, one position short
    with pytest.raises(KVHistoryError, match="layer 4 written up to 7"):
        bm.check_history("r", 3, "core", 8)
    bm.mark_written("r", 3, [4, 5], 7, 8)
    bm.check_history("r", 3, "core", 8)
    # a plane >= 1 holds no prelude/coda slot: reading or writing one is an error, not a silent success
    with pytest.raises(KVHistoryError, match="no slot"):
        bm.check_history("r", 3, "prelude", 1)
    with pytest.raises(RuntimeError, match="no KV slot"):
        bm.mark_written("r", 3, "coda", 0, 1)
    # plane 0 holds every layer; the prelude range written does not cover the coda range
    bm.mark_written("r", 0, "prelude", 0, 8)
    bm.check_history("r", 0, "prelude", 8)
    with pytest.raises(KVHistoryError):
        bm.check_history("r", 0, "coda", 1)


def test_engine_read_after_partial_write_raises():
    """Through the runner: un-mark one core layer of a plane the next loop will read, the engine refuses."""
    cfg = EngineConfig(noise="zeros")
    engine = LLMEngine.from_preset("huginn-tiny", cfg, device="cpu", seed=0)
    rid = engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=3))
    while engine.requests[rid].stage != Stage.RECURRENT:
        engine.step()
    seq = engine.blocks.seqs[rid]
    seq.written[(2, 4)].prefix = 3  # layer 4 of plane 2 "forgot" positions 3.. (others remain written)
    while engine.requests[rid].loops_done < 2:
        engine.step()
    # The guard's error fails the step's requests alone (StepError, KV freed), never a silent read.
    with pytest.raises(StepError, match="plane 2 layer 4") as err:
        engine.step()
    assert isinstance(err.value.__cause__, KVHistoryError) and err.value.request_ids == [rid]
    assert engine.requests[rid].stage == Stage.FINISHED and rid not in engine.blocks.seqs


@pytest.mark.parametrize("layout", ["planes", "packed"])
def test_exit_plane_copy_of_an_unwritten_position_raises(layout):
    cfg = EngineConfig(noise="zeros")
    cfg.kv.layout = layout
    engine = LLMEngine.from_preset("ouro-tiny", cfg, device="cpu", seed=0)
    rid = engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=3))
    req = engine.requests[rid]
    while req.stage != Stage.RECURRENT:
        engine.step()
    assert req.loops_done == 0
    pos = req.decode_position
    # claim an exit at depth 2 although no loop has run for this token: plane 1 never wrote `pos`
    req.loops_done = 2
    with pytest.raises(KVHistoryError, match=f"plane 1 layer 0 has not written position {pos}"):
        engine.runner.finalize_exits([req])
    req.loops_done = 0
    engine.step()  # loop 1 writes plane 0 at pos (all core layers)
    engine.step()  # loop 2 writes plane 1
    assert req.loops_done == 2
    seq = engine.blocks.seqs[rid]
    seq.written[(1, 2)].prefix = pos  # a partial write: core layer 2 of the exit plane lacks `pos`
    with pytest.raises(KVHistoryError, match="plane 1 layer 2"):
        engine.runner.finalize_exits([req])
    seq.written[(1, 2)].prefix = pos + 1
    engine.runner.finalize_exits([req])  # now legal: planes 2, 3 get the copy and are marked written
    assert all(seq.written[(p, layer)].has(pos) for p in (2, 3) for layer in range(4))
