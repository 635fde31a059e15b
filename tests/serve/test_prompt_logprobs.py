"""Prompt logprobs over HTTP (the real app, tiny Ouro on CPU): vLLM's `prompt_logprobs` field and OpenAI's
legacy `echo` with `logprobs` give the engine's teacher-forced scores (`scoring.score`) of the prompt."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from looptrace.engine.scoring import score  # noqa: E402
from tests.serve.conftest import make_engine  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def complete(server, **fields) -> dict:
    body = {"model": "ouro", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **fields}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def reference() -> list:
    """The same prompt scored by a second engine built the same way, in-process."""
    return score(make_engine(), PROMPT[:1], PROMPT[1:], top_k=2)


def test_prompt_logprobs_are_the_engines_teacher_forced_scores(server) -> None:
    choice = complete(server, prompt_logprobs=2)
    got = choice["prompt_logprobs"]
    assert len(got) == len(PROMPT) and got[0] is None
    for entry, ref in zip(got[1:], reference()):
        mine = entry[str(ref.token_id)]
        assert mine["logprob"] == pytest.approx(ref.logprob, abs=1e-6) and mine["rank"] == ref.rank
        listed = {int(t) for t in entry}
        assert listed == {ref.token_id, *(t for t, _ in ref.top_logprobs)}
        top1 = entry[str(ref.argmax_id)]
        assert top1["rank"] == 1 and top1["logprob"] == pytest.approx(ref.argmax_logprob, abs=1e-6)
    assert "logprobs" not in choice or choice["logprobs"] is None  # not asked for


def test_echo_with_logprobs_lists_the_prompt_first(server) -> None:
    plain = complete(server, logprobs=1)
    echoed = complete(server, logprobs=1, echo=True)
    lp = echoed["logprobs"]
    n = len(PROMPT)
    assert len(lp["tokens"]) == n + 2 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference()
    assert lp["token_logprobs"][1:n] == pytest.approx([r.logprob for r in ref], abs=1e-6)
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:n])  # the token, and the top 1 if other
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]  # the generated part as before
    assert echoed["prompt_logprobs"] is None  # echo alone fills the legacy arrays only


def test_streamed_prompt_logprobs_come_with_the_first_chunk(server) -> None:
    body = {"model": "ouro", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "prompt_logprobs": 0}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    carried = [c.get("prompt_logprobs") is not None for c in chunks]
    assert carried == [True, False, False]
    assert [list(e) for e in chunks[0]["prompt_logprobs"][1:]] == [[str(t)] for t in PROMPT[1:]]


def test_bad_prompt_logprobs_is_a_400_naming_it(server) -> None:
    body = {"model": "ouro", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": -1}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"
