"""`stream_loop` (`kernels.persistent_loop`'s one-row form on Hopper: weights through a TMA ring, Gluon).

CPU: what `stream_fusable` refuses (no CUDA, more than one row) and the kernel compiled for sm_90a without
spills within one SM's shared memory.
GPU (`gpu` marker, Hopper): at Ouro-1.4B's shapes, against the float64 loop (state and the K/V it writes) as
closely as the register form, repeated bit for bit, replayed in a CUDA graph against eager; `fast` with the
ring decoding one-row loops through it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.kernels.test_persistent_loop import (
    _ouro_case,
    make_case,
    reference_loop,
    rel_err,
    written_rows,
)

BENCH = Path(__file__).resolve().parents[3] / "bench"
HAS_TRITON = importlib.util.find_spec("triton") is not None
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")


@needs_triton
def test_stream_fusable_refuses_cpu_rows_and_batches():
    from looptrace.engine.kernels import stream_loop as sl

    case = make_case(torch.Generator().manual_seed(3), (4, 2, 16), 64, 48, 2, [11, 3])
    one = case.rows([0])
    for c in (one, case):
        assert not sl.stream_fusable(c.state, c.weights, c.cos, c.sin, c.k_cache, c.v_cache, c.tables)
    # and says why, the row count first (what `profile` shows for each decode row count)
    why = [
        sl.ring_refusal(c.state, c.weights, c.cos, c.sin, c.k_cache, c.v_cache, c.tables) for c in (one, case)
    ]
    assert why == ["the ring runs on Hopper GPUs (sm_90) only", "2 rows: the ring takes one"]


@needs_triton
def test_the_kernel_compiles_for_hopper_without_spills():
    sys.path.insert(0, str(BENCH))
    import kernel_stream_loop_compile as compile_bench

    row = compile_bench.compile_form(slots=18, warps=4, ws=True)  # `loop_streamed`'s default form
    assert row["spill_bytes"] == 0 and row["registers"] <= 255
    ring, keys = 18 * 16 * 256 * 2, 2 * 2 * 64 * 128 * 2  # 18 slots, 2 key blocks' K and V
    assert ring + keys <= row["shared_bytes"] <= 227 * 1024


@needs_triton
def test_the_linked_form_compiles_for_hopper():
    """The form without grid barriers (tagged words): it compiles at the default ring with the same shared
    memory and, like the barrier form, spills nothing."""
    sys.path.insert(0, str(BENCH))
    import kernel_stream_loop_compile as compile_bench

    barriers = compile_bench.compile_form(slots=18, warps=4, ws=True)
    linked = compile_bench.compile_form(slots=18, warps=4, ws=True, LINKED=True)
    assert linked["form"] == "18:4:ws:ll" and linked["shared_bytes"] == barriers["shared_bytes"]
    assert linked["registers"] <= 255 and linked["spill_bytes"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
@pytest.mark.parametrize(
    "slots, specialized, ctx, options",
    [
        (4, False, 300, {}),
        (20, True, 300, dict(kv_blocks=0)),
        (20, True, 640, dict(kv_blocks=0)),
        (10, True, 1500, {}),
        (16, True, 300, {}),
        (16, True, 640, {}),
        (16, True, 1500, {}),
    ],
)
def test_stream_loop_tracks_float64_like_the_register_form(slots, specialized, ctx, options):
    """Short and long contexts: 8 splits per head past 512 keys, several key blocks per split at 1,500; the
    first key blocks in shared memory (the default) or every key from global memory."""
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.kernels import stream_loop as sl

    case = _ouro_case(4, [ctx]).rows([0])
    assert sl.stream_fusable(
        case.state, case.weights, case.cos, case.sin, case.k_cache, case.v_cache, case.tables
    )
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = sl.loop_streamed(*case.args(kc, vc), slots=slots, specialized=specialized, **options)
    ref, ref_k, ref_v = reference_loop(case)
    got_k, got_v = written_rows(case, kc, vc)
    registers = pl.loop_staged(*case.args())
    assert rel_err(out, ref) < max(0.05, 1.5 * rel_err(registers, ref))
    assert rel_err(got_k, ref_k) < 0.02 and rel_err(got_v, ref_v) < 0.02
    assert pl.barrier_timeouts() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
def test_stream_loop_repeats_and_replays_bit_for_bit():
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.kernels import stream_loop as sl

    case = _ouro_case(2, [777]).rows([0])
    for options in ({}, dict(slots=20, kv_blocks=0)):
        out = sl.loop_streamed(*case.args(), **options)
        assert all(torch.equal(out, sl.loop_streamed(*case.args(), **options)) for _ in range(3))
        args = case.args()
        sl.loop_streamed(*args, **options)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = sl.loop_streamed(*args, **options)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, out)
    assert pl.barrier_timeouts() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
def test_no_program_leaves_a_grid_barrier_before_the_last_one_arrives():
    """Every program's clock (`times=`): at each of the 5 barriers per layer, the first departure follows the
    last arrival, and each program's stamps run forward."""
    from looptrace.engine.kernels import stream_loop as sl

    layers = 3
    case = _ouro_case(layers, [640]).rows([0])
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    times = torch.zeros(programs, sl.stamp_count(layers), dtype=torch.int64, device="cuda")
    sl.loop_streamed(*case.args(), times=times)
    t = times.cpu()
    assert bool((t[:, 1:] >= t[:, :-1]).all()) and bool((t > 0).all())
    for barrier in range(5 * layers):
        arrive, leave = t[:, 1 + 2 * barrier], t[:, 2 + 2 * barrier]
        assert int(leave.min()) >= int(arrive.max()), barrier


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
@pytest.mark.parametrize("ctx", [300, 640, 1500])
def test_keys_in_shared_memory_and_l2_hints_change_no_bit(ctx):
    """`kv_blocks` only moves where the first key blocks are read from: state and K/V bit for bit the same
    (1,500 keys: blocks past those in shared memory come from global memory in the same launch)."""
    from looptrace.engine.kernels import stream_loop as sl

    case = _ouro_case(2, [ctx]).rows([0])
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    plain = sl.loop_streamed(*case.args(kc, vc), slots=20, kv_blocks=0)
    for slots, blocks in ((20, 1), (16, 2), (12, 2)):
        kc2, vc2 = case.k_cache.clone(), case.v_cache.clone()
        moved = sl.loop_streamed(*case.args(kc2, vc2), slots=slots, kv_blocks=blocks)
        assert torch.equal(plain, moved) and torch.equal(kc, kc2) and torch.equal(vc, vc2), (slots, blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
@pytest.mark.parametrize("register_form", [False, True])
def test_fast_decodes_one_row_loops_through_the_ring_and_repeats_its_tokens(monkeypatch, register_form):
    """`fast` (which has `kernels.persistent_loop_tma` on), alone or with `kernels.persistent_loop`'s
    register form under it, on Ouro-1.4B's shapes (4 layers): the settings active, a one-row decode goes
    through `loop_streamed` (seen when its graph is captured), and a request's greedy tokens repeat."""
    from looptrace.engine import LLMEngine, SamplingParams
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.kernels import stream_loop as sl
    from looptrace.engine.model_config import resolve_preset, with_overrides
    from looptrace.recipes import load_recipe

    rows_seen: list[int] = []
    real = sl.loop_streamed

    def spy(state, *args, **kwargs):
        rows_seen.append(state.shape[0])
        return real(state, *args, **kwargs)

    monkeypatch.setattr(sl, "loop_streamed", spy)
    spec = with_overrides(resolve_preset("ouro-1.4b", "cuda"), n_core=4)
    sets = ["kv.prefix_caching=false", "scheduler.max_model_len=512", "kv.num_blocks=1024"]
    sets += ["kernels.persistent_loop=true"] if register_form else []
    engine = LLMEngine.from_spec(spec, load_recipe("fast", sets).config, device="cuda", seed=1)
    assert not {"kernels.persistent_loop", "kernels.persistent_loop_tma"} & set(engine.inactive_settings)
    assert engine.cfg.kernels.persistent_loop == register_form
    params = SamplingParams(max_tokens=8)
    first = engine.generate([[3 + j for j in range(40)]], params)
    assert engine.generate([[3 + j for j in range(40)]], params) == first
    assert rows_seen and set(rows_seen) == {1}
    assert pl.barrier_timeouts() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
@pytest.mark.parametrize("ctx", [300, 640, 1500])
def test_tagged_words_change_no_bit_against_the_grid_barriers(ctx):
    """The linked form (values handed over as tagged words, no grid barriers) computes what the barrier form
    computes: state and K/V bit for bit the same, short and long contexts (1 to 3 key blocks per split)."""
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.kernels import stream_loop as sl

    case = _ouro_case(3, [ctx]).rows([0])
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    barriers = sl.loop_streamed(*case.args(kc, vc), linked=False)
    for slots in (16, 18):
        kc2, vc2 = case.k_cache.clone(), case.v_cache.clone()
        linked = sl.loop_streamed(*case.args(kc2, vc2), slots=slots, linked=True)
        assert torch.equal(barriers, linked) and torch.equal(kc, kc2) and torch.equal(vc, vc2), slots
    assert pl.barrier_timeouts() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
def test_tagged_words_survive_the_tag_and_launch_count_wrapping():
    """The tags follow a launch count kept on the GPU: launches whose layers cross the 16-bit tag's wrap, and
    the count's own wrap, repeat the first launch's bits (a stale word taken for a fresh one would not), in
    eager launches and in a CUDA graph replayed several times."""
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.kernels import stream_loop as sl

    layers = 2
    case = _ouro_case(layers, [640]).rows([0])
    first = sl.loop_streamed(*case.args(), linked=True)
    words, _parts = sl.links(first.device, case.weights, pl.split_slots(case.tables, case.page, 64))
    for count in (65535 // layers - 1, sl.EPOCHS_C.value - 1):
        words[-1] = count
        for _ in range(3):
            assert torch.equal(sl.loop_streamed(*case.args(), linked=True), first), count
    args = case.args()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sl.loop_streamed(*args, linked=True)
    for _ in range(4):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)
    assert pl.barrier_timeouts() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
@pytest.mark.parametrize("linked", [False, True])
def test_a_timed_launch_changes_no_bit_and_stamps_every_boundary(linked):
    """`times=` (what `looptrace profile` sets to split the launch by stage) compiles the clock stamps in:
    the state and the K/V it writes stay bit for bit the untimed launch's (the profile re-runs graph bodies
    timed on the engine's own cache), and every program stamps its start, every boundary and its end in
    order."""
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.kernels import stream_loop as sl

    layers = 3
    case = _ouro_case(layers, [640]).rows([0])
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    plain = sl.loop_streamed(*case.args(kc, vc), linked=linked)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    times = torch.zeros(programs, sl.stamp_count(layers), dtype=torch.int64, device="cuda")
    kc2, vc2 = case.k_cache.clone(), case.v_cache.clone()
    timed = sl.loop_streamed(*case.args(kc2, vc2), linked=linked, times=times)
    assert torch.equal(plain, timed) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert bool((times > 0).all()) and bool((times.diff(dim=1) >= 0).all())
    assert pl.barrier_timeouts() == 0
