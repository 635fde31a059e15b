"""The GEMV's fused output forms and their R0 claim: bitwise the GEMV + the exact kernel run after it.

- `gemv.gate_up_silu` (`kernels.gemv_silu_out`): the gate/up GEMV stores SiLU(gate)·up itself.
- `gemv.linear_residual_norm` (`kernels.gemv_norm_out`): the o / down GEMV's last column block applies the
  sandwich block's residual norm (h = res + post(y), x = nxt(h)) to the whole row.

CPU: the kernels run in the Triton interpreter in a child process, with the CUDA-only gates opened for CPU
tensors there (`conftest._open_cuda_gates`): fused against the two launches (bitwise), against
float64, run to run, with and without a split K and the weight preload; the ticket counters left at zero.
GPU (`gpu` marker): Ouro-1.4B's shapes (gate_up 11264 x 2048; o 2048 x 2048 and down 2048 x 5632 before a
residual norm), bitwise against the two launches in bf16, eager, replayed in a CUDA graph and under PDL.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
import torch.nn.functional as F

from tests.engine.kernels.conftest import _open_cuda_gates, _rel_err, _replayed
from tests.helpers import interpreted_results_fixture, tickets_left_zero

HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu
EPS = 1e-6


def _reference_silu_out(x, w):
    """float64 `silu(gate) * up` of `x @ w.T` with w = [gate; up]."""
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return F.silu(gate) * up


def _reference_norm_out(a, w, res, w_post, w_next):
    """float64 (h, x) of `h = res + post(a @ w.T)`, `x = nxt(h)`."""

    def norm(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()

    h = res.double() + norm(a.double() @ w.double().T, w_post)
    return h, norm(h, w_next)


def _norm_inputs(gen, hidden: int, k: int):
    a = torch.randn(1, k, generator=gen).bfloat16()
    w = (torch.randn(hidden, k, generator=gen) / 8).bfloat16()
    res = torch.randn(1, hidden, generator=gen).bfloat16()
    w_post = (1 + torch.randn(hidden, generator=gen) / 4).bfloat16()
    w_next = (1 + torch.randn(hidden, generator=gen) / 4).bfloat16()
    return a, w, res, w_post, w_next


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels import launch_mode, rmsnorm, silu_mul
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    _open_cuda_gates()
    gen = torch.Generator().manual_seed(11)
    res: dict = {}
    # With the real tile table: Ouro-1.4B's gate/up (11264 x 2048) runs one split and takes the form; a
    # 2816 x 512 gate/up (hidden 512) splits K in the plain GEMV, so the form must refuse it (it ran there
    # once and changed a token: its one-split sums are not the split GEMV's).
    one_row = [torch.zeros(1, k).bfloat16() for k in (2048, 512)]
    res["silu_follows_the_table_split"] = [
        gemv_forms.gate_up_silu_fusable(one_row[0], torch.zeros(11264, 2048).bfloat16())
        and not gemv_forms.gate_up_silu_fusable(one_row[1], torch.zeros(2816, 512).bfloat16()),
        None,
    ]
    for split in (1, 2):  # the norm form after one split and after a split-K combine
        cfg = gemv_tiles.TileConfig(block_n=16, block_k=32, split_k=split)
        gemv_tiles.pick_config = lambda m, n, k, cfg=cfg: cfg

        x = torch.randn(1, 96, generator=gen).bfloat16()
        w = (torch.randn(2 * 40, 96, generator=gen) / 8).bfloat16()  # [gate; up], I = 40: a partial block
        # the form runs one split: it refuses a weight whose plain GEMV splits K (other sums)
        res[f"silu_fusable_{split}"] = [gemv_forms.gate_up_silu_fusable(x, w) == (split == 1), None]
        if split == 1:
            fused = gemv_forms.gate_up_silu(x, w)
            two = silu_mul.silu_mul(*gemv_kernel.gemv(x, w).chunk(2, dim=-1))
            res["silu_bitwise"] = [torch.equal(fused, two), _rel_err(fused, two.double())]
            res["silu_vs_float64"] = [_rel_err(fused, _reference_silu_out(x, w)) < 0.03, None]

        a, wo, resid, w_post, w_next = _norm_inputs(gen, 256, 96)
        h, xn = gemv_forms.linear_residual_norm(a, wo, w_post, EPS, resid, w_next, EPS)
        h_two, x_two = rmsnorm.residual_rms_norm(gemv_kernel.gemv(a, wo), w_post, EPS, resid, w_next, EPS)
        h_ref, x_ref = _reference_norm_out(a, wo, resid, w_post, w_next)
        res[f"norm_fusable_{split}"] = [gemv_forms.linear_norm_fusable(a, wo, resid, w_post, w_next), None]
        res[f"norm_bitwise_{split}"] = [torch.equal(h, h_two) and torch.equal(xn, x_two), _rel_err(xn, x_ref)]
        res[f"norm_vs_float64_{split}"] = [_rel_err(h, h_ref) < 0.02 and _rel_err(xn, x_ref) < 0.03, None]
        again = gemv_forms.linear_residual_norm(a, wo, w_post, EPS, resid, w_next, EPS)
        res[f"norm_deterministic_{split}"] = [torch.equal(again[0], h) and torch.equal(again[1], xn), None]
    gemv_tiles.pick_config = lambda m, n, k: gemv_tiles.TileConfig(block_n=16, block_k=32, split_k=1)
    runs = []
    for preload in (False, True):  # the preload path of both forms (no PDL here: the same loads, earlier)
        launch_mode.weight_preload = lambda preload=preload: preload
        runs.append(
            (
                gemv_forms.gate_up_silu(x, w),
                *gemv_forms.linear_residual_norm(a, wo, w_post, EPS, resid, w_next, EPS),
            )
        )
    res["preload_bitwise"] = [all(torch.equal(p, q) for p, q in zip(*runs)), None]
    two_rows = torch.cat([a, a])
    res["refuses_two_rows"] = [
        not gemv_forms.gate_up_silu_fusable(torch.cat([x, x]), w)
        and not gemv_forms.linear_norm_fusable(two_rows, wo, resid, w_post, w_next),
        None,
    ]
    res["norm_refuses_width_mismatch"] = [
        not gemv_forms.linear_norm_fusable(a, wo[:128], resid, w_post, w_next),
        None,
    ]
    res["silu_refuses_odd_rows"] = [not gemv_forms.gate_up_silu_fusable(x, w[:79]), None]
    _many_row_silu_checks(res, gen, gemv_tiles, gemv_forms, gemv_kernel, silu_mul)
    res["counters_left_zero"] = tickets_left_zero()
    return res


def _many_row_silu_checks(res, gen, gemv_tiles, gemv_forms, gemv_kernel, silu_mul) -> None:
    """`kernels.gemv_batch` + `gemv_silu_out`: the SiLU·mul output form at 3 and 8 rows through the
    tensor-core configs (weight tile on the left or x first), bitwise the many-row GEMV + silu_mul; routed
    only with the batch's row limit, refused where the plain GEMV splits K."""
    w = (torch.randn(2 * 40, 96, generator=gen) / 8).bfloat16()  # [gate; up], I = 40: a partial block
    for x_first in (False, True):
        cfg = gemv_tiles.TileConfig(block_n=16, block_k=32, split_k=1, dot=True, x_first=x_first)
        gemv_tiles.pick_config = lambda m, n, k, cfg=cfg: cfg
        for m in (3, 8):
            x = torch.randn(m, 96, generator=gen).bfloat16()
            tag = f"silu_rows_{m}_{'x_first' if x_first else 'w_first'}"
            batch = gemv_forms.gate_up_silu_fusable(x, w, gemv_forms.route_rows(True))
            alone = gemv_forms.gate_up_silu_fusable(x, w)
            res[f"{tag}_routed_with_the_batch_only"] = [batch and not alone, None]
            fused = gemv_forms.gate_up_silu(x, w)
            two = silu_mul.silu_mul(*gemv_kernel.gemv(x, w).chunk(2, dim=-1))
            res[f"{tag}_bitwise"] = [fused.shape == (m, 40) and torch.equal(fused, two), _rel_err(fused, two)]
            res[f"{tag}_vs_float64"] = [_rel_err(fused, _reference_silu_out(x, w)) < 0.03, None]
    split = gemv_tiles.TileConfig(block_n=16, block_k=32, split_k=2, dot=True)
    gemv_tiles.pick_config = lambda m, n, k: split
    x = torch.randn(8, 96, generator=gen).bfloat16()
    res["silu_rows_refuses_a_split_k"] = [not gemv_forms.gate_up_silu_fusable(x, w, 8), None]


cpu_results = interpreted_results_fixture("tests.engine.kernels.gemv.test_forms_outputs")


CPU_CHECKS = [
    f"{name}_{split}"
    for split in (1, 2)
    for name in (
        "silu_fusable",
        "norm_fusable",
        "norm_bitwise",
        "norm_vs_float64",
        "norm_deterministic",
    )
] + ["silu_bitwise", "silu_vs_float64", "preload_bitwise", "refuses_two_rows", "norm_refuses_width_mismatch",
     "silu_refuses_odd_rows", "silu_follows_the_table_split", "counters_left_zero",
     "silu_rows_refuses_a_split_k"] + [
    f"silu_rows_{m}_{side}_{what}" for m in (3, 8) for side in ("w_first", "x_first")
    for what in ("routed_with_the_batch_only", "bitwise", "vs_float64")
]  # fmt: skip


@pytest.mark.parametrize("check", CPU_CHECKS)
def test_interpreted_fused_output_forms(cpu_results, check):
    ok, detail = cpu_results[check]
    assert ok, f"{check}: {detail}"


@pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")
@pytest.mark.parametrize(("form", "n", "k"), [(1, 11264, 2048), (2, 2048, 2048), (2, 2048, 5632)])
def test_sm90_fused_output_forms_compile_and_wait_before_any_global_access(form, n, k):
    """Ouro-1.4B's fused launches (gate_up with SiLU·mul; o and down with the residual norm) compile for
    sm_90 on the CPU with their launch options; under PDL only weight loads may come before the wait."""
    from tests.engine.kernels.test_launch_mode import _first, fused_gemv_ptx

    # the silu form: gate and up in one program, one split
    ptx = fused_gemv_ptx(n, k, n, one_split=form == 1, X_FORM=0, Y_FORM=form, NORM_N=n if form == 2 else 1)
    assert 0 <= _first(ptx, "griddepcontrol.wait") < _first(ptx, r"\b(ld|st|atom)\.global")
    if form == 2:  # the split's ticket (o and down split K), then the row's
        assert sum(bool(re.search(r"atom\.global\.gpu\.acq_rel\.add", line)) for line in ptx) == 2


@pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")
@pytest.mark.parametrize("x_first", [False, True])
def test_sm90_many_row_silu_form_compiles_to_tensor_core_mmas(x_first):
    """The SiLU·mul output form at 8 rows (`kernels.gemv_batch`), Ouro-1.4B's gate/up in one split of
    128-wide K tiles: compiles for sm_90 with the forms' launch options, waits before any global access
    under PDL, and multiplies on tensor cores (wgmma with the weight tile on the left; mma.sync m16 with x
    first)."""
    from tests.engine.kernels.test_launch_mode import _first, fused_gemv_ptx

    ptx = fused_gemv_ptx(11264, 2048, 11264, one_split=True, X_FORM=0, Y_FORM=1, M=8, M_PAD=16, DOT=True,
                         X_FIRST=x_first, BLOCK_N=64, BLOCK_K=128, K_TILES=16)  # fmt: skip
    assert 0 <= _first(ptx, "griddepcontrol.wait") < _first(ptx, r"\b(ld|st|atom)\.global")
    mma = r"\bmma\.sync\.aligned\.m16n8k16" if x_first else r"wgmma\.mma_async"
    assert _first(ptx, mma) >= 0


# ------------------------------------------------------------------------------------------------- GPU


def _cuda():
    if not (torch.cuda.is_available() and HAS_TRITON):
        pytest.skip("needs CUDA and Triton")
    return torch.device("cuda")


def _maybe_pdl(pdl: bool):
    from looptrace.engine.kernels import launch_mode

    return launch_mode.dependent_launches(pdl, weight_preload=pdl)


@gpu
@pytest.mark.parametrize(("graph", "pdl"), [(False, False), (True, False), (True, True)])
def test_gpu_gate_up_silu_is_bitwise_gemv_then_silu_mul(graph, pdl):
    from looptrace.engine.kernels import silu_mul
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    dev = _cuda()
    gen = torch.Generator(device=dev).manual_seed(5)
    x = torch.randn(1, 2048, generator=gen, device=dev).bfloat16()
    w = (torch.randn(11264, 2048, generator=gen, device=dev) / 16).bfloat16()
    assert gemv_forms.gate_up_silu_fusable(x, w)

    def both():
        return gemv_forms.gate_up_silu(x, w), silu_mul.silu_mul(*gemv_kernel.gemv(x, w).chunk(2, dim=-1))

    with _maybe_pdl(pdl):
        fused, two = _replayed(both) if graph else both()
    assert torch.equal(fused, two), _rel_err(fused, two.double())
    assert _rel_err(fused, _reference_silu_out(x, w)) < 0.02


@gpu
@pytest.mark.parametrize("x_first", [False, True])
@pytest.mark.parametrize("rows", [2, 8])
def test_gpu_many_row_gate_up_silu_is_bitwise_gemv_then_silu_mul(monkeypatch, rows, x_first):
    """`kernels.gemv_batch` + `gemv_silu_out` at Ouro-1.4B's gate/up: the form's tensor-core sums with gate
    and up rows side by side in one tile are the plain many-row GEMV's, so SiLU·mul gives the same bits."""
    from looptrace.engine.kernels import silu_mul
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    dev = _cuda()
    cfg = gemv_tiles.TileConfig(block_n=64, block_k=128, split_k=1, num_stages=4, dot=True, x_first=x_first)
    monkeypatch.setattr(gemv_tiles, "pick_config", lambda m, n, k: cfg)
    gen = torch.Generator(device=dev).manual_seed(rows)
    x = torch.randn(rows, 2048, generator=gen, device=dev).bfloat16()
    w = (torch.randn(11264, 2048, generator=gen, device=dev) / 16).bfloat16()
    assert gemv_forms.gate_up_silu_fusable(x, w, gemv_forms.route_rows(True))
    fused = gemv_forms.gate_up_silu(x, w)
    two = silu_mul.silu_mul(*gemv_kernel.gemv(x, w).chunk(2, dim=-1))
    assert torch.equal(fused, two), _rel_err(fused, two.double())
    assert _rel_err(fused, _reference_silu_out(x, w)) < 0.02


@gpu
@pytest.mark.parametrize(("graph", "pdl"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("k", [2048, 5632])
def test_gpu_linear_residual_norm_is_bitwise_gemv_then_residual_norm(k, graph, pdl):
    from looptrace.engine.kernels import rmsnorm
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    dev = _cuda()
    gen = torch.Generator(device=dev).manual_seed(k)
    a = torch.randn(1, k, generator=gen, device=dev).bfloat16()
    w = (torch.randn(2048, k, generator=gen, device=dev) / 32).bfloat16()
    res = torch.randn(1, 2048, generator=gen, device=dev).bfloat16()
    w_post = (1 + torch.randn(2048, generator=gen, device=dev) / 4).bfloat16()
    w_next = (1 + torch.randn(2048, generator=gen, device=dev) / 4).bfloat16()
    assert gemv_forms.linear_norm_fusable(a, w, res, w_post, w_next)

    def both():
        fused = gemv_forms.linear_residual_norm(a, w, w_post, EPS, res, w_next, EPS)
        return (*fused, *rmsnorm.residual_rms_norm(gemv_kernel.gemv(a, w), w_post, EPS, res, w_next, EPS))

    with _maybe_pdl(pdl):
        h, x, h_two, x_two = _replayed(both) if graph else both()
    assert torch.equal(h, h_two) and torch.equal(x, x_two), _rel_err(x, x_two.double())
    h_ref, x_ref = _reference_norm_out(a, w, res, w_post, w_next)
    assert _rel_err(h, h_ref) < 0.02 and _rel_err(x, x_ref) < 0.03


# ---------------------------------------------------------------------------------------------- engine


def test_both_output_forms_are_declared_r0_and_inactive_on_cpu():
    from looptrace.engine.config import toggle_rung
    from tests.helpers import build_engine

    assert toggle_rung("kernels.gemv_silu_out", False, True) == "R0"
    assert toggle_rung("kernels.gemv_norm_out", False, True) == "R0"
    engine = build_engine("ouro-tiny", kernels__gemv=True, kernels__gemv_silu_out=True,
                          kernels__gemv_norm_out=True)  # fmt: skip
    for name in ("kernels.gemv_silu_out", "kernels.gemv_norm_out"):
        assert engine.inactive_settings[name] == "needs kernels.gemv active (CUDA with Triton)"
    flags = ("gemv_silu_out", "gemv_norm_out")
    assert not any(getattr(m, flag, False) for m in engine.model.modules() for flag in flags)


def _small_ouro():
    """Ouro's structure where both output forms act: hidden 256 (the one-kernel residual norm applies)
    and a gate/up whose plain one-row GEMV runs one split (K = 256: two tiles), as Ouro-1.4B's does."""
    from dataclasses import replace

    from looptrace.engine.model_config import PRESETS

    tiny = PRESETS["ouro-tiny"]
    return replace(tiny, name="ouro-small", hidden_size=256, intermediate_size=704, head_dim=128, num_heads=2,
                   num_kv_heads=2)  # fmt: skip


@gpu
def test_gpu_fast_generates_the_same_tokens_with_and_without_the_output_forms(monkeypatch):
    """fast at batch 1 (where the forms act) and at batch 4 (where they do not): the same tokens with them
    on and off; with them on, both fused launches ran."""
    from tests.engine.kernels.gemv.test_forms_inputs import fast_with_and_without

    _cuda()
    off, on, calls_off, calls_on = fast_with_and_without(
        monkeypatch, _small_ouro(), ("kernels.gemv_silu_out", "kernels.gemv_norm_out"),
        ("gate_up_silu", "linear_residual_norm"),
    )  # fmt: skip
    assert calls_off == {"gate_up_silu": 0, "linear_residual_norm": 0}
    assert calls_on["gate_up_silu"] > 0 and calls_on["linear_residual_norm"] > 0, calls_on
    assert off[0] == on[0], "batch 4: the forms do not act, the tokens must not change"
    assert off[1] == on[1], f"batch 1: {off[1]} vs {on[1]}"


@gpu
def test_gpu_gemv_batch_routes_batched_rows_through_the_gemv_and_its_output_forms(monkeypatch):
    """fast with `kernels.gemv_batch`: at batch 4 the plain GEMV, the SiLU·mul form and the q/k/v RoPE form
    run (more calls than without it, where batch 4 is cuBLAS's), and every request still gets its 12 tokens.
    The tokens themselves may differ, batched or alone (R3: other sums than cuBLAS's, also in a prompt's
    prefill of at most 8 tokens), so they are not compared."""
    from tests.engine.kernels.gemv.test_forms_inputs import fast_with_and_without

    _cuda()
    spied = ("gemv", "gate_up_silu", "gemv_rope.qkv_rope_write")
    off, on, calls_off, calls_on = fast_with_and_without(
        monkeypatch, _small_ouro(), ("kernels.gemv_batch",), spied
    )
    assert all(calls_on[name] > calls_off[name] for name in spied), (calls_off, calls_on)
    assert [len(t) for t in on[0]] == [len(t) for t in off[0]] == [12] * 4
