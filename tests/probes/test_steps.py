"""Engine step annotations: the vLLM and SGLang grammars, nesting, token totals."""

from __future__ import annotations

import pytest

from looptrace.probes import steps as st
from looptrace.probes.events import TraceEvent

VLLM_DECODE = "execute_32_context_0(sq0sk0sqsq0sqsk0)_generation_32(sq32sk55086sqsq32sqsk55086)"
VLLM_PREFILL = (
    "execute_15360_context_15(sq15360sk15360sqsq15728640sqsk15728640)_generation_0(sq0sk0sqsq0sqsk0)"
)
VLLM_MIXED = "execute_530_context_1(sq512sk512sqsq262144sqsk262144)_generation_18(sq18sk900sqsq18sqsk900)"


def ann(name: str, ts: float = 0.0, dur: float = 10.0, tid: int = 1) -> TraceEvent:
    return TraceEvent("user_annotation", name, ts, dur, 1, tid)


@pytest.mark.parametrize(
    ("name", "prompt", "output", "rows", "phase"),
    [
        (VLLM_DECODE, 0, 32, 32, "decode"),
        (VLLM_PREFILL, 15_360, 0, 15, "prefill"),
        (VLLM_MIXED, 512, 18, 19, "mixed"),
        ("step[EXTEND bs=15 toks=15360]", 15_360, 0, 15, "prefill"),
        ("step[DECODE bs=8]", 0, 8, 8, "decode"),
    ],
)
def test_grammars(name: str, prompt: int, output: int, rows: int, phase: str) -> None:
    s = st.parse_step(ann(name))
    assert s is not None
    assert (s.prompt_tokens, s.output_tokens, s.rows, s.phase) == (prompt, output, rows, phase)


@pytest.mark.parametrize(
    "name", ["execute_model", "ProfilerStep#3", "step[", "execute_3_context_x", "lt.step#1"]
)
def test_other_names_are_not_engine_steps(name: str) -> None:
    assert st.parse_step(ann(name)) is None


def test_nested_annotations_are_one_step() -> None:
    """SGLang writes the vLLM grammar around its own step[...]: one step, the outer one's counts."""
    outer = ann(VLLM_PREFILL, 0.0, 100.0)
    inner = ann("step[EXTEND bs=15 toks=15360]", 50.0, 40.0)
    other_thread = ann("step[DECODE bs=4]", 60.0, 5.0, tid=2)
    later = ann("step[DECODE bs=4]", 200.0, 5.0)
    found = st.engine_steps([later, inner, outer, other_thread])
    assert [s.event for s in found] == [outer, other_thread, later]
    totals = st.step_tokens(found)
    assert (totals.steps, totals.prompt_tokens, totals.output_tokens, totals.tokens) == (3, 15_360, 8, 8)
    assert totals.phases == {"prefill": 1, "decode": 2}
    assert st.describe(totals, "sglang").startswith("step[…] step annotations: 8 output tokens")
