"""Whatever a client sends, the answer is a JSON 4xx in the OpenAI error shape (never a 500, never
text/plain) and a stream in flight beside it keeps streaming: the cases a campaign of bad requests found,
each sent while a stream is generating, malformed HTTP on raw sockets, and a property test (hypothesis)
over every field the server reads: Rich markup, lone surrogates, deep nesting, huge / negative / NaN
numbers, wrong types."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import make_engine

MAX_LEN = 256
COMPLETION = {"model": "ouro", "prompt": "hi", "max_tokens": 1}
CHAT = {"model": "ouro", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def srv():
    from looptrace.serve.server import build_server

    server = build_server(
        make_engine(max_num_seqs=8, max_model_len=MAX_LEN), port=0, model_name="ouro", probe_interval=None
    )
    server.start()
    yield server
    server.stop()


def post(srv, path: str, raw: str | bytes) -> httpx.Response:
    return httpx.post(srv.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)


def error_shape(r: httpx.Response) -> dict:
    """The `error` object of an OpenAI-shaped 4xx (asserted)."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    return err


class StreamWatch:
    """Streams one completion after another on a thread until stopped: how many chunks arrived, the longest
    gap between two, and every stream that did not end with `[DONE]` after its tokens."""

    def __init__(self, url: str) -> None:
        self.url, self.chunks, self.max_gap, self.bad = url, 0, 0.0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {**COMPLETION, "prompt": [11, 42, 7], "max_tokens": 48, "stream": True, "ignore_eos": True}
        while not self.stop.is_set():
            events, last = [], time.perf_counter()
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        now = time.perf_counter()
                        self.max_gap, last = max(self.max_gap, now - last), now
                        events.append(line[6:])
                        self.chunks += 1
            if events[-1:] != ["[DONE]"] or len(events) != 49:
                self.bad.append(events[-2:])

    @contextmanager
    def running(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while self.chunks < 2 and time.monotonic() < deadline:  # generating before the first bad request
            time.sleep(0.01)
        try:
            yield self
        finally:
            self.stop.set()
            self.thread.join(60)


# The campaign's findings: (what, path, raw body, the param the 400 must name) ----------------------------
def completion(extra: str) -> str:
    """A completion body with `extra` (raw JSON members) appended."""
    return f'{{"model": "ouro", "prompt": "x", {extra}}}'


def chat(content: str) -> str:
    return f'{{"model": "ouro", "messages": [{{"role": "user", "content": {content}}}]}}'


DEEP_LIST = "[" * 5000 + "]" * 5000
DEEP_BIAS = '{"1":' * 200_000 + "1" + "}" * 200_000
CMPL, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
SEQUENCES_500x128 = json.dumps({"model": "ouro", "prompt": [[65, 66]] * 500, "n": 128, "max_tokens": 1})
FOUND = [
    ("lone surrogate in a prompt", CMPL, '{"model": "ouro", "prompt": "a\\ud800b"}', "prompt"),
    ("lone surrogate in chat content", CHAT_PATH, chat('"a\\ud800b"'), "messages.0.content"),
    ("lone surrogate in /tokenize", "/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
    ("5,000 deep in an ignored field", CMPL, completion(f'"user": {DEEP_LIST}'), None),
    ("200,000 deep in logit_bias", CMPL, completion(f'"logit_bias": {DEEP_BIAS}'), None),
    ("max_tokens: true", CMPL, completion('"max_tokens": true'), "max_tokens"),
    ('stream: "yes"', CMPL, completion('"stream": "yes"'), "stream"),
    ("logprobs: true on completions", CMPL, completion('"logprobs": true'), "logprobs"),
    (
        "logit_bias key '3' in Arabic-Indic",
        CMPL,
        completion('"logit_bias": {"\\u0663": 1}'),
        "logit_bias",
    ),
    (
        "stop_token_ids: [10**30]",
        CMPL,
        completion(f'"stop_token_ids": [{10**30}]'),
        "stop_token_ids",
    ),
    (
        "a chat text part that is an object",
        CHAT_PATH,
        chat('[{"type": "text", "text": {"a": 1}}]'),
        "messages.0.content",
    ),
    ("malformed JSON names no field", CMPL, '{"model": "ouro", "prompt": x}', None),
    ("an integer of 5,000 digits", CMPL, completion(f'"seed": {"9" * 5000}'), None),
    ("chat overflow names messages", CHAT_PATH, chat(json.dumps("x" * 400)), "messages"),
    ("500 prompts x n=128", CMPL, SEQUENCES_500x128, "n"),
    ("3 prompts x n=128", CMPL, completion('"prompt": ["a", "b", "c"], "n": 128'), "n"),
]


def test_each_finding_is_a_400_naming_its_field_while_a_stream_goes_on(srv):
    wrong = []
    with StreamWatch(srv.url).running() as watch:
        for what, path, raw, param in FOUND:
            r = post(srv, path, raw)
            ok = r.status_code == 400 and r.headers["content-type"] == "application/json"
            if not ok or error_shape(r)["param"] != param:
                wrong.append((what, r.status_code, r.text[:200]))
    assert not wrong, wrong
    assert watch.bad == [] and watch.chunks > 0


def test_too_many_sequences_is_refused_before_any_work(srv):
    """The 64,000-sequence body is refused before tokenizing or queueing anything; the bound is exact."""
    assert srv.loop.wait_idle(30)
    before = srv.loop.snapshot()["tokens"]["prompt_total"]
    body = {"model": "ouro", "prompt": ["ab"] * 500, "n": 128, "max_tokens": 1}
    r = post(srv, "/v1/completions", json.dumps(body))
    assert error_shape(r)["code"] == "too_many_sequences" and "at most 256" in r.json()["error"]["message"]
    assert srv.loop.wait_idle(30) and srv.loop.snapshot()["tokens"]["prompt_total"] == before
    ok = post(srv, "/v1/completions", json.dumps({**COMPLETION, "prompt": ["a", "b"], "n": 128}))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 256


# Malformed HTTP: uvicorn's protocol layer used to answer these `text/plain` ---------------------------------
def raw_exchange(srv, request: bytes) -> tuple[bytes, bytes]:
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",  # noqa: E501
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n",
        # headers over h11's 16 KiB limit, not yet ended: refused while they arrive (all that was sent is
        # read by then, so the server's close is a clean FIN the client can read the answer before)
        b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 60_000,
    ],
    ids=["bad-chunk-size", "negative-content-length", "oversized-headers"],
)
def test_malformed_http_gets_the_json_error_shape(srv, request_bytes):
    head, body = raw_exchange(srv, request_bytes)
    assert head.startswith(b"HTTP/1.1 400"), head
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert err["code"] == "bad_http_request" and err["type"] == "invalid_request_error"
    assert httpx.get(srv.url + "/health").status_code == 200


def test_head_health(srv):
    r = httpx.head(srv.url + "/health")
    assert r.status_code == 200 and r.content == b""


# The property test --------------------------------------------------------------------------------------
SLOT = "\x00slot\x00"  # a placeholder string in the JSON template, replaced by a raw JSON fragment


def depth(n: int, kind: str) -> str:
    return "[" * n + "]" * n if kind == "list" else '{"a":' * n + "1" + "}" * n


# Raw JSON fragments a careless or hostile client sends: none of them may cause a 500.
MARKUP = ['"[red]x[/]"', '"[/]"', '"[bold"', '"\\u001b[2J"']
SURROGATES = [
    '"a\\ud800b"',
    '"\\udfff"',
    '["\\udbff"]',
    '{"\\ud800": 1}',
    '[{"text": "\\ud800", "type": "text"}]',
]
DEEP = [depth(n, kind) for n in (40, 900, 5000) for kind in ("list", "dict")]
NUMBERS = [
    "0", "-1", "1.5", "-0.0", "1e-320", "1e308", "-1e308", "1e400", "NaN", "Infinity", "-Infinity",
    str(2**63), str(2**64), str(10**30), str(-(10**30)), "9" * 5000,
]  # fmt: skip
WRONG_TYPES = [
    "true",
    "false",
    "null",
    '"yes"',
    '"5"',
    '""',
    "[]",
    "{}",
    '[1, "a"]',
    '[[1], "a"]',
    '{"a": {"b": []}}',
]
FRAGMENTS = MARKUP + SURROGATES + DEEP + NUMBERS + WRONG_TYPES

COMMON_FIELDS = [
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "stop_token_ids",
    "stream", "stream_options", "n", "best_of", "ignore_eos", "return_token_ids", "user", "metadata",
]  # fmt: skip
ENDPOINTS = {
    "/v1/completions": (
        COMPLETION, [*COMMON_FIELDS, "prompt", "echo", "logprobs", "prompt_logprobs", "suffix"]
    ),
    "/v1/chat/completions": (
        CHAT,
        [*COMMON_FIELDS, "messages", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
         "functions", "function_call", "messages.0.role", "messages.0.content", "messages.0.name"],
    ),
    "/tokenize": ({"prompt": "hi"}, ["model", "prompt", "messages", "add_special_tokens"]),
    "/detokenize": ({"tokens": [65]}, ["model", "tokens", "tokens.0"]),
}  # fmt: skip


def with_fragments(base: dict, edits: list[tuple[str, str]]) -> str:
    """`base` as JSON with each (dotted field, raw fragment) set; the fragment is pasted in verbatim."""
    body = json.loads(json.dumps(base))
    fragments = []
    for field, fragment in edits:
        *parents, leaf = [int(p) if p.isdigit() else p for p in field.split(".")]
        target = body
        for p in parents:
            target = target[p]
        target[leaf] = f"{SLOT}{len(fragments)}"
        fragments.append(fragment)
    text = json.dumps(body)
    for i, fragment in enumerate(fragments):
        text = text.replace(json.dumps(f"{SLOT}{i}"), fragment)
    return text


@st.composite
def bad_bodies(draw):
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, fields = ENDPOINTS[path]
    edits = draw(
        st.lists(
            st.tuples(st.sampled_from(fields), st.sampled_from(FRAGMENTS)),
            min_size=1,
            max_size=3,
            unique_by=lambda e: e[0].split(".")[0],  # one edit per top-level field
        )
    )
    return path, with_fragments(base, edits)


def test_every_field_with_any_junk_is_a_json_4xx_never_a_500_or_a_stalled_stream(srv):
    """Hypothesis draws an endpoint and one to three of its fields set to junk. A 200 is fine (some junk is
    valid: `null`, `0` where 0 is allowed, markup in `user`); anything else is a JSON 4xx in the OpenAI shape.
    A stream runs beside every request: it never fails, and no chunk waits longer than a loaded CI allows."""
    statuses: dict[int, int] = {}

    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,  # the same examples on every run: CI failures reproduce
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(bad_bodies())
    def check(case):
        path, raw = case
        r = post(srv, path, raw)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code != 200:
            error_shape(r)
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        else:
            r.json()

    with StreamWatch(srv.url).running() as watch:
        check()
    assert statuses.get(400, 0) > 50 and 500 not in statuses, statuses
    assert watch.bad == [] and watch.chunks > 0
    assert watch.max_gap < 5.0, watch.max_gap  # tokens every few ms alone; a stall would be seconds
