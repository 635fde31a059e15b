"""Async decode (scheduler.async_decode, R1): whole-token steps submitted before the previous step's tokens
are read. On CPU the reads complete at once, but the engine runs the same deferred bookkeeping: inputs from
the device token buffer, placeholders, reads one step late, EOS after an extra token, held rows at
max_tokens, aborts while a read is pending."""

from __future__ import annotations

from dataclasses import replace

import pytest

from looptrace.engine import LLMEngine, SamplingParams
from looptrace.engine.config import ConfigError
from looptrace.engine.llm_engine import PENDING_TOKEN
from tests.engine.test_whole_token import FAMILIES, PROMPTS
from tests.engine.test_whole_token import engine as whole_token_engine
from tests.helpers import Recorder, build_config


def engine(preset: str, async_decode: bool, **settings) -> LLMEngine:
    return whole_token_engine(preset, True, scheduler__async_decode=async_decode, **settings)


def stream(e: LLMEngine, prompts, params) -> tuple[dict[str, list[int]], dict[str, str | None]]:
    """Run to the end through step(): the tokens each request got from the step outputs, in order, and
    its last reported finish reason."""
    ids = [e.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    while e.has_unfinished_requests():
        for out in e.step():
            got[out.request_id].append(out.token_id)
            reasons[out.request_id] = out.finish_reason
    return got, reasons


@pytest.mark.parametrize("preset", FAMILIES)
def test_same_tokens_depths_and_steps_as_synchronous_whole_token_decode(preset):
    params = SamplingParams(max_tokens=7)
    runs = {}
    for mode in (False, True):
        e = engine(preset, mode)
        got, reasons = stream(e, PROMPTS, params)
        reqs = list(e.requests.values())
        runs[mode] = (
            [r.outputs for r in reqs],
            [r.exit_depths for r in reqs],
            list(got.values()),
            reasons,
            e.stats.steps_by_stage,
        )
        assert [r.outputs for r in reqs] == list(got.values())  # every token reported once, in order
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    assert list(runs[True][3].values()) == list(runs[False][3].values()) == ["length"] * 4
    assert runs[True][4] == runs[False][4]  # the same steps: the reads add none


def test_a_step_is_submitted_before_the_previous_tokens_are_read():
    e = engine("ouro-tiny", True)
    rid = e.add_request(PROMPTS[0], SamplingParams(max_tokens=5))
    log = Recorder()
    e.attach(log)
    while "token" not in log.stages:
        e.step()
    req = e.requests[rid]
    assert req.outputs[-1] == PENDING_TOKEN and e.decode.in_flight is not None  # unread after its step
    first_pending = e.decode.in_flight
    outputs = e.step()  # the next token step goes first, then the earlier tokens are read
    assert log.stages[-1] == "token" and first_pending.resolved
    assert [o.token_id for o in outputs] == [req.outputs[-2]] and req.outputs[-1] == PENDING_TOKEN
    while e.has_unfinished_requests():
        e.step()
    assert PENDING_TOKEN not in req.outputs and len(req.outputs) == 5


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_eos_read_late_drops_the_extra_token(preset):
    params = SamplingParams(max_tokens=9, ignore_eos=False)
    ref = engine(preset, False).generate(PROMPTS[:2], SamplingParams(max_tokens=9))
    eos = ref[0][3]  # the 4th token of request 0 becomes an EOS token
    outs, reasons = {}, {}
    for mode in (False, True):
        e = engine(preset, mode)
        e.spec = e.lifecycle.spec = replace(e.spec, eos_token_ids=(eos,))  # the lifecycle applies stops
        got, why = stream(e, PROMPTS[:2], params)
        outs[mode] = [r.outputs for r in e.requests.values()]
        reasons[mode] = why
        assert outs[mode] == list(got.values())
    assert outs[True] == outs[False] and outs[True][0] == ref[0][: ref[0].index(eos) + 1]
    assert reasons[True] == reasons[False] and list(reasons[True].values())[0] == "stop"


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_sampled_rows_draw_like_the_synchronous_path(preset):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=11)
    outs = [engine(preset, mode).generate(PROMPTS[:2], params) for mode in (False, True)]
    assert outs[0] == outs[1]


def test_batches_over_the_row_limit_read_first_and_run_synchronously():
    runs = {}
    for mode in (False, True):
        e = engine("huginn-tiny", mode, scheduler__whole_token_max_rows=2)
        runs[mode] = e.generate(PROMPTS, SamplingParams(max_tokens=5))
        assert e.stats.submissions > e.stats.steps  # 4-row steps ran prelude, loops and coda
    assert runs[True] == runs[False]


def test_abort_while_a_read_is_pending_leaves_no_placeholder():
    e = engine("ouro-tiny", True)
    a = e.add_request(PROMPTS[0], SamplingParams(max_tokens=6))
    b = e.add_request(PROMPTS[1], SamplingParams(max_tokens=6))
    while e.decode.in_flight is None:
        e.step()
    e.abort_request(a)
    while e.has_unfinished_requests():
        e.step()
    assert PENDING_TOKEN not in e.requests[a].outputs and e.requests[a].finish_reason == "abort"
    assert len(e.requests[b].outputs) == 6 and e.requests[b].finish_reason == "length"


def test_needs_whole_token():
    with pytest.raises(ConfigError, match="async_decode=true needs scheduler.whole_token=true"):
        build_config(scheduler__async_decode=True)
    assert engine("ouro-tiny", True).async_decode and engine("ouro-tiny", True).runner.async_decode
