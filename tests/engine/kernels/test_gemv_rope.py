"""`gemv_rope.qkv_rope_write` (`kernels.gemv_rope_out`, R0): the q/k/v GEMV that rotates its own columns
and writes the K/V cache is bitwise the plain GEMV + `rope.rope_half_write_kv`.

CPU: the kernels run in the Triton interpreter in a child process, with the CUDA-only gates opened for CPU
tensors there: fused against the two launches (q and every cache row, bitwise), against float64, run to
run, with the weight preload, with grouped K/V heads, a padding row (no cache write), and the shapes the
form refuses. The sm_90 PTX of Ouro-1.4B's launch waits before its first global access under PDL.
GPU (`gpu` marker): Ouro-1.4B's qkv (6144 x 2048, 16 heads of 128), bitwise against the two launches in
bf16, eager, replayed in a CUDA graph and under PDL.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine.kernels.conftest import _open_cuda_gates, _rel_err, _replayed
from tests.helpers import interpreted_results_fixture

HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu


def _inputs(gen, heads, k: int, device="cpu", blocks: int = 3, block_size: int = 4, layers: int = 2):
    """x [1, k], W [(Hq + 2 Hk) D, k], cos/sin [1, D] bf16, and zeroed K/V caches [E, block, Hk, D]."""
    hq, hk, d = heads
    x = torch.randn(1, k, generator=gen, device=device).bfloat16()
    w = (torch.randn((hq + 2 * hk) * d, k, generator=gen, device=device) / 8).bfloat16()
    angle = torch.rand(1, d // 2, generator=gen, device=device) * 6.0
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1).bfloat16()
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1).bfloat16()
    kc = torch.zeros(blocks * layers, block_size, hk, d, dtype=torch.bfloat16, device=device)
    return x, w, cos, sin, kc, torch.zeros_like(kc)


def _reference(x, w, cos, sin, heads):
    """float64 rotated q, rotated k and v of one row."""
    hq, hk, d = heads
    q, k, v = (x.double() @ w.double().T).split([hq * d, hk * d, hk * d], dim=-1)
    c, s = cos.double(), sin.double()

    def rot(t):
        t = t.view(-1, d)
        return t * c + torch.cat([-t[:, d // 2 :], t[:, : d // 2]], dim=-1) * s

    return rot(q), rot(k), v.view(hk, d)


def _both(x, w, cos, sin, kc, vc, went, woff, layer, heads):
    """(fused q, its caches, two-launch q, its caches): each path writes its own copy of the caches."""
    from looptrace.engine.kernels import gemv_rope, rope
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    hq, hk, d = heads
    kc2, vc2 = kc.clone(), vc.clone()
    q = gemv_rope.qkv_rope_write(x, w, cos, sin, kc, vc, went, woff, layer, heads)
    q2, k2, v2 = gemv_kernel.gemv(x, w).split([hq * d, hk * d, hk * d], dim=-1)
    q2 = rope.rope_half_write_kv(
        q2.view(1, hq, d), k2.view(1, hk, d), v2.view(1, hk, d), cos, sin, kc2, vc2, went, woff, layer
    )
    return q, kc, vc, q2, kc2, vc2


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels import gemv_rope, launch_mode, rope
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    _open_cuda_gates()
    rope.supported_half = lambda q, k, cos, sin: q.dtype == k.dtype == cos.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    res: dict = {}
    cfg = gemv_tiles.TileConfig(block_n=8, block_k=32, split_k=1)  # 4 pairs per program, two K tiles
    gemv_tiles.pick_config = lambda m, n, k: cfg
    went, woff = torch.tensor([2]), torch.tensor([3])
    for name, heads in (("mha", (2, 2, 16)), ("gqa", (4, 1, 16))):
        x, w, cos, sin, kc, vc = _inputs(gen, heads, 64)
        hq, hk, d = heads
        res[f"{name}_fusable"] = [gemv_rope.qkv_rope_fusable(x, w, cos, sin, kc, vc, heads), None]
        q, kc, vc, q2, kc2, vc2 = _both(x, w, cos, sin, kc, vc, went, woff, 1, heads)
        same = torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
        res[f"{name}_bitwise_two_launches"] = [same, _rel_err(q, q2.double())]
        q_ref, k_ref, v_ref = _reference(x, w, cos, sin, heads)
        slot_k, slot_v = kc[3, 3], vc[3, 3]  # entry 2 + layer 1, offset 3
        errs = [_rel_err(q.view(hq, d), q_ref), _rel_err(slot_k, k_ref), _rel_err(slot_v, v_ref)]
        res[f"{name}_vs_float64"] = [max(errs) < 0.03, errs]
        written = (kc != 0).any(dim=(1, 2, 3)).nonzero().flatten().tolist()
        res[f"{name}_writes_one_slot"] = [written == [3] and int((kc[3] != 0).any(-1).any(-1).sum()) == 1,
                                          written]  # fmt: skip
        again = gemv_rope.qkv_rope_write(x, w, cos, sin, kc.clone(), vc.clone(), went, woff, 1, heads)
        res[f"{name}_deterministic"] = [torch.equal(again, q), None]
    heads = (2, 2, 16)
    x, w, cos, sin, kc, vc = _inputs(gen, heads, 64)
    runs = []
    for preload in (False, True):  # the preload path (no PDL here: the same loads, earlier)
        launch_mode.weight_preload = lambda preload=preload: preload
        k_run, v_run = kc.clone(), vc.clone()
        q_run = gemv_rope.qkv_rope_write(x, w, cos, sin, k_run, v_run, went, woff, 0, heads)
        runs.append((q_run, k_run, v_run))
    res["preload_bitwise"] = [all(torch.equal(p, r) for p, r in zip(*runs)), None]
    pad = torch.tensor([-1])
    q = gemv_rope.qkv_rope_write(x, w, cos, sin, kc, vc, pad, woff, 0, heads)
    no_cache = not kc.any().item() and not vc.any().item()
    res["padding_row_writes_no_cache"] = [no_cache and torch.equal(q, runs[0][0]), None]
    fusable = gemv_rope.qkv_rope_fusable
    res["refuses_two_rows"] = [not fusable(torch.cat([x, x]), w, cos, sin, kc, vc, heads), None]
    res["refuses_other_heads"] = [not fusable(x, w, cos, sin, kc, vc, (3, 2, 16)), None]
    wide = gemv_tiles.TileConfig(block_n=32, block_k=32, split_k=1)  # 16 pairs per program, 8 per head
    gemv_tiles.pick_config = lambda m, n, k: wide
    res["refuses_blocks_across_heads"] = [not fusable(x, w, cos, sin, kc, vc, heads), None]
    gemv_tiles.pick_config = lambda m, n, k: gemv_tiles.TileConfig(block_n=8, block_k=16, split_k=2)
    res["refuses_split_k"] = [not fusable(x, w, cos, sin, kc, vc, heads), None]
    _many_row_checks(res, gen, gemv_tiles, gemv_rope, rope)
    return res


def _many_row_checks(res, gen, gemv_tiles, gemv_rope, rope) -> None:
    """`kernels.gemv_batch`: 3 and 8 rows through the tensor-core configs (weight tile first or x first),
    each row with its own rotation and cache slot, one of them a padding row: bitwise the many-row GEMV +
    `rope_half_write_kv`; routed only with the batch's row limit."""
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    heads = (2, 1, 16)
    hq, hk, d = heads
    for x_first in (False, True):
        cfg = gemv_tiles.TileConfig(block_n=16, block_k=32, split_k=1, dot=True, x_first=x_first)
        gemv_tiles.pick_config = lambda m, n, k, cfg=cfg: cfg
        for m in (3, 8):
            tag = f"rows_{m}_{'x_first' if x_first else 'w_first'}"
            _x, w, _c, _s, kc, vc = _inputs(gen, heads, 64, blocks=5, block_size=4)
            x = torch.randn(m, 64, generator=gen).bfloat16()
            angle = torch.rand(m, d // 2, generator=gen) * 6.0
            cos = torch.cat([angle.cos(), angle.cos()], dim=-1).bfloat16()
            sin = torch.cat([angle.sin(), angle.sin()], dim=-1).bfloat16()
            went = torch.tensor([0, 2, 4, -1, 6, 2, 8, 4][:m])  # entries of layer 0 (layer_id 1 adds one)
            woff = torch.tensor([0, 1, 2, 3, 1, 3, 0, 3][:m])  # every (entry, offset) slot distinct
            batch = gemv_rope.qkv_rope_fusable(x, w, cos, sin, kc, vc, heads, 8)
            alone = gemv_rope.qkv_rope_fusable(x, w, cos, sin, kc, vc, heads)
            res[f"{tag}_routed_with_the_batch_only"] = [batch and not alone, None]
            kc2, vc2 = kc.clone(), vc.clone()
            q = gemv_rope.qkv_rope_write(x, w, cos, sin, kc, vc, went, woff, 1, heads)
            q2, k2, v2 = gemv_kernel.gemv(x, w).split([hq * d, hk * d, hk * d], dim=-1)
            q2 = rope.rope_half_write_kv(q2.reshape(m, hq, d), k2.reshape(m, hk, d), v2.reshape(m, hk, d),
                                         cos, sin, kc2, vc2, went, woff, 1)  # fmt: skip
            caches = torch.equal(kc, kc2) and torch.equal(vc, vc2)
            same = q.shape == (m, hq, d) and torch.equal(q, q2) and caches
            written = int((kc != 0).any(-1).any(-1).sum())  # (entry, offset) slots holding a key
            res[f"{tag}_bitwise_two_launches"] = [same and written == int((went >= 0).sum()), written]


cpu_results = interpreted_results_fixture("tests.engine.kernels.test_gemv_rope")


CPU_CHECKS = [
    f"{heads}_{name}"
    for heads in ("mha", "gqa")
    for name in ("fusable", "bitwise_two_launches", "vs_float64", "writes_one_slot", "deterministic")
] + ["preload_bitwise", "padding_row_writes_no_cache", "refuses_two_rows", "refuses_other_heads",
     "refuses_blocks_across_heads", "refuses_split_k"] + [
    f"rows_{m}_{side}_{what}" for m in (3, 8) for side in ("w_first", "x_first")
    for what in ("routed_with_the_batch_only", "bitwise_two_launches")
]  # fmt: skip


@pytest.mark.parametrize("check", CPU_CHECKS)
def test_interpreted_qkv_rope_write(cpu_results, check):
    ok, detail = cpu_results[check]
    assert ok, f"{check}: {detail}"


@pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")
def test_ouro_qkv_takes_the_form_with_the_real_tile_table():
    """Ouro-1.4B's qkv (6144 x 2048) runs one split with 8-column tiles: 4 pairs per program, 16 programs
    per 128-wide head. (CUDA gates closed on CPU: the pure shape logic is checked through its parts.)"""
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    cfg = gemv_tiles.one_row_config(6144, 2048)
    assert cfg is not None and gemv_tiles.split_for(6144, 2048, cfg)[0] == 1
    assert 64 % (cfg.block_n // 2) == 0


def _sm90_qkv_rope_ptx(consts: dict, num_warps: int, num_stages: int) -> list[str]:
    """The sm_90 PTX of `_qkv_rope_kernel` at Ouro-1.4B's shapes with these constexprs, under PDL."""
    from looptrace.engine.kernels import gemv_rope
    from looptrace.engine.kernels.device_helpers import EXACT_OPTIONS
    from tests.engine.kernels.test_launch_mode import _compile_sm90

    sig = {name: "*bf16" for name in ("x_ptr", "w_ptr", "q_ptr", "kc_ptr", "vc_ptr", "cos_ptr", "sin_ptr")}
    sig |= {"went_ptr": "*i64", "woff_ptr": "*i64", "layer_id": "i32"}
    sig |= {name: "i32" for name in ("stride_wn", "stride_e", "stride_s", "stride_ch", "HQ", "HK")}
    sig |= {name: "i32" for name in ("stride_cos", "stride_sin", "stride_went", "stride_woff")}
    compiled = _compile_sm90(gemv_rope._qkv_rope_kernel, sig, consts, num_warps=num_warps,
                             num_stages=num_stages, launch_pdl=True, **EXACT_OPTIONS)  # fmt: skip
    return compiled.asm["ptx"].splitlines()


@pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")
def test_sm90_qkv_rope_waits_before_any_global_access():
    """Ouro-1.4B's launch compiles for sm_90 on the CPU with its options; under PDL only the weight
    preload may come before the wait, and no store or atomic does."""
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles
    from tests.engine.kernels.test_launch_mode import _first

    cfg = gemv_tiles.one_row_config(6144, 2048)
    consts = dict(K=2048, HALF=64, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_TILES=2048 // cfg.block_k,
                  EVEN_K=True, PDL=True, PRELOAD=1, M=1, M_PAD=1, DOT=False, X_FIRST=False)  # fmt: skip
    ptx = _sm90_qkv_rope_ptx(consts, cfg.num_warps, cfg.num_stages)
    wait = _first(ptx, "griddepcontrol.wait")
    assert 0 <= _first(ptx, "griddepcontrol.launch_dependents") < wait
    assert wait < _first(ptx, r"\b(st|atom)\.global")
    assert 0 <= _first(ptx, r"\bld\.global") < wait  # the preloaded weight tile


@pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")
@pytest.mark.parametrize("x_first", [False, True])
def test_sm90_many_row_qkv_rope_compiles_to_tensor_core_mmas(x_first):
    """`kernels.gemv_batch` at 8 rows: the launch compiles for sm_90 with a one-split tensor-core tile
    (64 columns: 32 pairs of a 128-wide head), waits before any global access under PDL and multiplies on
    tensor cores (wgmma with the weight tile first; mma.sync m16 with x first)."""
    from tests.engine.kernels.test_launch_mode import _first

    consts = dict(K=2048, HALF=64, BLOCK_N=64, BLOCK_K=128, K_TILES=16, EVEN_K=True, PDL=True, PRELOAD=0,
                  M=8, M_PAD=16, DOT=True, X_FIRST=x_first)  # fmt: skip
    ptx = _sm90_qkv_rope_ptx(consts, num_warps=4, num_stages=4)
    assert 0 <= _first(ptx, "griddepcontrol.wait") < _first(ptx, r"\b(ld|st|atom)\.global")
    assert _first(ptx, r"\bmma\.sync\.aligned\.m16n8k16" if x_first else r"wgmma\.mma_async") >= 0


# ------------------------------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize(("graph", "pdl"), [(False, False), (True, False), (True, True)])
def test_gpu_qkv_rope_write_is_bitwise_gemv_then_rope_write(graph, pdl):
    from looptrace.engine.kernels import gemv_rope, launch_mode

    if not (torch.cuda.is_available() and HAS_TRITON):
        pytest.skip("needs CUDA and Triton")
    dev = torch.device("cuda")
    if pdl and not launch_mode.supported(dev):
        pytest.skip("PDL needs sm_90+")
    gen = torch.Generator(device=dev).manual_seed(22)
    heads = (16, 16, 128)  # Ouro-1.4B
    x, w, cos, sin, kc, vc = _inputs(gen, heads, 2048, device=dev, blocks=4, block_size=16, layers=24)
    went = torch.tensor([8], device=dev)
    woff = torch.tensor([5], device=dev)
    assert gemv_rope.qkv_rope_fusable(x, w, cos, sin, kc, vc, heads)

    def both():
        kc.zero_(), vc.zero_()
        return _both(x, w, cos, sin, kc, vc, went, woff, 7, heads)

    with launch_mode.dependent_launches(pdl, weight_preload=pdl):
        q, k1, v1, q2, k2, v2 = _replayed(both) if graph else both()
    assert torch.equal(q, q2), _rel_err(q, q2.double())
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert k1[15, 5].abs().sum() > 0 and v1[15, 5].abs().sum() > 0  # entry 8 + layer 7, offset 5
    q_ref, k_ref, v_ref = _reference(x, w, cos, sin, heads)
    assert _rel_err(q.view(16, 128), q_ref) < 0.02
    assert _rel_err(k1[15, 5], k_ref) < 0.02 and _rel_err(v1[15, 5], v_ref) < 0.02


@gpu
@pytest.mark.parametrize("x_first", [False, True])
def test_gpu_many_row_qkv_rope_write_is_bitwise_gemv_then_rope_write(monkeypatch, x_first):
    """`kernels.gemv_batch` at Ouro-1.4B's q/k/v, 8 rows (one a padding row), a one-split tensor-core tile:
    q and every cache row bitwise the many-row GEMV + `rope_half_write_kv`."""
    from looptrace.engine.kernels import gemv_rope, rope
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    if not (torch.cuda.is_available() and HAS_TRITON):
        pytest.skip("needs CUDA and Triton")
    dev = torch.device("cuda")
    cfg = gemv_tiles.TileConfig(block_n=64, block_k=128, split_k=1, num_stages=4, dot=True, x_first=x_first)
    monkeypatch.setattr(gemv_tiles, "pick_config", lambda m, n, k: cfg)
    gen = torch.Generator(device=dev).manual_seed(23)
    heads, m = (16, 16, 128), 8
    _x, w, _c, _s, kc, vc = _inputs(gen, heads, 2048, device=dev, blocks=8, block_size=16, layers=24)
    x = torch.randn(m, 2048, generator=gen, device=dev).bfloat16()
    angle = torch.rand(m, 64, generator=gen, device=dev) * 6.0
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1).bfloat16()
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1).bfloat16()
    went = torch.tensor([0, 24, 48, -1, 72, 96, 120, 144], device=dev)
    woff = torch.tensor([0, 3, 5, 7, 9, 11, 13, 15], device=dev)
    assert gemv_rope.qkv_rope_fusable(x, w, cos, sin, kc, vc, heads, 8)
    kc2, vc2 = kc.clone(), vc.clone()
    q = gemv_rope.qkv_rope_write(x, w, cos, sin, kc, vc, went, woff, 7, heads)
    q2, k2, v2 = gemv_kernel.gemv(x, w).split([2048, 2048, 2048], dim=-1)
    q2 = rope.rope_half_write_kv(q2.reshape(m, 16, 128), k2.reshape(m, 16, 128), v2.reshape(m, 16, 128),
                                 cos, sin, kc2, vc2, went, woff, 7)  # fmt: skip
    assert torch.equal(q, q2), _rel_err(q, q2.double())
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert int((kc != 0).any(-1).any(-1).sum()) == 7  # one slot per row but the padding one


# ---------------------------------------------------------------------------------------------- engine


def test_the_form_is_declared_r0_and_inactive_on_cpu():
    from looptrace.engine.config import toggle_rung
    from tests.helpers import build_engine

    assert toggle_rung("kernels.gemv_rope_out", False, True) == "R0"
    engine = build_engine("ouro-tiny", kernels__gemv=True, kernels__rope_kv_write=True,
                          kernels__gemv_rope_out=True)  # fmt: skip
    assert engine.inactive_settings["kernels.gemv_rope_out"] == "needs kernels.gemv active (CUDA with Triton)"
    assert not any(getattr(m, "gemv_rope_out", False) for m in engine.model.modules())


@gpu
def test_gpu_fast_generates_the_same_tokens_with_and_without_the_rope_form(monkeypatch):
    """fast at batch 1 (where the form acts) and at batch 4 (where it does not): the same tokens with it on
    and off; with it on, the fused launch ran (and rope_half_write_kv still ran for the batched rows)."""
    from tests.engine.kernels.gemv.test_forms_inputs import fast_with_and_without
    from tests.engine.kernels.gemv.test_forms_outputs import _small_ouro

    FUSED, SEPARATE = "gemv_rope.qkv_rope_write", "rope.rope_half_write_kv"  # the kernel modules' own names

    if not (torch.cuda.is_available() and HAS_TRITON):
        pytest.skip("needs CUDA and Triton")
    off, on, calls_off, calls_on = fast_with_and_without(
        monkeypatch, _small_ouro(), ("kernels.gemv_rope_out",), (FUSED, SEPARATE)
    )
    assert calls_off[FUSED] == 0 and calls_off[SEPARATE] > 0
    assert calls_on[FUSED] > 0 and calls_on[SEPARATE] > 0, calls_on
    assert off[0] == on[0], "batch 4: the form does not act, the tokens must not change"
    assert off[1] == on[1], f"batch 1: {off[1]} vs {on[1]}"
