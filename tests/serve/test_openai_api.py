"""The OpenAI-compatible API through real clients (the `openai` package and httpx), streaming and not."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import make_engine

PROMPT = [11, 42, 7, 99, 3, 250, 18, 64]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ids = [m.id for m in client.models.list().data]
    assert ids == ["ouro", "ouro-tiny"]


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(
        model="ouro", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(PROMPT) and full.usage.completion_tokens == 12
    assert len(choice.token_ids) == 12
    chunks = list(
        client.completions.create(
            model="ouro",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    tokens = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert tokens == choice.token_ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_text_prompt_and_chat(client):
    r = client.completions.create(model="ouro-tiny", prompt="Hello loops", max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(b"Hello loops") + 1  # BOS first, as vLLM encodes a completion
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="ouro", messages=msgs, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="ouro", messages=msgs, max_tokens=6, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream]
    assert "".join(pieces) == chat.choices[0].message.content


def test_trained_tiny_model_answers_its_eval_questions_through_the_api():
    # The serving path encodes a text prompt as the model was trained (BOS first), stops at EOS and
    # decodes: the trained ouro-tiny answers its own eval questions as `looptrace depth` scores them.
    from looptrace.assets import shipped_weights
    from looptrace.engine.tokenizer import load_tokenizer
    from looptrace.serve.server import build_server
    from looptrace.train.evaluate import read_items
    from tests.helpers import build_setup

    weights = shipped_weights("ouro-tiny")
    engine = build_setup("ouro", weights=weights).engine
    srv = build_server(
        engine, port=0, model_name="ouro", tokenizer=load_tokenizer(weights), probe_interval=None
    )
    srv.start()
    try:
        api = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        items = read_items(weights / "eval.jsonl", need_answer=True)[:5]
        texts = [
            api.completions.create(model="ouro", prompt=it.prompt, max_tokens=8, temperature=0)
            .choices[0]
            .text
            for it in items
        ]
    finally:
        srv.stop()
    assert texts == [it.answer for it in items]


def test_stop_string_cuts_the_text_and_frees_the_request(server, client):
    kw = dict(model="ouro", prompt=PROMPT, max_tokens=32, temperature=1.0, seed=7)
    text = client.completions.create(**kw).choices[0].text
    k = next(i for i in range(1, len(text)) if text[i] != "\ufffd" and text[i] not in text[:i])
    stopped = client.completions.create(**kw, stop=["\x00never", text[k]])
    assert stopped.choices[0].text == text[:k]
    assert stopped.choices[0].finish_reason == "stop"
    assert server.loop.wait_idle(30)
    assert metrics(server)[("looptrace:kv_blocks", (("state", "request"),))] == 0


async def test_concurrent_seeded_requests_match_direct_engine(server):
    """Requests queued together (hold) are admitted as one batch, in order: the same tokens as a direct
    engine run of the same prompts, parameters and seeds, added together in that order."""
    from looptrace.engine.request import SamplingParams

    prompts = [[(13 * i + 5 * j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    params = [
        dict(temperature=0.0, top_p=1.0, seed=None),
        dict(temperature=0.9, top_p=0.95, seed=1),
        dict(temperature=1.2, top_p=1.0, seed=2),
        dict(temperature=0.7, top_p=0.8, seed=3),
        dict(temperature=0.0, top_p=1.0, seed=4),
        dict(temperature=1.0, top_p=0.5, seed=5),
    ]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int):
        p = {k: v for k, v in params[i].items() if v is not None}
        if i % 2:  # half of them stream
            stream = await client.completions.create(
                model="ouro", prompt=prompts[i], max_tokens=10, stream=True,
                extra_body={"return_token_ids": True}, **p,
            )  # fmt: skip
            return [t async for c in stream for t in c.choices[0].token_ids]
        r = await client.completions.create(
            model="ouro", prompt=prompts[i], max_tokens=10, extra_body={"return_token_ids": True}, **p
        )
        return r.choices[0].token_ids

    assert server.loop.wait_idle(30)
    with server.loop.hold():
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(one(i)))
            assert await asyncio.to_thread(server.loop.wait_pending, i + 1, 30)
    got = await asyncio.gather(*tasks)

    engine = make_engine()
    sp = [
        SamplingParams(
            max_tokens=10, temperature=p["temperature"], top_p=p["top_p"], seed=p["seed"], ignore_eos=False
        )
        for p in params
    ]
    assert got == engine.generate(prompts, sp)
    assert len({tuple(g) for g in got}) > 1


def test_bad_requests_get_openai_errors_and_the_server_lives(server, client):
    url = server.url + "/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json={"model": "ouro"})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "ouro", "prompt": "x", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(url, json={"model": "ouro", "prompt": ["a", "b"], "max_tokens": 2, "min_p": 0.1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p"  # unsupported: never ignored
    r = httpx.post(url, json={"model": "ouro", "prompt": [1, 2, 100000]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="ouro", prompt="x" * 300, max_tokens=2)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="ouro", messages=[], max_tokens=2)
    assert httpx.get(server.url + "/nope").status_code == 404
    assert httpx.get(server.url + "/health").status_code == 200
    assert client.completions.create(model="ouro", prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_stream_disconnect_aborts_and_frees_kv(server):
    before = metrics(server).get(("looptrace:request_success_total", (("finished_reason", "abort"),)), 0)
    body = {"model": "ouro", "prompt": PROMPT, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token in: hang up
    assert server.loop.wait_idle(30)
    m = metrics(server)
    assert m[("looptrace:request_success_total", (("finished_reason", "abort"),))] == before + 1
    assert m[("looptrace:kv_blocks", (("state", "request"),))] == 0
    assert m[("looptrace:num_requests_running", ())] == 0
    assert m[("looptrace:generation_tokens_total", ())] < 10_000


def test_non_stream_disconnect_aborts(server):
    before = metrics(server).get(("looptrace:request_success_total", (("finished_reason", "abort"),)), 0)
    body = {"model": "ouro", "prompt": PROMPT, "max_tokens": 240}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    assert server.loop.wait_idle(30)
    m = metrics(server)
    assert m[("looptrace:request_success_total", (("finished_reason", "abort"),))] == before + 1
    assert m[("looptrace:kv_blocks", (("state", "request"),))] == 0


def test_metrics_names_and_stats_stream(server, client):
    client.completions.create(model="ouro", prompt=PROMPT[:5], max_tokens=8, temperature=0)
    assert server.loop.wait_idle(30)
    names = {n for n, _ in metrics(server)}
    for expected in (
        "looptrace:num_requests_running",
        "looptrace:num_requests_waiting",
        "looptrace:kv_cache_usage_perc",
        "looptrace:time_to_first_token_seconds_bucket",
        "looptrace:time_per_output_token_seconds_bucket",
        "looptrace:inter_token_latency_seconds_bucket",
        "looptrace:e2e_request_latency_seconds_bucket",
        "looptrace:prompt_tokens_total",
        "looptrace:generation_tokens_total",
        "looptrace:request_success_total",
        "looptrace:engine_steps_total",
        "looptrace:engine_submissions_total",
        "looptrace:steps_per_output_token",
        "looptrace:submissions_per_output_token",
        "looptrace:kv_blocks",
        "looptrace:kv_slots",
        "looptrace:prefix_cache_queries_total",
        "looptrace:prefix_cache_hits_total",
        "looptrace:prefill_depth",
    ):
        assert expected in names, expected
    from httpx_sse import connect_sse

    with (
        httpx.Client(timeout=10) as c,
        connect_sse(c, "GET", server.url + "/v1/stats/stream", params={"interval": 0.05}) as es,
    ):
        events = []
        for sse in es.iter_sse():
            events.append(json.loads(sse.data))
            if len(events) == 2:
                break
    assert events[0]["schema"] == "looptrace.stats/1"
    assert events[-1]["tokens"]["generation_total"] > 0
    assert {"running", "waiting", "list"} <= set(events[-1]["requests"])
    # uniform depth: prompt rows run every loop (a split-depth recipe reports its current P)
    assert events[-1]["kv"]["planes"] and events[-1]["prefill_depth"] == 4.0
