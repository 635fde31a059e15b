"""Whole-token decode (scheduler.whole_token, R1): a fused decode row's prelude, loops, coda and sampling
run as one step; the per-row arithmetic is that of the three-step fused path."""

from __future__ import annotations

import pytest

from looptrace.engine import LLMEngine, Observer, SamplingParams
from looptrace.engine.config import ConfigError
from tests.helpers import Recorder, build_config, build_engine

PROMPTS = [[5 + i, 9, 13 + 2 * i, 7, 21, 3 + i] for i in range(4)]
FAMILIES = ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"]


def engine(preset: str, whole: bool, **settings) -> LLMEngine:
    return build_engine(
        preset,
        noise="sequential",
        scheduler__loop_fusion=True,
        scheduler__prefill_share=True,
        scheduler__whole_token=whole,
        **settings,
    )


@pytest.mark.parametrize("preset", FAMILIES)
def test_identical_to_three_step_fusion_at_batch_1_in_one_step_per_token(preset):
    params = SamplingParams(max_tokens=10)
    runs = {}
    for whole in (False, True):
        e = engine(preset, whole)
        tokens = [e.generate([p], params)[0] for p in PROMPTS[:2]]  # one request at a time
        runs[whole] = (tokens, e.stats.steps / e.stats.output_tokens, e.stats.steps_by_stage)
    assert runs[True][0] == runs[False][0]
    # prefill + coda for the first token, then one step per token: (2 + 9) / 10
    assert runs[True][1] == pytest.approx((2 + 9) / 10)
    assert runs[False][1] == pytest.approx((2 + 3 * 9) / 10)
    assert runs[True][2].get("token") == 2 * 9 and "prelude" not in runs[True][2]


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_sampled_rows_draw_like_the_three_step_path(preset):
    # Huginn draws its initial state and the sampler draws the token from the request's generator: the
    # whole-token step makes the same draws in the same order.
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=11)
    outs = [engine(preset, whole).generate([PROMPTS[0]], params)[0] for whole in (False, True)]
    assert outs[0] == outs[1]


def test_batches_over_the_row_limit_run_three_phases_in_one_step():
    e = engine("huginn-tiny", True, scheduler__whole_token_max_rows=2)
    log = Recorder()
    e.attach(log)
    outs = e.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert [len(o) for o in outs] == [4] * 4
    assert "token" in log.stages and "prelude" not in log.stages
    assert e.stats.submissions > e.stats.steps  # the 4-row steps submitted prelude, loops and coda


def test_hidden_observers_get_every_loop_and_the_tokens_do_not_change():
    plain = engine("huginn-tiny", True).generate([PROMPTS[1]], SamplingParams(max_tokens=4))
    e = engine("huginn-tiny", True)
    seen = []

    class Hidden(Observer):
        wants_hidden = True

        def on_loop_hidden(self, stage, loop_index, request_ids, positions, hidden):
            seen.append((stage, loop_index))

    e.attach(Hidden())
    assert e.generate([PROMPTS[1]], SamplingParams(max_tokens=4)) == plain
    assert [t for st, t in seen if st == "recurrent"] == list(range(e.max_loops)) * 3


def test_range_observers_see_one_fused_range_per_token():
    e = engine("ouro-tiny", True)
    loops = []
    e.attach(type("Loops", (Observer,), {"on_loop_begin": lambda self, st, t: loops.append((st, t))})())
    e.generate([PROMPTS[2]], SamplingParams(max_tokens=4))
    assert loops.count(("recurrent", -1)) == 3


def test_whole_token_needs_loop_fusion():
    with pytest.raises(ConfigError, match="scheduler.whole_token=true needs scheduler.loop_fusion=true"):
        build_config(scheduler__whole_token=True)


def test_exactloop_recipe_runs_batches_up_to_64_rows_as_whole_tokens():
    """exactloop.yaml raised whole_token_max_rows to 64 (H200: Ouro 512 C=32 1,389 -> 1,889 tok/s): a
    24-row burst (over the former 8-row limit) decodes one step per token, with the same tokens as the
    three-phase steps the 8-row limit gave it."""
    from looptrace.engine.llm_engine import LLMEngine as Engine
    from looptrace.recipes import load_recipe

    prompts = [[3 + i, 9, 13 + i % 5, 7, 21] for i in range(24)]
    params = SamplingParams(max_tokens=5)
    runs = {}
    for label, sets in (("recipe", []), ("8-row limit", ["scheduler.whole_token_max_rows=8"])):
        cfg = load_recipe("exactloop", ["scheduler.max_num_seqs=24", *sets]).config
        assert cfg.scheduler.whole_token_max_rows == (64 if label == "recipe" else 8)
        e = Engine.from_preset("ouro-tiny", cfg, device="cpu")
        runs[label] = (
            e.generate(prompts, params),
            e.stats.steps_by_stage,
            e.stats.submissions,
            e.stats.steps,
        )
    tokens, stages, submissions, steps = runs["recipe"]
    assert tokens == runs["8-row limit"][0]
    assert stages.get("token") == 4 and submissions == steps  # 4 decode tokens after the first, one step each
    assert runs["8-row limit"][2] > runs["8-row limit"][3]  # over the limit: three phases per step
