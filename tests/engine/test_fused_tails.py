"""The model wiring of the fused exact kernels beyond single ops: `kernels.residual_norm` (Ouro's post-norm,
residual add and next pre-norm in one launch) and `kernels.rope_kv_write` (rotate-half RoPE of q and k with
the K/V cache write in one launch).

CPU: the chained layer wiring gives the plain model's hidden states bit for bit (the kernels fall back to
the eager ops on CPU, so this checks which norm feeds which add); the chained core is used only where exact
kernels run; the settings are inactive without CUDA and install nothing for families without the kernels.
The kernels themselves: tests/engine/kernels/test_rmsnorm.py (`residual_rms_norm`) and test_rope.py
(`rope_half_write_kv`), in the Triton interpreter and bitwise on a GPU.
"""

from __future__ import annotations

import torch

from looptrace.engine import SamplingParams
from looptrace.engine import kernels as K
from looptrace.engine.assemble import install_variants
from looptrace.engine.models.ouro import ChainedOuroForCausalLM
from tests.helpers import Recorder, build_engine

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
