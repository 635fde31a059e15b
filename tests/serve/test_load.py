"""Load on loopback: 200 concurrent streaming requests, 50 hang up after two chunks (bench/serve_load.py)."""

from __future__ import annotations

from tests.serve.conftest import load_bench, make_engine


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
