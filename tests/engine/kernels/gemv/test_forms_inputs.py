"""The GEMV's fused input forms (`gemv.forms.silu_mul_linear`: `kernels.gemv_silu`;
`gemv.forms.residual_norm_linear`: `kernels.gemv_norm`) and their R0 claim: bitwise the exact kernel that
would run before them + the GEMV; and the weight preload under PDL (`kernels.gemv_preload`, R0: the same
bits with the first tile preloaded).

CPU: the kernels run in the Triton interpreter in a child process. The CUDA-only gates (`supported` of the
GEMV, of `silu_mul` and of `rmsnorm`) are opened for CPU tensors in the child only, so the very functions
the engine calls run: the fused launch against the two launches (bitwise: the interpreter's truncating bf16
casts are the same on both sides), against float64, and run to run; the split counters left at zero.
GPU (`gpu` marker): Ouro-1.4B's shapes (down: 2048 x 5632 from gate/up; gate_up 11264 x 2048 and qkv
6144 x 2048 from a residual norm), bitwise against the two launches in bf16, eager and replayed in a CUDA
graph, and the gates' refusals (two rows, a non-routed config).
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.engine.kernels.conftest import _open_cuda_gates, _rel_err, _replayed
from tests.helpers import interpreted_results_fixture, tickets_left_zero

HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu


def _reference_silu(gate, up, w):
    """float64 `(silu(gate) * up) @ w.T`."""
    g = gate.double()
    return (F.silu(g) * up.double()) @ w.double().T


def _reference_norm(y, res, w_post, w_next, eps, w):
    """float64 `(nxt(res + post(y))) @ w.T` and h."""

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    h = res.double() + norm(y.double(), w_post)
    return norm(h, w_next) @ w.double().T, h


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels import rmsnorm, silu_mul
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    _open_cuda_gates()
    gen = torch.Generator().manual_seed(7)
    res = {}
    cfg = gemv_tiles.TileConfig(block_n=16, block_k=32, split_k=2)
    gemv_tiles.pick_config = lambda m, n, k: cfg  # small shapes, a split-K launch: the ticket path runs too

    k_inter, n_out = 96, 40
    gu = torch.randn(1, 2 * k_inter, generator=gen).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    w = (torch.randn(n_out, k_inter, generator=gen) / 8).bfloat16()
    fused = gemv_forms.silu_mul_linear(gate, up, w)
    two = gemv_kernel.gemv(silu_mul.silu_mul(gate, up), w)
    res["silu_fusable"] = [gemv_forms.silu_mul_fusable(gate, up, w), None]
    res["silu_bitwise_two_launches"] = [torch.equal(fused, two), _rel_err(fused, two.double())]
    res["silu_vs_float64"] = [_rel_err(fused, _reference_silu(gate, up, w)) < 0.03, None]
    res["silu_deterministic"] = [torch.equal(fused, gemv_forms.silu_mul_linear(gate, up, w)), None]

    hidden, eps = 256, 1e-6
    y = torch.randn(1, hidden, generator=gen).bfloat16()
    resid = torch.randn(1, hidden, generator=gen).bfloat16()
    w_post = (1 + torch.randn(hidden, generator=gen) / 4).bfloat16()
    w_next = (1 + torch.randn(hidden, generator=gen) / 4).bfloat16()
    w2 = (torch.randn(n_out, hidden, generator=gen) / 8).bfloat16()
    out, h = gemv_forms.residual_norm_linear(y, w_post, eps, resid, w_next, eps, w2)
    h_two, x_two = rmsnorm.residual_rms_norm(y, w_post, eps, resid, w_next, eps)
    two = gemv_kernel.gemv(x_two, w2)
    ref, h_ref = _reference_norm(y, resid, w_post, w_next, eps, w2)
    res["norm_fusable"] = [gemv_forms.residual_norm_fusable(y, resid, w_post, w_next, w2), None]
    res["norm_bitwise_two_launches"] = [torch.equal(out, two), _rel_err(out, two.double())]
    res["norm_h_bitwise"] = [torch.equal(h, h_two), None]
    res["norm_vs_float64"] = [_rel_err(out, ref) < 0.05 and _rel_err(h, h_ref) < 0.02, _rel_err(out, ref)]
    two_rows = torch.randn(2, hidden, generator=gen).bfloat16()
    res["norm_refuses_two_rows"] = [
        not gemv_forms.residual_norm_fusable(two_rows, two_rows, w_post, w_next, w2),
        None,
    ]
    res.update(_preload_checks(gate, up, w, y, resid, w_post, w_next, w2, eps))
    res["counters_left_zero"] = tickets_left_zero()
    return res


def _preload_checks(gate, up, w, y, resid, w_post, w_next, w2, eps) -> dict:
    """`kernels.gemv_preload` (the first weight tile loaded before the PDL wait, here a no-op): the plain
    GEMV and both forms give the same bits with the preloaded tile as without it."""
    from looptrace.engine.kernels import launch_mode
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    x = torch.randn(1, gate.shape[-1], generator=torch.Generator().manual_seed(8)).bfloat16()
    runs = []
    for preload in (False, True):
        launch_mode.weight_preload = lambda preload=preload: preload
        runs.append((gemv_kernel.gemv(x, w), gemv_forms.silu_mul_linear(gate, up, w),
                     *gemv_forms.residual_norm_linear(y, w_post, eps, resid, w_next, eps, w2)))  # fmt: skip
    return {"preload_bitwise": [all(torch.equal(a, b) for a, b in zip(*runs)), None]}


cpu_results = interpreted_results_fixture("tests.engine.kernels.gemv.test_forms_inputs")


CPU_CHECKS = [
    "silu_fusable",
    "silu_bitwise_two_launches",
    "silu_vs_float64",
    "silu_deterministic",
    "norm_fusable",
    "norm_bitwise_two_launches",
    "norm_h_bitwise",
    "norm_vs_float64",
    "norm_refuses_two_rows",
    "preload_bitwise",
    "counters_left_zero",
]


@pytest.mark.parametrize("check", CPU_CHECKS)
def test_interpreted_fused_input_forms(cpu_results, check):
    ok, detail = cpu_results[check]
    assert ok, f"{check}: {detail}"


@pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")
@pytest.mark.parametrize(("form", "n", "k"), [(1, 2048, 5632), (2, 11264, 2048), (2, 6144, 2048)])
def test_sm90_fused_forms_compile_and_wait_before_any_global_access(form, n, k):
    """Ouro-1.4B's fused launches (down from gate/up; gate_up and qkv from a residual norm) compile for
    sm_90 on the CPU with their launch options; under PDL the norm prologue's loads come after the wait."""
    from tests.engine.kernels.test_launch_mode import _first, fused_gemv_ptx

    ptx = fused_gemv_ptx(n, k, k, X_FORM=form)
    assert 0 <= _first(ptx, "griddepcontrol.wait") < _first(ptx, r"\b(ld|st|atom)\.global")


# ------------------------------------------------------------------------------------------------- GPU


def _cuda():
    if not (torch.cuda.is_available() and HAS_TRITON):
        pytest.skip("needs CUDA and Triton")
    return torch.device("cuda")


@gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_silu_down_is_bitwise_silu_mul_then_gemv(graph):
    from looptrace.engine.kernels import silu_mul
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    dev = _cuda()
    gen = torch.Generator(device=dev).manual_seed(3)
    gu = (torch.randn(1, 11264, generator=gen, device=dev) * 2).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    w = (torch.randn(2048, 5632, generator=gen, device=dev) / 64).bfloat16()
    assert gemv_forms.silu_mul_fusable(gate, up, w)

    def fused():
        return gemv_forms.silu_mul_linear(gate, up, w)

    out = _replayed(fused) if graph else fused()
    two = gemv_kernel.gemv(silu_mul.silu_mul(gate, up), w)
    assert torch.equal(out, two), _rel_err(out, two.double())
    assert _rel_err(out, _reference_silu(gate, up, w)) < 0.02


@gpu
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("n", [11264, 6144])
def test_gpu_residual_norm_gemv_is_bitwise_residual_norm_then_gemv(n, graph):
    from looptrace.engine.kernels import rmsnorm
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    dev = _cuda()
    gen = torch.Generator(device=dev).manual_seed(n)
    y = (torch.randn(1, 2048, generator=gen, device=dev) * 3).bfloat16()
    resid = torch.randn(1, 2048, generator=gen, device=dev).bfloat16()
    w_post = (1 + torch.randn(2048, generator=gen, device=dev) / 4).bfloat16()
    w_next = (1 + torch.randn(2048, generator=gen, device=dev) / 4).bfloat16()
    w = (torch.randn(n, 2048, generator=gen, device=dev) / 32).bfloat16()
    assert gemv_forms.residual_norm_fusable(y, resid, w_post, w_next, w)

    def fused():
        return gemv_forms.residual_norm_linear(y, w_post, 1e-6, resid, w_next, 1e-6, w)

    out, h = _replayed(fused) if graph else fused()
    h_two, x_two = rmsnorm.residual_rms_norm(y, w_post, 1e-6, resid, w_next, 1e-6)
    two = gemv_kernel.gemv(x_two, w)
    assert torch.equal(h, h_two)
    assert torch.equal(out, two), _rel_err(out, two.double())
    ref, _ = _reference_norm(y, resid, w_post, w_next, 1e-6, w)
    assert _rel_err(out, ref) < 0.02
    two_rows = torch.cat([y, y])
    assert not gemv_forms.residual_norm_fusable(two_rows, torch.cat([resid, resid]), w_post, w_next, w)


# ---------------------------------------------------------------------------------------------- engine


def test_both_forms_are_declared_r0_and_inactive_on_cpu():
    from looptrace.engine.config import toggle_rung
    from tests.helpers import build_engine

    assert toggle_rung("kernels.gemv_silu", False, True) == "R0"
    assert toggle_rung("kernels.gemv_norm", False, True) == "R0"
    engine = build_engine("ouro-tiny", kernels__gemv=True, kernels__gemv_silu=True, kernels__gemv_norm=True)
    for name in ("kernels.gemv_silu", "kernels.gemv_norm"):
        assert engine.inactive_settings[name] == "needs kernels.gemv active (CUDA with Triton)"
    from looptrace.engine.models.ouro import DeferredNormOuroForCausalLM, GemvSiluOuroMLP

    forms = (GemvSiluOuroMLP, DeferredNormOuroForCausalLM)
    assert not any(isinstance(m, forms) for m in engine.model.modules())  # no variant installed


def _mid_ouro():
    """Ouro's structure at widths where the one-kernel residual norm applies (hidden 512)."""
    from dataclasses import replace

    from looptrace.engine.model_config import PRESETS

    tiny = PRESETS["ouro-tiny"]
    return replace(tiny, name="ouro-mid", hidden_size=512, intermediate_size=1408, head_dim=128)


def fast_with_and_without(monkeypatch, spec, toggles: tuple[str, ...], spied: tuple[str, ...], off=()):
    """fast on `spec` (CUDA) with the `toggles` off, then on (and the settings `off` off in both): the
    tokens of 4 requests batched and of the first alone, and how often each function in `spied` (a
    `gemv.forms` name, or `module.name` of another kernel module) ran with them off and with them on.
    Returns (tokens off, tokens on, calls off, calls on)."""
    from looptrace.engine import LLMEngine, SamplingParams
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.recipes import load_recipe

    calls = dict.fromkeys(spied, 0)
    for name in spied:  # "fn" is a gemv.forms function; "module.fn" one of another kernel module
        module_name, _, fn = name.rpartition(".")
        module = (
            importlib.import_module(f"looptrace.engine.kernels.{module_name}") if module_name else gemv_forms
        )
        real = getattr(module, fn)

        def spy(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(module, fn, spy)
    prompts = [[3 + i + j for j in range(5 + 7 * i)] for i in range(4)]
    tokens, counts = [], []
    for on in (False, True):
        sets = [f"{t}={str(on).lower()}" for t in toggles] + [f"{t}=false" for t in off]
        sets += ["scheduler.max_model_len=256", "kv.num_blocks=2048"]
        engine = LLMEngine.from_spec(spec, load_recipe("fast", sets).config, device="cuda", seed=1)
        inactive = set(toggles) & set(engine.inactive_settings)
        assert not inactive, {name: engine.inactive_settings[name] for name in inactive}
        batched = engine.generate(prompts, SamplingParams(max_tokens=12, seed=3))
        tokens.append((batched, engine.generate(prompts[:1], SamplingParams(max_tokens=12, seed=3))))
        counts.append(dict(calls))
        del engine
        torch.cuda.empty_cache()
    return tokens[0], tokens[1], counts[0], {k: counts[1][k] - counts[0][k] for k in spied}


@gpu
def test_gpu_fast_generates_the_same_tokens_with_and_without_the_fused_forms(monkeypatch):
    """fast at batch 1 (where the forms act) and at batch 4 (where they do not): the same tokens with them
    on and off; with them on, both fused launches ran. (The output forms, which would take their place,
    stay off.)"""
    _cuda()
    off, on, calls_off, calls_on = fast_with_and_without(
        monkeypatch, _mid_ouro(), ("kernels.gemv_silu", "kernels.gemv_norm"),
        ("silu_mul_linear", "residual_norm_linear"), off=("kernels.gemv_silu_out", "kernels.gemv_norm_out"),
    )  # fmt: skip
    assert calls_off == {"silu_mul_linear": 0, "residual_norm_linear": 0}
    assert calls_on["silu_mul_linear"] > 0 and calls_on["residual_norm_linear"] > 0
    assert off[0] == on[0], "batch 4: the forms do not act, the tokens must not change"
    assert off[1] == on[1], f"batch 1: {off[1]} vs {on[1]}"
