"""One bad request must never hurt the others: faults injected inside the engine, a dead engine thread, the
body limit, tokenizer work off the event loop, request timeouts, the API key, and SIGTERM/SIGINT drains of a
real `looptrace serve` process."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import Proc, make_engine, read_response, stalled_upload


@contextmanager
def health_latencies(url: str) -> Iterator[list[float]]:
    """Polls /health every 10 ms while the body runs; yields the list its latencies go into."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url) as c:
            while not stop.is_set():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        yield latencies
    finally:
        stop.set()
        poller.join()


MAGIC = [5, 5, 5, 5, 5, 5]  # the prompt of the request a test makes fail
OTHER = [11, 42, 7, 99, 3, 250, 18, 64]


# Helpers --------------------------------------------------------------------------------------------------
def serve(**kw):
    from looptrace.serve.server import build_server

    kw.setdefault("probe_interval", None)
    return build_server(make_engine(), port=0, model_name="ouro", **kw).start()


def metric(url: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def assert_pool_free(srv) -> None:
    assert srv.loop.wait_idle(30)
    assert metric(srv.url, "looptrace:num_requests_running") == 0
    assert metric(srv.url, "looptrace:kv_blocks", state="request") == 0


def stream(url: str, prompt, max_tokens: int, started: threading.Event | None = None, **extra) -> list[str]:
    """The `data:` payloads of one streaming completion, `[DONE]` included."""
    body = {"model": "ouro", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    out = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, **extra}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                if started is not None and len(out) >= 2:
                    started.set()
    return out


def tokens_and_end(events: list[str]) -> tuple[int, dict | None, str]:
    """(token chunks, error body or None, last payload)."""
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    errors = [c for c in chunks if "error" in c]
    return len([c for c in chunks if c.get("choices")]), (errors[0] if errors else None), events[-1]


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


# Faults inside the engine ---------------------------------------------------------------------------------
def test_a_failing_prefill_fails_that_request_alone():
    srv = serve()
    runner = srv.loop.engine.runner
    real = runner.prefill

    def prefill(spans):
        if any(s.request.prompt == MAGIC for s in spans):
            raise RuntimeError("injected prefill fault")
        return real(spans)

    runner.prefill = prefill
    try:
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(stream, srv.url, OTHER, 40, started)
            assert started.wait(60)  # decoding: its steps are not the bad request's prefill step
            with pytest.raises(openai.InternalServerError) as err:
                client(srv.url).completions.create(model="ouro", prompt=MAGIC, max_tokens=4)
            assert "injected prefill fault" in err.value.message
            n, error, last = tokens_and_end(other.result())
        assert (n, error, last) == (40, None, "[DONE]")
        assert_pool_free(srv)
        assert metric(srv.url, "looptrace:request_success_total", finished_reason="error") == 1
        assert (
            client(srv.url)
            .completions.create(model="ouro", prompt=OTHER, max_tokens=3)
            .usage.completion_tokens
            == 3
        )
    finally:
        srv.stop()


def test_an_admission_fault_in_a_shared_step_fails_only_its_request():
    from looptrace.engine.llm_engine import Event

    srv = serve()
    engine = srv.loop.engine
    real = engine._advance

    def advance(req, event, **kw):
        if event == Event.ADMITTED and req.prompt == MAGIC:
            raise OverflowError("injected admission fault")
        return real(req, event, **kw)

    engine._advance = advance
    try:
        with ThreadPoolExecutor(2) as pool:
            with srv.loop.hold():  # both admitted in the same step
                good = pool.submit(stream, srv.url, OTHER, 12, None)
                bad = pool.submit(stream, srv.url, MAGIC, 12, None)
                assert srv.loop.wait_pending(2)
            good_events, bad_events = good.result(), bad.result()
        assert tokens_and_end(good_events) == (12, None, "[DONE]")
        n, error, last = tokens_and_end(bad_events)
        assert n == 0 and last == "[DONE]" and "injected admission fault" in error["error"]["message"]
        assert_pool_free(srv)
    finally:
        srv.stop()


def test_a_failing_detokenizer_fails_that_stream_alone():
    from looptrace.engine.tokenizer import ByteTokenizer

    class Tok(ByteTokenizer):
        def decode(self, ids, **kw):
            if 250 in ids[:1]:  # the bad request's first sampled token is forced below
                raise UnicodeError("injected decode fault")
            return super().decode(ids, **kw)

    srv = serve(tokenizer=Tok())
    engine = srv.loop.engine
    real = engine.lifecycle.emit_token

    def emit(req, token):
        return real(req, 250 if req.prompt == MAGIC else token)

    engine.lifecycle.emit_token = emit
    try:
        with ThreadPoolExecutor(2) as pool:
            good = pool.submit(stream, srv.url, OTHER, 16, None)
            bad = pool.submit(stream, srv.url, MAGIC, 16, None)
            good_events, bad_events = good.result(), bad.result()
        assert tokens_and_end(good_events) == (16, None, "[DONE]")
        n, error, last = tokens_and_end(bad_events)
        assert last == "[DONE]" and "injected decode fault" in error["error"]["message"]
        assert_pool_free(srv)
    finally:
        srv.stop()


def test_repeated_step_failures_mark_the_engine_dead():
    srv = serve(exit_on_dead=False)
    srv.loop.engine.step = lambda: (_ for _ in ()).throw(ValueError("injected step fault"))
    try:
        c = client(srv.url)
        for _ in range(2):  # failed steps 1 and 2: the request fails, the engine lives
            with pytest.raises(openai.InternalServerError) as err:
                c.completions.create(model="ouro", prompt=OTHER, max_tokens=2)
            assert err.value.status_code == 500
            assert httpx.get(srv.url + "/health").status_code == 200
        with pytest.raises(openai.InternalServerError) as err:  # the third in a row: dead
            c.completions.create(model="ouro", prompt=OTHER, max_tokens=2)
        assert err.value.status_code == 503
        assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        srv.stop()


def test_a_dead_engine_thread_fails_pending_and_new_requests_fast():
    srv = serve(exit_on_dead=False)
    engine = srv.loop.engine
    real = engine.has_unfinished_requests
    kill = threading.Event()

    def has_unfinished():
        if kill.is_set():
            raise RuntimeError("injected: the engine thread dies")
        return real()

    engine.has_unfinished_requests = has_unfinished
    try:
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(stream, srv.url, OTHER, 200, started)
            assert started.wait(60)
            kill.set()
            n, error, last = tokens_and_end(pending.result(timeout=30))
        assert n < 200 and last == "[DONE]" and error["error"]["code"] == "unavailable"
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "injected" in health.json()["error"]["message"]
        t0 = time.perf_counter()
        with pytest.raises(openai.InternalServerError) as err:
            client(srv.url).completions.create(model="ouro", prompt=OTHER, max_tokens=2)
        assert err.value.status_code == 503 and time.perf_counter() - t0 < 5
        assert srv.loop.engine.kv_blocks()["request_blocks"] == 0
    finally:
        srv.stop()


# Limits -----------------------------------------------------------------------------------------------------
def test_body_limit_is_413_declared_or_streamed():
    srv = serve(max_body_bytes=64 * 1024)
    try:
        url = srv.url + "/v1/completions"
        big = json.dumps({"model": "ouro", "prompt": "x" * 100_000, "max_tokens": 1}).encode()
        r = httpx.post(url, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "--max-body-bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            for i in range(0, len(big), 16384):
                yield big[i : i + 16384]

        r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        ok = client(srv.url).completions.create(model="ouro", prompt="x" * 100, max_tokens=2)
        assert ok.usage.completion_tokens == 2
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", ["prompt", "chat"])
def test_a_huge_request_does_not_freeze_other_clients(kind):
    srv = serve()
    try:
        if kind == "prompt":
            path, body = "/v1/completions", {"model": "ouro", "prompt": "x" * 7_000_000, "max_tokens": 1}
        else:
            msgs = [{"role": "user", "content": "x"}] * 200_000
            path, body = "/v1/chat/completions", {"model": "ouro", "messages": msgs, "max_tokens": 1}
        data = json.dumps(body).encode()
        with health_latencies(srv.url) as latencies:
            r = httpx.post(
                srv.url + path, content=data, headers={"content-type": "application/json"}, timeout=60
            )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # Before: the event loop parsed, validated and tokenized it (3-5 s of nothing for every client).
        # What remains is json.loads of the body, one C call that holds the GIL (0.3-0.5 s here, loaded).
        assert latencies and max(latencies) < 1.5, latencies
    finally:
        srv.stop()


def test_tokenizing_a_huge_prompt_does_not_freeze_other_clients():
    """An 8 MB /tokenize paused every other client for 6.3 s: its body was parsed on the event loop and its
    millions of ids serialized there in one call."""
    srv = serve()
    try:
        with health_latencies(srv.url) as latencies:
            r = httpx.post(srv.url + "/tokenize", json={"prompt": "x" * 7_000_000}, timeout=60)
        assert r.status_code == 200 and r.json()["count"] == 7_000_001  # BOS + one id per byte
        assert latencies and max(latencies) < 1.5, max(latencies)
    finally:
        srv.stop()


def test_request_timeout_aborts_and_frees_kv():
    srv = serve(request_timeout=1.0)
    try:
        n, error, last = tokens_and_end(stream(srv.url, OTHER, 240))
        assert n < 240 and last == "[DONE]" and error["error"]["code"] == "request_timeout"
        with pytest.raises(openai.APIStatusError) as err:
            client(srv.url).completions.create(model="ouro", prompt=OTHER, max_tokens=240)
        assert err.value.status_code == 408
        assert_pool_free(srv)
        assert metric(srv.url, "looptrace:request_success_total", finished_reason="timeout") == 2
    finally:
        srv.stop()


def test_api_key_on_every_path_but_health():
    srv = serve(api_key="s3cret")
    try:
        assert client(srv.url, "s3cret").completions.create(model="ouro", prompt="hi", max_tokens=2).usage
        with pytest.raises(openai.AuthenticationError) as err:
            client(srv.url, "wrong").completions.create(model="ouro", prompt="hi", max_tokens=2)
        assert err.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(srv.url, "wrong").models.list()
        assert httpx.post(srv.url + "/v1/chat/completions", json={}).status_code == 401
        # Model work and server internals outside /v1 are guarded too (an unauthenticated 8 MB /tokenize
        # used to pause authenticated streams); only the load balancer's /health stays open.
        for method, path, body in [
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [65]}),
            ("GET", "/metrics", None),
            ("GET", "/version", None),
        ]:
            r = httpx.request(method, srv.url + path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110)
                authorized = {"authorization": f"{scheme} s3cret"}
                assert httpx.request(method, srv.url + path, json=body, headers=authorized).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.head(srv.url + "/health").status_code == 200
        # the dashboard's stats are under /v1 too: guarded; `top` sends LOOPTRACE_API_KEY
        assert httpx.get(srv.url + "/v1/stats").status_code == 401
        from looptrace.tui.sources import LooptraceSource, SourceError

        with pytest.raises(SourceError, match="HTTP 401"):
            LooptraceSource(srv.url).fetch()
        os.environ["LOOPTRACE_API_KEY"] = "s3cret"
        try:
            assert LooptraceSource(srv.url).fetch()["schema"]
        finally:
            del os.environ["LOOPTRACE_API_KEY"]
    finally:
        srv.stop()


# A real `looptrace serve` process ---------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_streams_and_exits_0(sig):
    srv = Proc("--drain-timeout", "4", "--probe-interval", "0")
    try:
        short_started, long_started = threading.Event(), threading.Event()
        with ThreadPoolExecutor(2) as pool:
            short = pool.submit(stream, srv.url, OTHER, 24, short_started)
            long = pool.submit(stream, srv.url, [9, 8, 7], 1500, long_started)
            assert short_started.wait(60) and long_started.wait(60)
            srv.p.send_signal(sig)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(srv.url + "/health", timeout=5)
            short_events, long_events = short.result(timeout=60), long.result(timeout=60)
        assert tokens_and_end(short_events) == (24, None, "[DONE]")  # finished within the drain
        n, error, last = tokens_and_end(long_events)
        assert n < 1500 and last == "[DONE]" and "drain timeout" in error["error"]["message"]
        assert srv.wait() == 0
        assert "ASGI callable returned without completing response" not in srv.stderr
        assert "Traceback" not in srv.stderr
        assert "2 request(s) in flight, 1 ended at the drain timeout" in srv.stderr
        assert "KV blocks held by requests at exit: 0" in srv.stderr
    finally:
        srv.wait(1)


def test_signal_with_a_stalled_upload_exits_at_once_and_answers_it_json():
    """A client stalled mid-body used to hold the drain open until drain + 5 s, then got uvicorn's
    `text/plain` 500 with a CancelledError traceback in the log. Now it gets a JSON 503 when the drain
    begins and the process exits 0 at once."""
    srv = Proc("--drain-timeout", "8", "--probe-interval", "0")
    try:
        stalled = stalled_upload(srv.url)
        assert httpx.get(srv.url + "/health").status_code == 200  # the server took the connection
        t0 = time.perf_counter()
        srv.p.send_signal(signal.SIGTERM)
        head, body = read_response(stalled, timeout=30)
        assert srv.wait(30) == 0
        assert time.perf_counter() - t0 < 6  # not the 8 s drain timeout (+ 5 s grace)
        assert head.startswith(b"HTTP/1.1 503") and b"application/json" in head, head
        assert json.loads(body)["error"]["code"] == "unavailable"
        assert "Traceback" not in srv.stderr and "CancelledError" not in srv.stderr, srv.stderr
    finally:
        srv.wait(1)


KILL_PATCH = """
import threading
import looptrace.engine.llm_engine as m
kill = threading.Event()
real_add, real_has = m.LLMEngine.add_request, m.LLMEngine.has_unfinished_requests
def add_request(self, prompt, *a, **k):
    if prompt == [5, 5, 5, 5, 5, 5]:
        kill.set()
    return real_add(self, prompt, *a, **k)
def has_unfinished_requests(self):
    if kill.is_set():
        raise RuntimeError("injected: the engine thread dies")
    return real_has(self)
m.LLMEngine.add_request, m.LLMEngine.has_unfinished_requests = add_request, has_unfinished_requests
"""


def test_a_dead_engine_makes_the_process_exit_1():
    srv = Proc("--probe-interval", "0", patch=KILL_PATCH)
    try:
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(stream, srv.url, OTHER, 400, started)
            assert started.wait(60)
            with pytest.raises(openai.InternalServerError) as err:
                client(srv.url).completions.create(model="ouro", prompt=MAGIC, max_tokens=2)
            assert err.value.status_code == 503
            assert httpx.get(srv.url + "/health").status_code == 503
            n, error, last = tokens_and_end(pending.result(timeout=30))
        assert n < 400 and last == "[DONE]" and error["error"]["code"] == "unavailable"
        assert srv.wait() == 1
        assert "the engine died" in srv.stderr and "injected" in srv.stderr
    finally:
        srv.wait(1)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-body-bytes", "10"], "--max-body-bytes"),
        (["--request-timeout", "-1"], "--request-timeout"),
        (["--drain-timeout", "nan"], "--drain-timeout"),
        (["--api-key", " "], "--api-key"),
        (["--probe-interval", "inf"], "--probe-interval"),
    ],
)
def test_bad_serving_options_are_one_line_exit_2(args, needle):
    from typer.testing import CliRunner

    from looptrace.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--model", "ouro", "--device", "cpu", "--port", "0", *args])
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_the_probe_is_off_by_default_and_the_snapshot_says_so():
    srv = serve()
    try:
        probe = httpx.get(srv.url + "/v1/stats").json()["probe"]
        assert probe["off"] and "--probe-interval" in probe["note"]
    finally:
        srv.stop()


def test_engine_step_error_fails_that_steps_requests_and_keeps_earlier_tokens():
    """The engine alone: a prefill step that raises fails its request (KV freed); a decoding request whose
    async token read was in flight keeps its token and completes."""
    from looptrace.engine.llm_engine import StepError
    from looptrace.engine.request import SamplingParams

    engine = make_engine()
    good = engine.add_request(OTHER, SamplingParams(max_tokens=10, ignore_eos=True))
    while not engine.requests[good].outputs:
        engine.step()
    real = engine.runner.prefill

    def prefill(spans):
        if any(s.request.prompt == MAGIC for s in spans):
            raise RuntimeError("injected")
        return real(spans)

    engine.runner.prefill = prefill
    bad = engine.add_request(MAGIC, SamplingParams(max_tokens=10, ignore_eos=True))
    raised = None
    while engine.has_unfinished_requests():
        try:
            engine.step()
        except StepError as exc:
            raised = exc
    assert raised is not None and raised.request_ids == [bad]
    assert engine.take_failures() == [(bad, "RuntimeError: injected")]
    assert engine.requests[bad].finish_reason == "error"
    assert engine.requests[good].finish_reason == "length" and len(engine.requests[good].outputs) == 10
    assert engine.kv_blocks()["request_blocks"] == 0
