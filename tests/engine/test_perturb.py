"""debug.perturb: one ulp on one op at one stage/loop/layer, installed only when set."""

from __future__ import annotations

import pytest
import torch

from looptrace.engine.config import EngineConfig
from looptrace.engine.hooks import Observer
from looptrace.engine.llm_engine import EngineInputError, LLMEngine
from looptrace.engine.perturb import PerturbSpecError, Place, bump, parse_place
from looptrace.engine.request import SamplingParams


def make(perturb: str | None, model: str = "ouro") -> LLMEngine:
    cfg = EngineConfig()
    cfg.scheduler.max_model_len = 32
    cfg.debug.perturb = perturb
    return LLMEngine.from_preset(model, cfg, seed=0)


def test_parse_place() -> None:
    assert parse_place("prefill:1:0:mlp") == Place("prefill", 1, "core0", "mlp")
    assert parse_place("recurrent:*:coda1:attn.paged") == Place("recurrent", "*", "coda1", "attn.paged")
    assert parse_place("coda:-:-:lm_head") == Place("coda", "-", "-", "lm_head")
    assert str(parse_place("prefill:1:0:mlp")) == "prefill:1:core0:mlp"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("mlp", "4 fields stage, loop, layer, op"),
        ("decode:1:0:mlp", "stage 'decode'"),
        ("prefill:x:0:mlp", "loop 'x'"),
        ("prefill:1:block0:mlp", "layer 'block0'"),
        ("prefill:1:0:", "4 fields stage, loop, layer, op"),
    ],
)
def test_bad_places(text: str, needle: str) -> None:
    with pytest.raises(PerturbSpecError, match=needle.replace("*", r"\*")):
        parse_place(text)


def test_bump_is_one_ulp_toward_plus_inf() -> None:
    x = torch.tensor([1.0, -1.0, 0.0, 3.5e-3])
    y = bump(x)
    assert torch.equal(y, torch.nextafter(x, torch.full_like(x, float("inf"))))
    assert (y > x).all()
    rows = bump(torch.ones(3, 2), torch.tensor([False, True, False]))
    assert torch.equal(rows[0], torch.ones(2)) and (rows[1] > 1).all()


def test_bump_by_n_ulps_scales_each_elements_own_ulp() -> None:
    x = torch.tensor([1.0, -1.0, 1024.0, 3.5e-3])
    ulp = torch.nextafter(x, torch.full_like(x, float("inf"))) - x
    y = bump(x, ulps=1 << 20)
    assert torch.equal(y - x, ulp * (1 << 20))
    assert y[0] == 1.125 and y[2] == 1152.0  # 2**20 ulps of a power of two: one eighth of it


def test_perturb_ulps_without_a_place_is_reported_inactive() -> None:
    cfg = EngineConfig()
    cfg.debug.perturb_ulps = 64
    e = LLMEngine.from_preset("ouro", cfg, seed=0)
    assert e.perturbation is None
    assert e.plan.inactive_settings["debug.perturb_ulps"] == "needs debug.perturb (the place it sizes)"


def test_no_setting_registers_nothing() -> None:
    e = make(None)
    assert e.perturbation is None
    assert not any(m._forward_hooks or m._forward_pre_hooks for _, m in e.observable_modules())
    assert not e.hooks.active


def test_hits_only_the_named_place() -> None:
    prompt = list(range(1, 9))
    e = make("recurrent:2:core1:mlp")
    e.generate([prompt], SamplingParams(max_tokens=3))
    assert e.perturbation.hits == 2  # loop 2 of the two decode tokens (the first token comes from prefill)
    e = make("prefill:1:core0:mlp")
    e.generate([prompt], SamplingParams(max_tokens=3))
    assert e.perturbation.hits == 1  # one prefill chunk
    e = make("coda:-:-:lm_head")
    e.generate([prompt], SamplingParams(max_tokens=3))
    assert e.perturbation.hits == 3  # every sampled token


class Logits(Observer):
    wants_logits = True

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def on_logits(self, request_ids, logits) -> None:
        self.rows.append(logits.clone())


def test_one_ulp_changes_the_logits_and_the_logits_hook_is_opt_in() -> None:
    prompt = list(range(1, 9))
    out = []
    for spec in (None, "prefill:0:core2:self_attn"):
        e = make(spec)
        obs = Logits()
        e.attach(obs)
        assert e.hooks.wants_logits
        e.generate([prompt], SamplingParams(max_tokens=2))
        out.append(torch.cat(obs.rows))
    assert out[0].shape == (2, e.spec.vocab_size)
    assert not torch.equal(out[0], out[1])
    e.detach(obs)
    assert not e.hooks.wants_logits


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("prefill:1:0:norm", "matches 4 ops"),
        ("prefill:1:0:nope", "no op named 'nope'"),
        ("prefill:1:0", "4 fields stage, loop, layer, op"),
    ],
)
def test_bad_setting_is_a_one_line_engine_error(spec: str, needle: str) -> None:
    with pytest.raises(EngineInputError, match=needle) as info:
        make(spec)
    assert "\n" not in str(info.value)
