"""exit.min_loops matters only for an early exit (policy gate, threshold < 1): elsewhere exit.max_loops=1
needs no exit.min_loops=1."""

from __future__ import annotations

import pytest

from looptrace.engine.llm_engine import LLMEngine
from looptrace.engine.request import SamplingParams
from looptrace.recipes import RecipeError, load_recipe


@pytest.mark.parametrize("sets", [["exit.max_loops=1"], ["exit.policy=fixed", "exit.max_loops=1"]])
def test_max_loops_1_without_min_loops(sets: list[str]) -> None:
    cfg = load_recipe("base", sets).config
    assert cfg.exit.min_loops == 2 and cfg.exit.max_loops == 1
    engine = LLMEngine.from_preset("ouro-tiny", cfg)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.max_loops == 1 and len(engine.requests[rid].outputs) == 2


def test_an_early_exit_still_needs_min_loops_within_max_loops() -> None:
    with pytest.raises(RecipeError, match=r"exit.min_loops=2 exceeds exit.max_loops=1"):
        load_recipe("base", ["exit.threshold=0.5", "exit.max_loops=1"])
    cfg = load_recipe("base", ["exit.threshold=0.5", "exit.max_loops=1", "exit.min_loops=1"]).config
    assert cfg.exit.min_loops == 1
