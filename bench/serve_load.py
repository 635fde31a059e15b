"""Load test for `looptrace serve` on loopback: N concurrent streaming requests, D of them disconnect midway.

Checks: every other request completes with all its tokens, the server stays up (/health), and afterwards the
KV pool holds no request blocks and no request is running or waiting (read from /metrics, parsed with
prometheus_client). Writes a JSON result (and prints it).

    python bench/serve_load.py                                  # in-process tiny Ouro on CPU, 127.0.0.1:0
    python bench/serve_load.py --url http://127.0.0.1:8000      # an already running server (loopback)
    python bench/serve_load.py -o bench/results/serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


async def _one(
    client: httpx.AsyncClient, model: str, i: int, max_tokens: int, drop_after: int | None
) -> dict:
    body = {
        "model": model,
        "prompt": [(7 * i + j) % 250 + 1 for j in range(8 + i % 5)],  # distinct prompts: no prefix hits
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
    }
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"i": i, "chunks": 0, "finish_reason": None, "ttft": None, "error": None}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            rec["status"] = resp.status_code
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                rec["chunks"] += 1
                if rec["ttft"] is None:
                    rec["ttft"] = time.perf_counter() - t0
                rec["finish_reason"] = chunk["choices"][0]["finish_reason"] or rec["finish_reason"]
                if drop_after is not None and rec["chunks"] >= drop_after:
                    rec["dropped"] = True
                    break  # leaving the block closes the connection: a client disconnect
    except httpx.HTTPError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["e2el"] = time.perf_counter() - t0
    return rec


async def run_load(
    url: str,
    *,
    model: str = "ouro",
    requests: int = 200,
    disconnects: int = 50,
    max_tokens: int = 8,
    disconnect_max_tokens: int = 64,
    drop_after: int = 2,
    wait_idle=None,
    idle_timeout: float = 60.0,
) -> dict[str, Any]:
    """Fire all requests at once; every (requests // disconnects)-th one disconnects after `drop_after`
    chunks. `wait_idle()` (in-process) or polling /metrics (remote) waits for the engine to drain."""
    step = max(1, requests // max(1, disconnects))
    droppers = set(range(0, requests, step)[:disconnects])
    limits = httpx.Limits(max_connections=requests + 10, max_keepalive_connections=requests + 10)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0), limits=limits) as client:
        t0 = time.perf_counter()
        recs = await asyncio.gather(
            *(
                _one(
                    client,
                    model,
                    i,
                    disconnect_max_tokens if i in droppers else max_tokens,
                    drop_after if i in droppers else None,
                )
                for i in range(requests)
            )
        )
        wall = time.perf_counter() - t0
    # The checks after the load open a new connection: a pooled one idle for about the server's keep-alive
    # timeout (uvicorn: 5 s, reached while the engine drains on a loaded machine) can be closed by the
    # server just as it is reused ("Server disconnected without sending a response", seen in CI).
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
        if wait_idle is not None:
            drained = await asyncio.to_thread(wait_idle, idle_timeout)
        else:  # a remote server: poll its metrics until nothing runs or waits (bounded)
            drained, deadline = False, time.monotonic() + idle_timeout
            while not drained and time.monotonic() < deadline:
                vals = metric_values((await client.get("/metrics")).text)
                drained = not any(v for (n, _), v in vals.items() if n.startswith("looptrace:num_requests_"))
                if not drained:
                    await asyncio.sleep(0.2)
        health = (await client.get("/health")).status_code
        vals = metric_values((await client.get("/metrics")).text)

    def m(name: str, **labels: str) -> float:
        return vals.get((name, tuple(sorted(labels.items()))), float("nan"))

    completers = [r for r in recs if r["i"] not in droppers]
    dropped = [r for r in recs if r["i"] in droppers]
    ok = [
        r
        for r in completers
        if r["error"] is None and r["chunks"] == max_tokens and r["finish_reason"] == "length"
    ]
    ttfts = np.array([r["ttft"] for r in completers if r["ttft"] is not None])
    return {
        "requests": requests,
        "disconnects": len(droppers),
        "max_tokens": max_tokens,
        "completed_ok": len(ok),
        "completers": len(completers),
        "dropped_after_chunks": sorted({r["chunks"] for r in dropped}),
        "client_errors": [r["error"] for r in recs if r["error"]][:5],
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(sum(r["chunks"] for r in recs) / wall, 1),
        "client_ttft_p50_s": round(float(np.percentile(ttfts, 50)), 4) if ttfts.size else None,
        "client_ttft_p99_s": round(float(np.percentile(ttfts, 99)), 4) if ttfts.size else None,
        "drained": bool(drained),
        "health_after": health,
        "metrics_after": {
            "num_requests_running": m("looptrace:num_requests_running"),
            "num_requests_waiting": m("looptrace:num_requests_waiting"),
            "kv_cache_usage_perc": m("looptrace:kv_cache_usage_perc"),
            "kv_blocks_request": m("looptrace:kv_blocks", state="request"),
            "kv_blocks_cached": m("looptrace:kv_blocks", state="cached"),
            "kv_blocks_free": m("looptrace:kv_blocks", state="free"),
            "request_success_length": m("looptrace:request_success_total", finished_reason="length"),
            "request_success_abort": m("looptrace:request_success_total", finished_reason="abort"),
            "generation_tokens_total": m("looptrace:generation_tokens_total"),
        },
    }


def passed(res: dict[str, Any]) -> bool:
    ma = res["metrics_after"]
    return (
        res["completed_ok"] == res["completers"]
        and res["health_after"] == 200
        and res["drained"]
        and ma["num_requests_running"] == 0
        and ma["num_requests_waiting"] == 0
        and ma["kv_blocks_request"] == 0
        and ma["kv_cache_usage_perc"] == 0
        and ma["request_success_abort"] == res["disconnects"]
    )


def tiny_engine(max_num_seqs: int = 32, max_model_len: int = 256):
    """Tiny Ouro on CPU, configured in code (no recipe file needed)."""
    from looptrace.engine.config import EngineConfig
    from looptrace.engine.llm_engine import LLMEngine

    cfg = EngineConfig()
    cfg.scheduler.max_num_seqs = max_num_seqs
    cfg.scheduler.max_model_len = max_model_len
    return LLMEngine.from_preset("ouro", cfg, device="cpu", seed=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback); default: start one in-process")
    ap.add_argument("--model", default="ouro")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--disconnects", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("-o", "--output", type=Path)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    server = None
    url, wait_idle = args.url, None
    if url is None:
        from looptrace.serve.server import build_server

        server = build_server(
            tiny_engine(args.max_num_seqs), port=0, model_name=args.model, probe_interval=None
        )
        server.start()
        url, wait_idle = server.url, server.loop.wait_idle
    try:
        res = asyncio.run(
            run_load(
                url,
                model=args.model,
                requests=args.requests,
                disconnects=args.disconnects,
                max_tokens=args.max_tokens,
                wait_idle=wait_idle,
            )
        )
    finally:
        if server is not None:
            server.stop()
    res["passed"] = passed(res)
    res["setup"] = {
        "server": "in-process tiny Ouro (ouro-tiny, fp32, CPU, 1 torch thread)" if server else url,
        "max_num_seqs": args.max_num_seqs,
        "host": "127.0.0.1",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_1m_after": round(os.getloadavg()[0], 2),  # other work on the machine slows the run
        "torch": torch.__version__,
    }
    text = json.dumps(res, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
