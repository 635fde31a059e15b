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


@needs_triton
def test_the_kernel_compiles_for_hopper_without_spills():
    sys.path.insert(0, str(BENCH))
    import kernel_stream_loop_compile as compile_bench

    row = compile_bench.compile_form(slots=20, warps=4, ws=True)  # `loop_streamed`'s default form
    assert row["spill_bytes"] == 0 and row["registers"] <= 255
    assert 20 * 16 * 256 * 2 <= row["shared_bytes"] <= 227 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
@pytest.mark.parametrize(
    "slots, specialized, ctx", [(4, False, 300), (20, True, 300), (20, True, 640), (10, True, 1500)]
)
def test_stream_loop_tracks_float64_like_the_register_form(slots, specialized, ctx):
    """Short and long contexts: 8 splits per head past 512 keys, several key blocks per split at 1,500."""
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.kernels import stream_loop as sl

    case = _ouro_case(4, [ctx]).rows([0])
    assert sl.stream_fusable(
        case.state, case.weights, case.cos, case.sin, case.k_cache, case.v_cache, case.tables
    )
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = sl.loop_streamed(*case.args(kc, vc), slots=slots, specialized=specialized)
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
    out = sl.loop_streamed(*case.args())
    assert all(torch.equal(out, sl.loop_streamed(*case.args())) for _ in range(3))
    args = case.args()
    sl.loop_streamed(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sl.loop_streamed(*args)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)
    assert pl.barrier_timeouts() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
def test_fast_with_the_ring_decodes_one_row_loops_through_it_and_repeats_its_tokens(monkeypatch):
    """`fast` + `kernels.persistent_loop_tma` on Ouro-1.4B's shapes (4 layers): both settings active, a
    one-row decode goes through `loop_streamed` (seen when its graph is captured), and a request's greedy
    tokens repeat."""
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
    sets = ["kernels.persistent_loop=true", "kernels.persistent_loop_tma=true", "kv.prefix_caching=false"]
    sets += ["scheduler.max_model_len=512", "kv.num_blocks=1024"]
    engine = LLMEngine.from_spec(spec, load_recipe("fast", sets).config, device="cuda", seed=1)
    assert not {"kernels.persistent_loop", "kernels.persistent_loop_tma"} & set(engine.inactive_settings)
    params = SamplingParams(max_tokens=8)
    first = engine.generate([[3 + j for j in range(40)]], params)
    assert engine.generate([[3 + j for j in range(40)]], params) == first
    assert rows_seen and set(rows_seen) == {1}
    assert pl.barrier_timeouts() == 0
