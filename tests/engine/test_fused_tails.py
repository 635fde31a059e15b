"""The fused exact kernels beyond single ops: `kernels.residual_norm` (Ouro's post-norm, residual
add and next pre-norm in one launch) and `kernels.rope_kv_write` (rotate-half RoPE of q and k with the K/V
cache write in one launch).

CPU: the chained layer wiring gives the plain model's hidden states bit for bit (the kernels fall back to
the eager ops on CPU, so this checks which norm feeds which add), and the kernels run in the Triton
interpreter against the eager ops (its bf16 casts round toward zero, so only approximately; v, copied
without arithmetic, must be exact, and padding rows must write nothing). Bitwise equality of the kernels is
a GPU test: tests/engine/kernels/test_rmsnorm.py (`test_residual_norm_bitwise`) and test_rope.py
(`test_rope_kv_write_bitwise`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from looptrace.engine import SamplingParams
from looptrace.engine import kernels as K
from looptrace.engine.assemble import install_variants
from looptrace.engine.models.ouro import ChainedOuroForCausalLM
from tests.helpers import Recorder, build_engine, interpreted_checks

HAS_TRITON = importlib.util.find_spec("triton") is not None
PROMPTS = [[5 + i, 9, 13 + 2 * i, 7, 21, 3 + i] for i in range(3)]


def _hidden_states(fused: bool, prompts, max_tokens: int, gemv_forms: bool = False, **settings):
    engine = build_engine("ouro-tiny", noise="sequential", **settings)
    if fused:
        assert install_variants(engine.model, "kernels.residual_norm") == 1
    if gemv_forms:  # the GEMV's output forms' wiring; their fused launches decline on CPU
        for flag in ("gemv_silu_out", "gemv_norm_out"):
            assert install_variants(engine.model, f"kernels.{flag}") > 0
    rec = Recorder(hidden=True)
    engine.attach(rec)
    # graph_warmup: every call takes the exact-kernel path (as under capture), so the chained core runs
    # for decode rows too; on CPU each fused op computes with the eager ops.
    with K.graph_warmup():
        out = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return out, rec.states


def test_chained_ouro_core_equals_the_plain_layers_bit_for_bit():
    plain_out, plain_states = _hidden_states(False, PROMPTS, 6)
    fused_out, fused_states = _hidden_states(True, PROMPTS, 6)
    assert fused_out == plain_out
    assert plain_states.keys() == fused_states.keys() and len(plain_states) > 0
    bad = [key for key, h in plain_states.items() if not torch.equal(h, fused_states[key])]
    assert bad == []


def test_chained_layers_with_the_gemv_output_forms_switched_on_keep_the_bits(monkeypatch):
    """`kernels.gemv_silu_out` / `gemv_norm_out` variants on the model: the MLP asks for the fused gate/up and
    each sandwich block hands its output projection to the `ResidualTail` (`finish`); on CPU both fused
    launches decline, so the same eager ops run and every hidden state keeps the plain model's bits."""
    asked = {"silu": 0, "norm": 0}
    from looptrace.engine.kernels.gemv import forms as gemv_forms

    real_silu, real_norm = gemv_forms.gate_up_silu_fusable, gemv_forms.linear_norm_fusable
    monkeypatch.setattr(gemv_forms, "gate_up_silu_fusable", lambda *a: asked.update(silu=1) or real_silu(*a))
    monkeypatch.setattr(gemv_forms, "linear_norm_fusable", lambda *a: asked.update(norm=1) or real_norm(*a))
    fused_qkv = {"kernels__fused_projections": True}  # the silu form takes the fused gate/up weight
    plain_out, plain_states = _hidden_states(False, PROMPTS, 4, **fused_qkv)
    forms_out, forms_states = _hidden_states(True, PROMPTS, 4, gemv_forms=True, **fused_qkv)
    assert asked == {"silu": 1, "norm": 1}  # both paths were taken (and declined: CPU)
    assert forms_out == plain_out
    assert plain_states.keys() == forms_states.keys() and len(plain_states) > 0
    assert [key for key, h in plain_states.items() if not torch.equal(h, forms_states[key])] == []


def test_chained_core_is_used_only_where_exact_kernels_run(monkeypatch):
    calls = []
    from looptrace.engine.kernels import rmsnorm

    real = rmsnorm.residual_rms_norm
    monkeypatch.setattr(rmsnorm, "residual_rms_norm", lambda *a: calls.append(1) or real(*a))
    engine = build_engine("ouro-tiny")
    install_variants(engine.model, "kernels.residual_norm")
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2))  # eager rows <= 256: plain layers
    assert calls == []
    with K.graph_warmup():
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    layers = engine.spec.n_core
    assert len(calls) > 0 and len(calls) % (2 * layers) == 0  # two launches per layer and loop


def test_settings_without_cuda_are_reported_inactive():
    engine = build_engine(
        "ouro-tiny", kernels__exact=True, kernels__residual_norm=True, kernels__rope_kv_write=True
    )
    assert "kernels.residual_norm" in engine.inactive_settings
    assert "kernels.rope_kv_write" in engine.inactive_settings
    assert not isinstance(engine.model, ChainedOuroForCausalLM)


def test_families_without_the_fused_kernels_enable_nothing():
    engine = build_engine("huginn-tiny")
    assert install_variants(engine.model, "kernels.residual_norm") == 0
    assert install_variants(engine.model, "kernels.rope_kv_write") == 0


# ------------------------------------------------------------------------------ CPU (Triton interpreter)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference over the largest magnitude of b."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels import paged_attention as pa
    from looptrace.engine.kernels import rmsnorm, rope
    from looptrace.engine.layers import RotaryHalf

    # The wrappers take CUDA tensors only; the interpreter runs the same kernels on CPU tensors.
    rmsnorm.supported = lambda x, w: x.dtype == torch.bfloat16 and w.shape[0] == x.shape[-1]
    rope.supported_half = lambda q, k, c, s: True
    gen = torch.Generator().manual_seed(7)
    res = {}
    for rows, n in ((1, 2048), (5, 2048), (3, 512)):
        y = (torch.randn(rows, n, generator=gen) * 3).bfloat16()
        h = (torch.randn(rows, n, generator=gen) * 2).bfloat16()
        w1 = (1 + 0.5 * torch.randn(n, generator=gen)).bfloat16()
        w2 = (1 + 0.5 * torch.randn(n, generator=gen)).bfloat16()

        def norm(x, w):
            f = x.float()
            return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

        ref_h = h + norm(y, w1)
        ref_out = norm(ref_h, w2)
        got_h, got_out = rmsnorm.residual_rms_norm(y, w1, 1e-6, h, w2, 1e-6)
        # Three bf16 roundings toward zero in a row: compare at the scale of the row (a wrong weight, a
        # missing add or a norm of the wrong tensor is off by O(1) of it).
        errs = [_rel(got_h, ref_h), _rel(got_out, ref_out), _rel(got_out, norm(got_h, w2))]
        res[f"residual_{rows}x{n}"] = [max(errs) < 0.02, errs]
    # rope + K/V write: 4 rows (the last a padding row), 3 layers, pages of 16
    rows, hq, hk, d, layers, page, layer_id = 4, 4, 2, 64, 3, 16, 2
    qkv = torch.randn(rows, (hq + 2 * hk) * d, generator=gen).bfloat16()
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.reshape(rows, hq, d), k.reshape(rows, hk, d), v.reshape(rows, hk, d)
    mod = RotaryHalf(d, 10000.0)
    cos, sin = mod.tables(torch.tensor([0, 5, 17, 3]), torch.bfloat16)
    went = torch.tensor([0, 3, 6, -1]) * 1
    woff = torch.tensor([4, 0, 15, 2])
    kc_ref, vc_ref = (torch.zeros(5 * layers, page, hk, d, dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.zeros(5 * layers, page, hk, d, dtype=torch.bfloat16) for _ in range(2))
    # Reference: the single rope kernel (the same interpreted roundings) then the K/V write kernel; and
    # the eager rotation, at the scale of the row.
    q_ref, k_ref = rope.rope_half(q, k, cos, sin)
    pa.write_kv(k_ref, v, kc_ref, vc_ref, went, woff, layer_id)
    q_got = rope.rope_half_write_kv(q, k, v, cos, sin, kc, vc, went, woff, layer_id)
    q_eager, _ = mod(q, k, cos, sin)
    res["rope_q"] = [bool(torch.equal(q_got, q_ref)) and _rel(q_got, q_eager) < 0.02, _rel(q_got, q_eager)]
    res["rope_k_in_cache"] = [bool(torch.equal(kc, kc_ref)), None]
    res["v_copied_exactly"] = [bool(torch.equal(vc, vc_ref)), None]
    written = torch.zeros(5 * layers, page, dtype=torch.bool)
    for r in range(rows - 1):
        written[went[r] + layer_id, woff[r]] = True
    res["nothing_else_written"] = [
        bool((kc[~written] == 0).all() and (vc[~written] == 0).all() and written.sum() == rows - 1),
        None,
    ]
    return res


@pytest.fixture(scope="module")
def cpu_results():
    if not HAS_TRITON:
        pytest.skip("triton not importable")
    return interpreted_checks("tests.engine.test_fused_tails")


@pytest.mark.parametrize("case", ["residual_1x2048", "residual_5x2048", "residual_3x512"])
def test_interpreted_residual_norm_matches_eager(cpu_results, case):
    ok, detail = cpu_results[case]
    assert ok, detail


@pytest.mark.parametrize("case", ["rope_q", "rope_k_in_cache", "v_copied_exactly", "nothing_else_written"])
def test_interpreted_rope_kv_write(cpu_results, case):
    ok, detail = cpu_results[case]
    assert ok, detail
