"""Teacher-forced scoring (`scoring.score`, `SamplingParams.prompt_logprobs`): a stream the engine generated
greedily, scored as one prefill of prompt + stream, gives the generated token as the argmax at every
position and the generation's own logprobs (float32, CPU) within 1e-5; with and without coda layers, in
small chunks, under split prefill depth, and never from the prefix cache."""

from __future__ import annotations

import pytest

from looptrace.engine.config import DepthConfig, EngineConfig, KVConfig, SchedulerConfig
from looptrace.engine.llm_engine import LLMEngine
from looptrace.engine.request import EngineInputError, SamplingParams
from looptrace.engine.scoring import score

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42]
TOLERANCE = 1e-5


def generate(engine: LLMEngine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=n, logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return [o.token_id for o in outs], [o.logprob for o in outs]


def check_scores_match_generation(engine: LLMEngine, n: int = 10, scorer: LLMEngine | None = None) -> None:
    tokens, logprobs = generate(engine, PROMPT, n)
    scores = score(scorer or engine, PROMPT, tokens, top_k=3)
    assert [s.position for s in scores] == list(range(len(PROMPT), len(PROMPT) + n))
    assert [s.token_id for s in scores] == tokens
    assert [s.argmax_id for s in scores] == tokens
    for s, lp in zip(scores, logprobs):
        assert abs(s.logprob - lp) <= TOLERANCE
        assert s.argmax_logprob == s.logprob and s.rank == 1  # the token is the argmax: one value
        assert len(s.top_logprobs) == 3 and s.top_logprobs[0] == (s.argmax_id, s.argmax_logprob)


@pytest.mark.parametrize("preset", ["ouro", "huginn"])  # the head on the loop state / on coda layers
def test_scoring_a_greedy_stream_reproduces_its_tokens_and_logprobs(preset) -> None:
    # Huginn draws its initial state per position, so that the scoring prefill draws what decode drew.
    cfg = EngineConfig(noise="position_keyed")
    check_scores_match_generation(LLMEngine.from_preset(preset, cfg, device="cpu", seed=0))


def test_scoring_in_small_prefill_chunks() -> None:
    cfg = EngineConfig(scheduler=SchedulerConfig(prefill_chunk_size=4, max_num_batched_tokens=8))
    check_scores_match_generation(LLMEngine.from_preset("ouro", cfg, device="cpu", seed=0))


def test_split_prefill_depth_still_scores_at_full_depth() -> None:
    """Under (S, P = 1) a scored prompt runs every position at S loops: it scores what an engine that runs
    the whole prompt at full depth generated."""
    full = LLMEngine.from_preset("ouro", EngineConfig(kv=KVConfig(layout="shared")), device="cpu", seed=0)
    cfg = EngineConfig(kv=KVConfig(layout="shared"), depth=DepthConfig(prefill_loops=1))
    check_scores_match_generation(full, scorer=LLMEngine.from_preset("ouro", cfg, device="cpu", seed=0))


def test_scored_prompt_is_not_taken_from_the_prefix_cache() -> None:
    engine = LLMEngine.from_preset("ouro", EngineConfig(kv=KVConfig(block_size=4)), device="cpu", seed=0)
    first = score(engine, PROMPT, [3, 4])
    second = score(engine, PROMPT, [3, 4])  # the same prompt again: its full pages are cached by now
    assert first == second
    rid = engine.add_request(PROMPT + [3, 4], SamplingParams(max_tokens=1, prompt_logprobs=0))
    out = next(o for o in engine.step() + engine.step() if o.request_id == rid)
    assert [p.position for p in out.prompt_logprobs] == list(range(1, len(PROMPT) + 2))
    assert engine.requests[rid].num_cached == 0


def test_prompt_logprobs_only_on_the_first_output() -> None:
    engine = LLMEngine.from_preset("ouro", EngineConfig(), device="cpu", seed=0)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False]
    first = outs[0].prompt_logprobs
    assert [(p.position, p.token_id) for p in first] == [(i, PROMPT[i]) for i in range(1, len(PROMPT))]
    assert all(len(p.top_logprobs) == 1 and p.logprob <= p.argmax_logprob for p in first)
    assert all((p.rank == 1) == (p.token_id == p.argmax_id) for p in first)
    assert any(p.rank > 1 for p in first)  # a fixed prompt is not what the model would write


def test_bad_scoring_requests() -> None:
    engine = LLMEngine.from_preset("ouro", EngineConfig(), device="cpu", seed=0)
    with pytest.raises(EngineInputError, match="prompt_logprobs: must be an integer in"):
        engine.add_request(PROMPT, SamplingParams(prompt_logprobs=21))
    with pytest.raises(EngineInputError, match="at least one prompt token"):
        score(engine, [], [1, 2])
    engine.add_request(PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(EngineInputError, match="idle engine"):
        score(engine, PROMPT, [1])
