"""looptrace.analysis: comparison, rung grading, ddmin/bisect, per-op localization, the one-point rule."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from looptrace.analysis.bisect import bisect
from looptrace.analysis.ddmin import ddmin
from looptrace.analysis.diff import (
    HOLDS,
    REPORTED,
    UNCHECKED,
    VIOLATED,
    AccuracyResult,
    DiffItem,
    Evidence,
    Lab,
    _judge,
    diff,
    differing_toggles,
    first_divergence,
)
from looptrace.analysis.localize import localize, ulp_distance
from looptrace.engine.config import EngineConfig
from tests.helpers import diff_factory

CPU = torch.device("cpu")


# Pure pieces ---------------------------------------------------------------------------------------------
def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_ulp_distance() -> None:
    x = torch.tensor([1.0, -2.0, 0.5])
    assert ulp_distance(x, torch.nextafter(x, torch.full_like(x, 9.0))) == 1
    tiny = torch.tensor([1e-45])  # the smallest subnormal: -tiny and +tiny are two steps apart
    assert ulp_distance(-tiny, tiny) == 2
    assert ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0])) == 0
    h = torch.tensor([1.0], dtype=torch.bfloat16)
    assert ulp_distance(h, torch.nextafter(h, torch.tensor([2.0], dtype=torch.bfloat16))) == 1


def test_ddmin_finds_a_minimal_cause() -> None:
    calls = []

    def fails(s: frozenset[str]) -> bool:
        calls.append(s)
        return {"c", "f"} <= s

    assert sorted(ddmin(list("abcdefgh"), fails)) == ["c", "f"]
    assert ddmin(["x"], lambda s: True) == ["x"]
    assert ddmin(list("abcd"), lambda s: None if "a" in s and len(s) < 4 else "d" in s) == ["d"]


def ev(identical: int, logits: int | None = None, total: int = 4) -> Evidence:
    return Evidence(identical, logits, total)


def test_grading_rules() -> None:
    same, moved = ev(4, 4), ev(3, 0)
    assert _judge("R0", same, same, False)[0] == HOLDS
    assert _judge("R0", moved, same, False)[0] == VIOLATED
    assert _judge("R0", same, moved, False)[0] == VIOLATED
    assert _judge("R1", moved, same, False)[0] == HOLDS
    assert _judge("R1", same, moved, False)[0] == VIOLATED
    assert _judge("R2", moved, moved, False)[0] == REPORTED
    assert _judge("R3", moved, moved, False)[0] == UNCHECKED
    # --strict: identical tokens with other logits break R0
    assert _judge("R0", ev(4, 0), ev(4, 0), False)[0] == HOLDS
    assert _judge("R0", ev(4, 0), ev(4, 0), True)[0] == VIOLATED


def test_device_checked_rung_is_r3_on_cpu() -> None:
    a, b = EngineConfig(), EngineConfig()
    b.kernels.fused_projections = True
    (t,) = differing_toggles(a, b, "cpu")
    assert (t.declared, t.graded, t.device_check) == ("R0", "R3", True)
    (t,) = differing_toggles(a, b, "cuda")
    assert t.graded == "R0"


def acc(a: int, b: int, n: int, se: float = 0.5) -> AccuracyResult:
    return AccuracyResult("x.jsonl", "w", n, a, b, 100 * (b - a) / n, se, 0)


def test_one_point_rule_is_on_the_point_estimate() -> None:
    # ExactLoop §5.8: -0.61 (s.e. 0.48) is within the rule; 61 vs 64 of 87 (-3.45) and 22 vs 23 of 87
    # (-1.15, s.e. 2.00) miss it even though their intervals include zero.
    assert acc(1000, 992, 1319, 0.48).holds
    assert not acc(64, 61, 87, 2.56).holds
    r = acc(23, 22, 87, 2.00)
    assert not r.holds and "misses" in r.note and "overlaps" in r.note
    assert acc(100, 99, 100).holds  # exactly one point
    assert "not excluded" in acc(1000, 992, 1319, 0.48).note


# Engine runs ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ouro():
    return diff_factory("ouro")


def base_cfg() -> EngineConfig:
    cfg = EngineConfig()
    cfg.scheduler.max_model_len = 32
    return cfg


ITEMS = [DiffItem("r0", [3, 1, 4, 1, 5, 9, 2, 6], 3), DiffItem("r1", [2, 7, 1, 8, 2, 8, 1, 8], 3)]


def lab_for(factory, **b_values) -> Lab:
    a, b = base_cfg(), base_cfg()
    for path, value in b_values.items():
        section, key = path.split("__") if "__" in path else (None, path)
        setattr(getattr(b, section) if section else b, key, value)
    return Lab(a, differing_toggles(a, b, "cpu"), factory, ITEMS, window=2, dtype=torch.float32)


def test_r0_and_r1_claims_hold_and_perturb_is_r3(ouro) -> None:
    lab = lab_for(
        ouro,
        exit__policy="fixed",
        cuda_graphs__max_graphs=64,
        scheduler__max_num_seqs=1,
        debug__perturb="prefill:0:0:mlp",
    )
    res = diff(lab)
    verdicts = {g.toggle.path: (g.toggle.graded, g.verdict) for g in res.grades}
    assert verdicts == {
        "exit.policy": ("R0", HOLDS),
        "cuda_graphs.max_graphs": ("R0", HOLDS),
        "scheduler.max_num_seqs": ("R1", HOLDS),
        "debug.perturb": ("R3", UNCHECKED),
    }
    by = {g.toggle.path: g for g in res.grades}
    assert by["exit.policy"].batched.tokens_ok and by["exit.policy"].solo.logits_ok
    assert res.combined["batched"].logits_ok is False  # the planted ulp reaches the logits
    assert not res.violations


def test_bisect_names_exactly_the_planted_toggle(ouro) -> None:
    lab = lab_for(
        ouro,
        exit__policy="fixed",
        cuda_graphs__max_graphs=64,
        cuda_graphs__eviction="lru",
        kv__poison_freed_blocks=True,
        debug__perturb="recurrent:1:core2:mlp",
    )
    result = bisect(lab)
    assert result.criterion == "logits"
    assert result.causes == [["debug.perturb"]]


@pytest.mark.parametrize(
    "model, place, expect",
    [
        ("ouro", "recurrent:2:core1:mlp", (1, "recurrent", "2", "core1", "mlp", 0)),
        ("ouro", "prefill:3:0:self_attn.paged", (0, "prefill", "3", "core0", "self_attn.paged", 0)),
        ("huginn", "prefill:5:core3:attn", (0, "prefill", "5", "core3", "attn", 0)),
    ],
)
def test_localize_names_exactly_the_planted_place(model, place, expect, ouro) -> None:
    factory = ouro if model == "ouro" else diff_factory(model)
    a, b = base_cfg(), base_cfg()
    b.debug.perturb = place
    loc = localize(factory, a, b, "r0", ITEMS[0].prompt, 2)
    assert loc.found and loc.first.key == expect
    assert loc.problem == "values" and loc.max_ulp == 1
    assert loc.a_tokens == loc.b_tokens  # one ulp moves values, not (here) tokens


def test_localize_without_difference(ouro) -> None:
    a, b = base_cfg(), base_cfg()
    b.exit.policy = "fixed"
    loc = localize(ouro, a, b, "r0", ITEMS[0].prompt, 2)
    assert not loc.found and loc.ops_compared > 100 and loc.ops_differ == 0


def test_one_engine_alive_at_a_time(ouro) -> None:
    """Every run's engine is collected before the next one is built, even inside a reference cycle (on
    CUDA an engine's graph caches hold bound methods of its runner): the collector must run in between."""
    refs: list[weakref.ref] = []

    def factory(cfg):
        alive = [i for i, r in enumerate(refs) if r() is not None]
        assert not alive, f"engine(s) {alive} still alive when engine {len(refs)} is built"
        engine = ouro(cfg)
        engine.cycle = engine  # what CUDA graph caches do; freed only by gc.collect()
        refs.append(weakref.ref(engine))
        return engine

    was_enabled = gc.isenabled()
    gc.disable()  # only the explicit collections between runs may free the cycles
    try:
        lab = lab_for(factory, exit__policy="fixed", scheduler__max_num_seqs=1)
        res = diff(lab)
        loc = localize(factory, lab.cfg_a, lab.config(lab.all), "r0", ITEMS[0].prompt, 2)
    finally:
        if was_enabled:
            gc.enable()
    assert not res.violations and not loc.found
    assert len(refs) == lab.runs + 2 and all(r() is None for r in refs)
