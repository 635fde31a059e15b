"""Load on loopback: 200 concurrent streaming requests, 50 hang up after two chunks (bench/serve_load.py); a
request of 256 sequences beside small ones (they keep their latency); 50 stalled uploads (closed after the
body timeout while others are served)."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx

from tests.serve.conftest import load_bench, make_engine, read_response, stalled_upload


async def test_200_streams_50_disconnects_leave_the_pool_free():
    from looptrace.serve.server import build_server

    bench = load_bench()
    srv = build_server(make_engine(max_num_seqs=32), port=0, model_name="ouro", probe_interval=None).start()
    try:
        res = await bench.run_load(
            srv.url, requests=200, disconnects=50, max_tokens=8, wait_idle=srv.loop.wait_idle
        )
    finally:
        srv.stop()
    assert res["client_errors"] == []
    assert res["completed_ok"] == res["completers"] == 150
    assert res["health_after"] == 200 and res["drained"]
    m = res["metrics_after"]
    assert m["num_requests_running"] == m["num_requests_waiting"] == 0
    assert m["kv_blocks_request"] == 0 and m["kv_cache_usage_perc"] == 0
    assert m["request_success_abort"] == 50 and m["request_success_length"] == 150
    # each dropped stream was aborted before the engine produced its remaining 62 tokens
    assert m["generation_tokens_total"] < 150 * 8 + 50 * 64
    assert bench.passed(res)


SMALL = {"model": "ouro", "prompt": [11, 42, 7, 99], "max_tokens": 4, "ignore_eos": True}


def small_latencies(url: str, n: int) -> list[float]:
    """Seconds each of `n` small completions took, one after another (a 30 s timeout fails the test)."""
    out = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for _ in range(n):
            t = time.perf_counter()
            assert c.post("/v1/completions", json=SMALL).status_code == 200
            out.append(time.perf_counter() - t)
    return out


def test_a_request_of_256_sequences_does_not_starve_small_ones():
    """2 prompts x n=128 (the per-request bound) x 32 tokens beside small requests. Before, the engine's first
    come, first served queue put a small request behind all 256 sequences (38 s on this machine); the
    engine loop now admits the requests in turn and keeps a quarter of the slots for later ones."""
    from looptrace.serve.server import build_server

    srv = build_server(make_engine(max_num_seqs=8), port=0, model_name="ouro", probe_interval=None).start()
    try:
        small_latencies(srv.url, 2)  # warm-up
        alone = statistics.median(small_latencies(srv.url, 5))
        started, stop = threading.Event(), threading.Event()

        def huge() -> None:
            body = {"model": "ouro", "prompt": [[1, 2, 3], [4, 5, 6]], "n": 128, "max_tokens": 32}
            body |= {"ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    started.set()
                    if stop.is_set():
                        break  # hanging up aborts its remaining sequences

        big = threading.Thread(target=huge)
        big.start()
        try:
            assert started.wait(60)
            loaded = small_latencies(srv.url, 5)
        finally:
            stop.set()
            big.join(60)
        # 3x their latency alone + 1 s: margin for a loaded 2-core CI machine, and far below a wait behind
        # 256 sequences x 32 tokens
        assert max(loaded) < 3 * alone + 1.0, (alone, loaded)
        assert srv.loop.wait_idle(60)
        assert srv.loop.engine.kv_blocks()["request_blocks"] == 0
    finally:
        srv.stop()


def test_stalled_uploads_are_closed_after_the_body_timeout_and_others_are_served():
    """Clients that declare a 100-byte body and send 10 bytes used to hold their connections forever (1,500
    held). Each now gets a JSON 408 and is closed after --body-timeout; a normal request meanwhile
    succeeds."""
    from looptrace.serve.server import build_server

    timeout = 1.0
    srv = build_server(
        make_engine(), port=0, model_name="ouro", probe_interval=None, body_timeout=timeout
    ).start()
    stalled = []
    try:
        t0 = time.perf_counter()
        stalled = [stalled_upload(srv.url) for _ in range(50)]
        r = httpx.post(srv.url + "/v1/completions", json=SMALL, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        answers = [read_response(s, timeout=30) for s in stalled]  # each until the server closes it
        assert time.perf_counter() - t0 >= timeout
        for head, body in answers:
            assert head.startswith(b"HTTP/1.1 408") and b"content-type: application/json" in head, head
            assert json.loads(body)["error"]["code"] == "request_timeout"
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        for s in stalled:
            s.close()
        srv.stop()
