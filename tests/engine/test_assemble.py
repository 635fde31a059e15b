"""The kernel registry's resolution in the plan (plan.resolve_kernels) and the variants `assemble` installs
(the registry's own data: tests/engine/kernels/test_registry.py). The plan is pure, so what an engine on
CUDA would run is checked here on CPU by resolving it for a CUDA device; the variants are installed on CPU
models, where every kernel falls back to the eager ops, so a model with them computes the plain model's
bits."""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from looptrace.engine import SamplingParams
from looptrace.engine import kernels as K
from looptrace.engine.assemble import install_variants
from looptrace.engine.kernels import launch_mode
from looptrace.engine.model_config import resolve_preset
from looptrace.engine.models.ouro import (
    ChainedOuroForCausalLM,
    ExactOuroMLP,
    FusedGateUpOuroMLP,
    GemvRopeOuroAttention,
    GemvSiluOutOuroMLP,
    OuroMLP,
    PersistentLoop,
    PersistentOuroForCausalLM,
    RingOnlyLoop,
    StreamedPersistentLoop,
)
from looptrace.engine.plan import resolve_plan
from looptrace.engine.projections import stack_loop_weights
from looptrace.recipes import load_recipe
from tests.helpers import Recorder, build_engine

CUDA = torch.device("cuda")  # only named: resolving a plan touches no device


def _cuda_plan(recipe: str, sets=(), model: str = "ouro-tiny", pdl: bool = True):
    cfg = load_recipe(recipe, list(sets)).config
    return resolve_plan(cfg, resolve_preset(model, "cpu"), CUDA, kernels_on=True, pdl_on=pdl)


def test_fast_on_an_h100_runs_every_kernel_it_asks_for():
    plan = _cuda_plan("fast")
    asked = {
        f"kernels.{k}"
        for k, v in dataclasses.asdict(load_recipe("fast").config.kernels).items()
        if v is True or v == "triton"
    }
    assert set(plan.kernels.active) == asked and plan.inactive_settings == {}
    assert plan.launch == launch_mode.LaunchPlan(dependent=True, weight_preload=True, kv_prefetch=True)


@pytest.mark.parametrize(
    "model, recipe, sets, pdl, expected",
    [
        # PDL needs sm_90: the preloads that act under it go with it, each with its reason
        (
            "ouro-tiny", "fast", (), False,
            {
                "kernels.pdl": "programmatic dependent launch needs a CUDA GPU of compute capability 9+",
                "kernels.gemv_preload": "needs kernels.gemv and kernels.pdl active (CUDA sm_90+)",
                "kernels.attn_prefetch": "needs kernels.pdl active (CUDA sm_90+) and Triton attention",
                "kernels.persistent_loop_tma": (
                    "the TMA ring needs a CUDA GPU of compute capability 9+ (TMA and mbarriers)"
                ),
            },
        ),
        # a requirement of a requirement: the first unmet one is reported
        (
            "ouro-tiny", "fast", ("kernels.attention=torch",), True,
            {
                "kernels.attention": None,  # not asked for: absent
                "kernels.rope_kv_write": "needs the Triton attention path (kernels.attention=triton)",
                "kernels.gemv_rope_out": "needs kernels.rope_kv_write active",
                "kernels.attn_prefetch": "needs kernels.pdl active (CUDA sm_90+) and Triton attention",
                "kernels.attn_slots": "needs the Triton attention (kernels.attention=triton, CUDA)",
            },
        ),
        # a family without the fused forms: the kernel could run, the family has no variant for it
        (
            "huginn-tiny", "fast", ("kernels.gemv_norm=true", "kernels.persistent_loop=true",
                                    "kernels.persistent_loop_tma=true"), True,
            {
                "kernels.residual_norm": "no fused kernel for the huginn family",
                "kernels.rope_kv_write": "no fused kernel for the huginn family",
                "kernels.gemv_norm": "no fused GEMV form for the huginn family",
                "kernels.gemv_silu_out": "no fused GEMV form for the huginn family",
                "kernels.gemv_rope_out": "no fused GEMV form for the huginn family",
                "kernels.persistent_loop": "no persistent loop kernel for the huginn family",
                "kernels.persistent_loop_tma": "no TMA-ring loop kernel for the huginn family",
            },
        ),
        # the TMA ring: Hopper's TMA and mbarriers (the compute capability check), and the op it replaces
        (
            "ouro-tiny", "fast", ("kernels.persistent_loop=true", "kernels.persistent_loop_tma=true"), False,
            {
                "kernels.pdl": "programmatic dependent launch needs a CUDA GPU of compute capability 9+",
                "kernels.gemv_preload": "needs kernels.gemv and kernels.pdl active (CUDA sm_90+)",
                "kernels.attn_prefetch": "needs kernels.pdl active (CUDA sm_90+) and Triton attention",
                "kernels.persistent_loop_tma": (
                    "the TMA ring needs a CUDA GPU of compute capability 9+ (TMA and mbarriers)"
                ),
            },
        ),
        (
            "ouro-tiny", "exactloop", ("kernels.persistent_loop_tma=true",), False,
            {
                "kernels.persistent_loop_tma": (
                    "the TMA ring needs a CUDA GPU of compute capability 9+ (TMA and mbarriers)"
                ),
            },
        ),
        # the persistent loop replaces the chained loop: without it, or with the perturbation's layer hooks,
        # it stays off with its reason
        (
            "ouro-tiny", "fast", ("kernels.residual_norm=false", "kernels.persistent_loop=true"), True,
            {
                "kernels.residual_norm": None,
                "kernels.persistent_loop": (
                    "needs kernels.residual_norm active (the chained loop it replaces)"
                ),
                "kernels.persistent_loop_tma": (
                    "needs kernels.residual_norm active (the chained loop it replaces)"
                ),
            },
        ),
        (
            "ouro-tiny", "fast", ("debug.perturb=recurrent:*:*:mlp", "kernels.persistent_loop=true"), True,
            {
                "kernels.persistent_loop": (
                    "debug.perturb hooks layer ops, which the persistent loop does not run"
                ),
                "kernels.persistent_loop_tma": (
                    "debug.perturb hooks layer ops, which the TMA-ring loop does not run"
                ),
            },
        ),
    ],
)  # fmt: skip
def test_inactive_settings_come_from_the_declared_requirements(model, recipe, sets, pdl, expected):
    plan = _cuda_plan(recipe, sets, model, pdl)
    assert plan.inactive_settings == {k: v for k, v in expected.items() if v is not None}
    assert not set(plan.kernels.active) & set(expected)


def test_variants_stack_on_one_module_in_method_order():
    engine = build_engine("ouro-tiny", kernels__fused_projections=True)
    model = engine.model
    for setting in ("kernels.exact", "kernels.gemv_silu", "kernels.gemv_silu_out"):
        assert install_variants(model, setting) > 0
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, (GemvSiluOutOuroMLP, FusedGateUpOuroMLP, ExactOuroMLP))
    mro = type(mlp).__mro__
    assert mro.index(GemvSiluOutOuroMLP) < mro.index(ExactOuroMLP) < mro.index(OuroMLP)
    assert "fused_linear" not in vars(mlp) and "forward" not in vars(mlp)  # no instance patch
    assert install_variants(model, "kernels.gemv_rope_out") == engine.spec.n_core  # on fused q/k/v only
    assert isinstance(model.model.layers[0].self_attn, GemvRopeOuroAttention)


def _states(variants: tuple[str, ...], **settings):
    engine = build_engine("ouro-tiny", noise="sequential", **settings)
    for setting in variants:
        install_variants(engine.model, setting)
    rec = Recorder(hidden=True)
    engine.attach(rec)
    with K.graph_warmup():  # every variant takes its kernel path (as under capture); on CPU: eager ops
        out = engine.generate([[5, 9, 13, 7, 21], [6, 9, 15]], SamplingParams(max_tokens=4))
    return out, rec.states


def test_every_ouro_variant_of_fast_keeps_the_plain_models_bits_on_cpu():
    """Every module variant `fast` and its off forms install, on one CPU model: each kernel path falls back
    to the eager ops, so the wiring of the variants (which step each overrides, in which order) must give
    the plain model's hidden states bit for bit."""
    fast = ("kernels.exact", "kernels.residual_norm", "kernels.gemv", "kernels.gemv_silu")
    fast += ("kernels.gemv_batch", "kernels.gemv_norm", "kernels.gemv_silu_out", "kernels.gemv_norm_out")
    plain_out, plain = _states((), kernels__fused_projections=True)
    out, states = _states(fast, kernels__fused_projections=True)
    assert isinstance(build_engine("ouro-tiny").model, ChainedOuroForCausalLM) is False
    assert out == plain_out and plain.keys() == states.keys() and len(plain) > 0
    assert [key for key, h in plain.items() if not torch.equal(h, states[key])] == []


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable")
def test_the_persistent_loop_stacks_the_weights_as_views_and_keeps_the_plain_bits_on_cpu():
    """`stack_loop_weights` re-points every layer's weights (and the fused q/k/v, gate/up tensors) at views
    of one stack per kind: same names, same values. On CPU the persistent variant's loop (with the TMA
    ring's op over it) falls back to the chained one (fp32 rows, no CUDA), so the model computes the plain
    bits."""
    plain_out, plain = _states((), kernels__fused_projections=True)
    engine = build_engine("ouro-tiny", noise="sequential", kernels__fused_projections=True)
    model = engine.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for setting in ("kernels.residual_norm", "kernels.persistent_loop"):
        install_variants(model, setting)
    weights = stack_loop_weights(model)
    model.persistent = PersistentLoop(weights)
    # the model (already the persistent variant) and the op, as assemble does
    assert install_variants(model, "kernels.persistent_loop_tma") == 2
    assert isinstance(model.persistent, StreamedPersistentLoop)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    hq, hk, d = weights.heads
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv.data_ptr() == weights.qkv[i].data_ptr()
        assert attn.v_proj.weight.data_ptr() == weights.qkv[i, (hq + hk) * d :].data_ptr()
        assert mlp.gate_up.data_ptr() == weights.gate_up[i].data_ptr()
        assert mlp.up_proj.weight.data_ptr() == weights.gate_up[i, engine.spec.intermediate_size :].data_ptr()
        assert mlp.down_proj.weight.data_ptr() == weights.down[i].data_ptr()
        assert layer.post_attention_layernorm_2.weight.data_ptr() == weights.norms[i, 3].data_ptr()
    assert isinstance(model, PersistentOuroForCausalLM)
    rec = Recorder(hidden=True)
    engine.attach(rec)
    with K.graph_warmup():
        out = engine.generate([[5, 9, 13, 7, 21], [6, 9, 15]], SamplingParams(max_tokens=4))
    assert out == plain_out and rec.states.keys() == plain.keys()
    assert [key for key, h in plain.items() if not torch.equal(h, rec.states[key])] == []


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable")
def test_the_tma_ring_alone_attaches_its_own_op_and_leaves_what_it_cannot_take_to_the_chain(monkeypatch):
    """`kernels.persistent_loop_tma` without `kernels.persistent_loop` (as `fast` has it): `assemble` makes
    the model the persistent variant with a ring op of its own, whose loops the ring cannot take go back to
    the chained path, not to the register form (which the op swapped over `persistent_loop`'s keeps); on
    CPU every loop goes the chained way, so the model computes the plain bits."""
    from looptrace.engine.assemble import assemble

    plain_out, _plain = _states((), kernels__fused_projections=True)
    engine = build_engine("ouro-tiny", noise="sequential", kernels__fused_projections=True)
    model = engine.model
    plan = SimpleNamespace(
        kernels=SimpleNamespace(active=["kernels.residual_norm", "kernels.persistent_loop_tma"])
    )
    assemble(model, plan, torch.device("cpu"), torch.float32)
    assert isinstance(model, PersistentOuroForCausalLM) and isinstance(
        model.persistent, StreamedPersistentLoop
    )
    alone = model.persistent
    assert isinstance(alone, RingOnlyLoop)
    swapped = StreamedPersistentLoop(alone.weights)  # the class as swapped over the register form's op
    monkeypatch.setattr(StreamedPersistentLoop, "ring_refusal", lambda self, state, ctx: "no ring here")
    register = (True, "one launch per loop (register form)")
    monkeypatch.setattr(PersistentLoop, "route", lambda self, state, ctx: register)  # the register form would
    one_row, decode = torch.zeros(1, 4), SimpleNamespace(packed=None)
    assert (alone.fits(one_row, decode), swapped.fits(one_row, decode)) == (False, True)
    assert (alone.routes, swapped.routes) == ({1: "layer by layer (no ring here)"}, {1: register[1]})
    monkeypatch.undo()
    alone.routes.clear()
    with K.graph_warmup():
        out = engine.generate([[5, 9, 13, 7, 21], [6, 9, 15]], SamplingParams(max_tokens=4))
    assert out == plain_out
    # every decode loop went layer by layer, each row count with its reason; the snapshot copies them
    routes = engine.snapshot().loop_routes
    assert routes[2] == "layer by layer (2 rows: the ring takes one)"
    for rows, how in routes.items():
        why = "the ring runs on Hopper GPUs (sm_90) only" if rows == 1 else f"{rows} rows: the ring takes one"
        assert how == f"layer by layer ({why})"
    assert routes == alone.routes and routes is not alone.routes
