"""OpenAI-API fidelity and validation through the real `openai` client: each bad request is
sent while another stream is in flight (the bad one gets a 400 naming its field, the other completes with
exact usage); logprobs against the engine's own log-softmax of the logits it sampled from; n > 1 and
batched prompts equal seeded single requests; logit_bias, penalties, stop_token_ids; /tokenize,
/detokenize, /version, /v1/models/{id}; chat's default max_tokens; unsupported fields are 400s."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch

from looptrace.engine import Observer
from tests.serve.conftest import make_engine

PROMPT = [11, 42, 7, 99, 3, 250, 18, 64]
MAX_LEN = 256


class LogitsLog(Observer):
    """The logits every sampled token came from, by request id (the engine's own, before sampling)."""

    wants_logits = True

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}

    def on_logits(self, request_ids, logits) -> None:
        for i, rid in enumerate(request_ids):
            self.rows.setdefault(rid, []).append(logits[i].detach().float().clone())


@pytest.fixture(scope="module")
def ouro():
    from looptrace.serve.server import build_server

    engine = make_engine(max_num_seqs=8, max_model_len=MAX_LEN)
    log = LogitsLog()
    engine.attach(log)
    srv = build_server(engine, port=0, model_name="ouro", probe_interval=None)
    srv.start()
    srv.logits = log
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def huginn():
    """`looptrace serve --model huginn --recipe exactloop-cache`, the tiny Huginn on CPU."""
    from looptrace.serve.server import build_server
    from tests.helpers import build_setup

    sets = ("scheduler.max_num_seqs=8", f"scheduler.max_model_len={MAX_LEN}")
    engine = build_setup("huginn", *sets, recipe="exactloop-cache").engine
    srv = build_server(engine, port=0, model_name="huginn", probe_interval=None)
    srv.start()
    yield srv
    srv.stop()


def api(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@contextmanager
def stream_in_flight(srv, model: str, max_tokens: int = 200):
    """A streaming completion running in the engine around the block; afterwards: it completed with exact
    usage. Yields a dict whose "chunks" counts what arrived so far (the block checks it is not done)."""
    seen = {"chunks": 0, "tokens": [], "usage": None, "finish": None, "error": None}
    first = threading.Event()

    def run() -> None:
        try:
            stream = api(srv).completions.create(
                model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=1.0, seed=3, stream=True,
                stream_options={"include_usage": True},
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )  # fmt: skip
            for c in stream:
                if c.choices:
                    seen["chunks"] += 1
                    seen["tokens"] += c.choices[0].token_ids
                    seen["finish"] = c.choices[0].finish_reason or seen["finish"]
                    first.set()
                if c.usage is not None:
                    seen["usage"] = c.usage
        except Exception as exc:  # noqa: BLE001 - reported by the assertions below
            seen["error"] = exc
        finally:
            first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert first.wait(60)
    yield seen
    thread.join(120)
    assert seen["error"] is None, seen["error"]
    assert seen["finish"] == "length" and len(seen["tokens"]) == max_tokens
    u = seen["usage"]
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        len(PROMPT), max_tokens, len(PROMPT) + max_tokens,
    )  # fmt: skip


def bad_request(srv, model: str, kind: str, **kw):
    """Send one request; returns (status, error body or response)."""
    client = api(srv)
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    args = {"model": model, "max_tokens": 2} | kw
    if kind == "chat":
        args.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        args.setdefault("prompt", "x")
    try:
        return 200, create(**args)
    except openai.APIStatusError as exc:
        return exc.status_code, exc.body


# --- bad requests, each with another stream in flight ----------------------------------------------------
BAD = [
    ("completions", dict(seed=2**64), "seed"),
    ("completions", dict(seed=-1), "seed"),
    ("chat", dict(seed=18446744073709551616), "seed"),
    ("completions", dict(temperature=2.5), "temperature"),
    ("completions", dict(top_p=0), "top_p"),
    ("completions", dict(extra_body={"top_k": -2}), "top_k"),
    ("completions", dict(presence_penalty=2.1), "presence_penalty"),
    ("chat", dict(frequency_penalty=-3), "frequency_penalty"),
    ("completions", dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    ("completions", dict(logit_bias={"5": 101}), "logit_bias.5"),
    ("completions", dict(logit_bias={"100000": 1}), "logit_bias"),
    ("completions", dict(logit_bias={"x": 1}), "logit_bias"),
    ("completions", dict(logprobs=21), "logprobs"),
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(top_logprobs=2), "top_logprobs"),
    ("completions", dict(n=0), "n"),
    ("completions", dict(max_tokens=0), "max_tokens"),
    ("completions", dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids.0"),
    # unsupported: a 400 naming the field, never a silent 200
    ("completions", dict(best_of=3), "best_of"),
    ("completions", dict(suffix="tail"), "suffix"),
    ("completions", dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    ("chat", dict(response_format={"type": "json_object"}), "response_format"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    ("chat", dict(tool_choice="required"), "tool_choice"),
    ("chat", dict(functions=[{"name": "f", "parameters": {}}]), "functions"),
    ("completions", dict(extra_body={"min_p": 0.1}), "min_p"),
    ("chat", dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
    (
        "chat",
        dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages.0.content",
    ),
]


def test_bad_requests_are_400s_naming_the_field_and_the_stream_in_flight_completes(ouro):
    """Every bad request of BAD is sent while one stream is generating (one stream for all of them keeps
    the suite fast): each gets a 400 naming its field, and the stream completes with exact usage."""
    results = []
    with stream_in_flight(ouro, "ouro") as seen:
        for kind, kw, param in BAD:
            results.append((kind, param, *bad_request(ouro, "ouro", kind, **kw)))
        assert seen["chunks"] < 200  # the other request was still generating after the last bad one
    wrong = [
        (kind, param, status, body)
        for kind, param, status, body in results
        if status != 400 or body.get("type") != "invalid_request_error" or body.get("param") != param
        or not body.get("message")
    ]  # fmt: skip
    assert not wrong, wrong
    assert len(results) == len(BAD)


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1])
def test_huge_seed_on_huginn_exactloop_cache(huginn, seed):
    """Regression: seed 9223372036854775808 killed the engine thread (OverflowError); every later request
    hung. Seeds below 2**64 are valid: a 200, reproducible, and the stream in flight completes."""
    with stream_in_flight(huginn, "huginn") as seen:
        status, r = bad_request(huginn, "huginn", "completions", seed=seed, temperature=1.0, max_tokens=4)
        assert seen["chunks"] < 200
    assert status == 200 and r.usage.completion_tokens == 4
    _, again = bad_request(huginn, "huginn", "completions", seed=seed, temperature=1.0, max_tokens=4)
    assert again.choices[0].text == r.choices[0].text
    status, body = bad_request(huginn, "huginn", "completions", seed=2**64)
    assert status == 400 and body["param"] == "seed"
    assert httpx.get(huginn.url + "/health").status_code == 200


@pytest.mark.parametrize(
    ("kw", "param"),
    [(dict(temperature=1e-45), "temperature"), (dict(temperature=1, top_p=1e-300), "top_p")],
    ids=["temperature-1e-45", "top_p-1e-300"],
)
def test_numeric_edges_that_used_to_fail_every_request_are_400s(ouro, kw, param):
    """Regression: temperature 1e-45 (NaN probabilities) and top_p 1e-300 (an invalid multinomial) failed
    the step and so every request in flight. The API rejects them naming the field (the engine itself
    samples them greedily: tests/engine/test_sampling_params.py); the stream in flight completes."""
    with stream_in_flight(ouro, "ouro") as seen:
        status, body = bad_request(ouro, "ouro", "completions", prompt=PROMPT, max_tokens=6, seed=1, **kw)
        assert seen["chunks"] < 200
    assert status == 400 and body["param"] == param, body
    # the smallest accepted values sample without error
    ok = dict(temperature=1e-5) if param == "temperature" else dict(temperature=1, top_p=1.2e-38)
    status, r = bad_request(ouro, "ouro", "completions", prompt=PROMPT, max_tokens=3, seed=1, **ok)
    assert status == 200 and r.usage.completion_tokens == 3


def test_nan_and_infinity_literals_are_400s(ouro):
    url = ouro.url + "/v1/completions"
    for field, raw in (("temperature", "NaN"), ("top_p", "Infinity"), ("presence_penalty", "-Infinity")):
        body = f'{{"model": "ouro", "prompt": "x", "max_tokens": 2, "{field}": {raw}}}'
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_ignored_fields_and_explicit_nulls_still_work(ouro):
    r = api(ouro).chat.completions.create(
        model="ouro", messages=[{"role": "user", "content": "hi"}], max_tokens=3, user="u1", store=False,
        metadata={"k": "v"}, tool_choice="none", response_format={"type": "text"}, n=1,
        extra_body={"min_p": None, "best_of": 1},
    )  # fmt: skip
    assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in ("length", "stop")


# --- logprobs --------------------------------------------------------------------------------------------
def _ref(ouro, rid: str) -> list[torch.Tensor]:
    return [torch.log_softmax(x, dim=-1) for x in ouro.logits.rows[rid]]


def test_completion_logprobs_are_the_engines_log_softmax(ouro):
    from looptrace.engine.tokenizer import ByteTokenizer  # the server's tokenizer

    r = api(ouro).completions.create(
        model="ouro", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=9, logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    c = r.choices[0]
    refs = _ref(ouro, r.id)
    assert len(refs) == 6 and len(c.logprobs.token_logprobs) == 6
    for i, (t, ref) in enumerate(zip(c.token_ids, refs)):
        assert c.logprobs.token_logprobs[i] == pytest.approx(ref[t].item(), abs=1e-5)
        top = ref.topk(3)
        # keyed by token text (as OpenAI; distinct ids may share a text): the top 3 and the sampled token
        want = [*top.values.tolist(), ref[t].item()]
        got = c.logprobs.top_logprobs[i]
        assert max(got.values()) == pytest.approx(top.values[0].item(), abs=1e-5)
        assert all(any(abs(v - w) < 1e-5 for w in want) for v in got.values())
        assert c.logprobs.tokens[i] in got
        assert c.logprobs.text_offset[i] == len(ByteTokenizer().decode(c.token_ids[:i]))


def test_chat_logprobs_stream_and_not_are_the_engines_log_softmax(ouro):
    msgs = [{"role": "user", "content": "logprobs please"}]
    kw = dict(model="ouro", messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4)
    r = api(ouro).chat.completions.create(**kw, extra_body={"return_token_ids": True, "ignore_eos": True})
    refs = _ref(ouro, r.id)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 == len(refs)
    for t, entry, ref in zip(r.choices[0].token_ids, content, refs):
        top = ref.topk(4)
        assert entry.logprob == pytest.approx(ref[t].item(), abs=1e-5)
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert t == top.indices[0].item()  # greedy: the top token
        assert entry.bytes == list(entry.token.encode())
    chunks = list(api(ouro).chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_no_logprobs_unless_asked(ouro):
    r = api(ouro).completions.create(model="ouro", prompt=PROMPT, max_tokens=3)
    assert r.choices[0].logprobs is None
    chat = api(ouro).chat.completions.create(
        model="ouro", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert chat.choices[0].logprobs is None


# --- n > 1, batched prompts, seeds -----------------------------------------------------------------------
def test_n3_stream_equals_three_seeded_single_requests(ouro):
    """Choice i of a seeded request with n = 3 uses seed + i: it equals a single request with that seed."""
    extra = {"return_token_ids": True, "ignore_eos": True}
    kw = dict(model="ouro", prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9)
    stream = api(ouro).completions.create(
        **kw, n=3, seed=41, stream=True, stream_options={"include_usage": True}, extra_body=extra
    )
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    text: dict[int, str] = {0: "", 1: "", 2: ""}
    usage = None
    for c in stream:
        for ch in c.choices:
            got[ch.index] += ch.token_ids
            text[ch.index] += ch.text
        usage = c.usage or usage
    singles = [api(ouro).completions.create(**kw, seed=41 + i, extra_body=extra).choices[0] for i in range(3)]
    assert [got[i] for i in range(3)] == [s.token_ids for s in singles]
    assert [text[i] for i in range(3)] == [s.text for s in singles]
    assert len({tuple(g) for g in got.values()}) > 1
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 36)


def test_chat_n2_non_stream_equals_seeded_single_requests(ouro):
    kw = dict(model="ouro", messages=[{"role": "user", "content": "two ways"}], max_tokens=6, temperature=1.0)
    extra = {"return_token_ids": True, "ignore_eos": True}
    both = api(ouro).chat.completions.create(**kw, n=2, seed=2**64 - 1, extra_body=extra)
    assert [c.index for c in both.choices] == [0, 1]
    single = [
        api(ouro).chat.completions.create(**kw, seed=s, extra_body=extra).choices[0] for s in (2**64 - 1, 0)
    ]  # seed + 1 wraps to 0
    assert [c.token_ids for c in both.choices] == [s.token_ids for s in single]
    assert both.usage.completion_tokens == 12


def test_batched_prompts_each_as_its_own_request(ouro):
    prompts = ["first prompt", "the second one"]
    extra = {"return_token_ids": True, "ignore_eos": True}
    kw = dict(model="ouro", max_tokens=5, temperature=0.7, seed=5, extra_body=extra)
    r = api(ouro).completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.token_ids for c in r.choices}
    for p_i, p in enumerate(prompts):
        one = api(ouro).completions.create(prompt=p, n=2, **kw)
        assert [by_index[p_i * 2 + j] for j in range(2)] == [c.token_ids for c in one.choices]
    ids = [
        api(ouro).completions.create(model="ouro", prompt=p, max_tokens=1).usage.prompt_tokens
        for p in prompts
    ]
    assert r.usage.prompt_tokens == sum(ids) and r.usage.completion_tokens == 20
    tok = api(ouro).completions.create(model="ouro", prompt=[PROMPT, PROMPT[:4]], max_tokens=2)
    assert len(tok.choices) == 2 and tok.usage.prompt_tokens == len(PROMPT) + 4


# --- logit processing and stop token ids -----------------------------------------------------------------
def test_logit_bias_penalties_and_stop_token_ids(ouro):
    extra = {"return_token_ids": True, "ignore_eos": True}
    base = dict(model="ouro", prompt=PROMPT, max_tokens=8, temperature=0)
    plain = api(ouro).completions.create(**base, extra_body=extra).choices[0].token_ids
    biased = api(ouro).completions.create(**base, logit_bias={"42": 100}, extra_body=extra).choices[0]
    assert biased.token_ids == [42] * 8
    pen = (
        api(ouro)
        .completions.create(
            **base,
            presence_penalty=2.0,
            frequency_penalty=2.0,
            extra_body=extra | {"repetition_penalty": 1.5},
        )
        .choices[0]
    )
    assert len(set(pen.token_ids)) == 8
    stop = plain[3]
    cut = api(ouro).completions.create(**base, extra_body=extra | {"stop_token_ids": [stop]}).choices[0]
    assert cut.token_ids == plain[: plain.index(stop) + 1] and cut.finish_reason == "stop"
    # and a request that asks for none of it is unchanged
    assert api(ouro).completions.create(**base, extra_body=extra).choices[0].token_ids == plain


def test_chat_default_max_tokens_is_the_rest_of_the_context(ouro):
    msgs = [{"role": "user", "content": "go on"}]
    r = api(ouro).chat.completions.create(
        model="ouro", messages=msgs, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_LEN
    assert r.choices[0].finish_reason == "length"


# --- the other endpoints ---------------------------------------------------------------------------------
def test_tokenize_detokenize_version_and_model_cards(ouro):
    client = api(ouro)
    r = httpx.post(ouro.url + "/tokenize", json={"model": "ouro", "prompt": "Hello"}).json()
    usage = client.completions.create(model="ouro", prompt="Hello", max_tokens=1).usage
    assert r["count"] == len(r["tokens"]) == usage.prompt_tokens and r["max_model_len"] == MAX_LEN
    chat = httpx.post(ouro.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    cu = client.chat.completions.create(
        model="ouro", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert chat["count"] == cu.usage.prompt_tokens
    d = httpx.post(ouro.url + "/detokenize", json={"model": "ouro", "tokens": r["tokens"]}).json()
    assert d["prompt"] == "Hello"
    bad = httpx.post(ouro.url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = httpx.post(ouro.url + "/tokenize", json={"prompt": "x", "messages": []})
    assert bad.status_code == 400
    from looptrace import __version__

    assert httpx.get(ouro.url + "/version").json() == {"version": __version__}
    card = client.models.retrieve("ouro")
    assert card.id == "ouro" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
