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
# vLLM's older grammar (`Worker.annotate_profile`, v1/worker/gpu_worker.py): requests(tokens) per group
VLLM_OLD_PREFILL = "execute_context_1(888)_generation_0(0)"
VLLM_OLD_DECODE = "execute_context_0(0)_generation_32(32)"
VLLM_OLD_KEYS = "execute_context_1(888_888)_generation_2(2)"


def ann(name: str, ts: float = 0.0, dur: float = 10.0, tid: int = 1) -> TraceEvent:
    return TraceEvent("user_annotation", name, ts, dur, 1, tid)


@pytest.mark.parametrize(
    ("name", "prompt", "output", "rows", "phase"),
    [
        (VLLM_DECODE, 0, 32, 32, "decode"),
        (VLLM_PREFILL, 15_360, 0, 15, "prefill"),
        (VLLM_MIXED, 512, 18, 19, "mixed"),
        (VLLM_OLD_PREFILL, 888, 0, 1, "prefill"),
        (VLLM_OLD_DECODE, 0, 32, 32, "decode"),
        (VLLM_OLD_KEYS, 888, 2, 3, "mixed"),
        ("step[EXTEND bs=15 toks=15360]", 15_360, 0, 15, "prefill"),
        ("step[DECODE bs=8]", 0, 8, 8, "decode"),
    ],
)
def test_grammars(name: str, prompt: int, output: int, rows: int, phase: str) -> None:
    s = st.parse_step(ann(name))
    assert s is not None
    assert (s.prompt_tokens, s.output_tokens, s.rows, s.phase) == (prompt, output, rows, phase)


def test_key_counts() -> None:
    """The keys each group reads (its KV length), where the annotation gives them."""
    keys = [
        (s.prompt_keys, s.output_keys) for s in map(st.parse_step, map(ann, (VLLM_DECODE, VLLM_OLD_KEYS)))
    ]
    assert keys == [(0, 55_086), (888, None)]


@pytest.mark.parametrize(
    "name",
    ["execute_model", "ProfilerStep#3", "step[", "execute_3_context_x", "lt.step#1", "execute_context_1(8)"],
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


def test_older_vllm_grammar_gives_tokens_to_analyze(kt) -> None:
    """An eager vLLM prefill step in the older grammar (as on a B200 trace): one step, 888 prompt tokens."""
    from looptrace.probes.counters import analyze
    from looptrace.probes.events import parse_chrome_trace

    with kt.range(VLLM_OLD_PREFILL):
        kt.cpu_op("aten::mm", kt.now, 4.0)
        kt.launch("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", kt.tick(), 20.0)
    a = analyze(parse_chrome_trace(kt.to_dict(), "b200.json"))
    assert (a.counters.steps, a.counters.tokens, a.step_marker) == (1, 888, "execute_")
    assert [(p.phase, p.tokens) for p in a.phases] == [("prefill", 888)]
