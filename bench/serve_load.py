"""Load test for `looptrace serve` on loopback: N concurrent streaming requests, D of them disconnect midway.

Checks: every other request completes with all its tokens, the server stays up (/health), and afterwards the
KV pool holds no request blocks and no request is running or waiting (read from /metrics, parsed with
prometheus_client). Writes a JSON result (and prints it).

    python bench/serve_load.py                                  # in-process tiny Ouro on CPU, 127.0.0.1:0
    python bench/serve_load.py --url http://127.0.0.1:8000      # an already running server (loopback)
    python bench/serve_load.py -o serve_load.json
    python bench/serve_load.py --robustness -o serve_robustness.json

`--robustness` runs `looptrace serve` subprocesses instead: client-side ITL percentiles with
the live probe off and on (arms alternated); then one server under mixed load with bad requests (huge
seed, temperature 1e-45, top_p 1e-300, an oversized body, an unsupported field) and disconnects, sent
SIGTERM in the middle: every stream must end with `[DONE]` (after an error event, for those the drain
cut), the process must exit 0 and report 0 KV blocks held by requests at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
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
    """Tiny Ouro on CPU with seeded random weights, built as `looptrace serve` builds its engine."""
    from looptrace.build import BuildRequest, build

    sets = (f"scheduler.max_num_seqs={max_num_seqs}", f"scheduler.max_model_len={max_model_len}")
    request = BuildRequest(model="ouro", random_weights=True, sets=sets, device="cpu", seed=0)
    return build(request).engine


# Robustness (subprocess servers) ---------------------------------------------------------------------------
BAD_REQUESTS = {  # name -> extra body fields (or a body size); the status each got is recorded as observed
    "seed_2**64": {"seed": 2**64},
    "temperature_1e-45": {"temperature": 1e-45},
    "top_p_1e-300": {"temperature": 1.0, "top_p": 1e-300},
    "unsupported_field_best_of": {"best_of": 3},
    "oversized_body": {"prompt": "x" * 100_000},  # > the server's --max-body-bytes 65536
}


class ServeProcess:
    """`looptrace serve` on 127.0.0.1 (port 0) in a subprocess; its URL from its first stderr line."""

    def __init__(self, *args: str) -> None:
        self.argv = [sys.executable, "-m", "looptrace", "serve", "--model", "ouro", "--device", "cpu"]
        self.argv += ["--port", "0", *args]
        self.p = subprocess.Popen(self.argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(180):
            self.p.kill()
            raise RuntimeError("server did not start: " + "".join(self.lines))

    def _read(self) -> None:
        for line in self.p.stderr:
            self.lines.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if m and not self.url:
                self.url = m.group(1)
                self.ready.set()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return -9

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


async def _stream(client: httpx.AsyncClient, body: dict, drop_after: int | None = None) -> dict:
    """One streaming completion: chunk arrival times, how it ended (done / error+done / dropped / cut)."""
    rec: dict[str, Any] = {"status": None, "tokens": 0, "times": [], "end": "cut", "error": None}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                rec["error"] = json.loads(await resp.aread())["error"]
                rec["end"] = f"http_{resp.status_code}"
                return rec
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    rec["end"] = "error+done" if rec["error"] else "done"
                    break
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"]
                    continue
                rec["tokens"] += 1
                rec["times"].append(time.perf_counter() - t0)
                if drop_after is not None and rec["tokens"] >= drop_after:
                    rec["end"] = "dropped"
                    break
    except httpx.HTTPError as exc:
        rec["error"] = {"message": f"{type(exc).__name__}: {exc}"}
    return rec


def _itl(recs: list[dict]) -> dict[str, Any]:
    gaps = np.concatenate([np.diff(r["times"]) for r in recs if len(r["times"]) > 1] or [np.zeros(0)])
    if not gaps.size:
        return {"n": 0}
    p50, p90, p99 = np.percentile(gaps, [50, 90, 99])
    return {"n": int(gaps.size), "p50_ms": round(p50 * 1e3, 2), "p90_ms": round(p90 * 1e3, 2),
            "p99_ms": round(p99 * 1e3, 2), "max_ms": round(float(gaps.max()) * 1e3, 2)}  # fmt: skip


def _body(i: int, max_tokens: int, **extra: Any) -> dict:
    prompt = [(7 * i + j) % 250 + 1 for j in range(8 + i % 5)]
    return {"model": "ouro", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, **extra}  # fmt: skip


async def itl_arm(url: str, streams: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> dict:
            async with sem:
                return await _stream(client, _body(i, max_tokens))

        t0 = time.perf_counter()
        recs = await asyncio.gather(*(one(i) for i in range(streams)))
        wall = time.perf_counter() - t0
        probe = (await client.get("/v1/stats")).json().get("probe") or {}
    ok = sum(r["end"] == "done" and r["tokens"] == max_tokens for r in recs)
    return {"streams": streams, "completed_exact": ok, "wall_s": round(wall, 2), "itl": _itl(recs),
            "probe_windows": probe.get("windows", 0)}  # fmt: skip


async def bad_request(client: httpx.AsyncClient, name: str, extra: dict) -> dict:
    body = {"model": "ouro", "prompt": [1, 2, 3], "max_tokens": 4, **extra}
    try:
        r = await client.post("/v1/completions", json=body)
        err = r.json().get("error") if r.status_code != 200 else None
        return {"name": name, "status": r.status_code, "error": (err or {}).get("message", "")[:160]}
    except (httpx.HTTPError, ValueError) as exc:
        return {"name": name, "status": None, "error": f"{type(exc).__name__}: {exc}"[:160]}


async def sigterm_run(
    server: ServeProcess, streams: int, max_tokens: int, long_tokens: int
) -> dict[str, Any]:
    """Mixed load: short streams, long ones (cut by the drain), disconnects, bad requests alongside; SIGTERM
    once half the short streams have finished."""
    limits = httpx.Limits(max_connections=streams + 16)
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(300.0), limits=limits) as client:
        kinds = ["short", "short", "long", "drop"]
        tasks = []
        for i in range(streams):
            kind = kinds[i % len(kinds)]
            n = long_tokens if kind == "long" else max_tokens
            tasks.append(
                (kind, asyncio.ensure_future(_stream(client, _body(i, n), 2 if kind == "drop" else None)))
            )
        bad = await asyncio.gather(*(bad_request(client, n, e) for n, e in BAD_REQUESTS.items()))
        health_after_bad = (await client.get("/health")).status_code
        shorts = [t for k, t in tasks if k == "short"]
        deadline = time.monotonic() + 180
        while sum(t.done() for t in shorts) < len(shorts) // 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        t_sig = time.perf_counter()
        server.p.send_signal(signal.SIGTERM)
        recs = [(k, await t) for k, t in tasks]
        streams_done_s = time.perf_counter() - t_sig
    code = await asyncio.to_thread(server.p.wait, 120)
    err = server.stderr
    blocks = re.search(r"KV blocks held by requests at exit: (\d+|None)", err)
    cut = re.search(r"(\d+) ended at the drain timeout", err)
    ends: dict[str, dict[str, int]] = {}
    for kind, r in recs:
        ends.setdefault(kind, {}).setdefault(r["end"], 0)
        ends[kind][r["end"]] += 1
    exact = sum(r["tokens"] == max_tokens for k, r in recs if k == "short" and r["end"] == "done")
    return {
        "streams": streams,
        "bad_requests": bad,
        "health_after_bad_requests": health_after_bad,
        "stream_ends": ends,
        "short_done_with_exact_tokens": exact,
        "every_stream_ended_cleanly": all(r["end"] in ("done", "error+done", "dropped") for _, r in recs),
        "seconds_from_sigterm_to_last_stream_end": round(streams_done_s, 2),
        "exit_code": code,
        "server_ended_at_drain_timeout": int(cut.group(1)) if cut else None,
        "kv_request_blocks_at_exit": int(blocks.group(1)) if blocks and blocks.group(1) != "None" else None,
        "asgi_incomplete_response_logs": err.count("ASGI callable returned without completing response"),
        "tracebacks_in_stderr": err.count("Traceback"),
        "server_stderr_tail": err.strip().splitlines()[-3:],
    }


def run_robustness(args: argparse.Namespace) -> dict[str, Any]:
    common = ["--set", f"scheduler.max_num_seqs={args.max_num_seqs}", "--max-model-len", "1024"]
    arms: dict[str, list[dict]] = {"probe_off": [], "probe_on": []}
    for rep in range(args.repeats):  # alternate the arms: other load on the machine drifts
        for arm, interval in (("probe_off", "0"), ("probe_on", str(args.probe_interval))):
            srv = ServeProcess("--probe-interval", interval, *common)
            try:
                res = asyncio.run(itl_arm(srv.url, args.itl_streams, args.concurrency, args.max_tokens))
            finally:
                code = srv.stop()
            arms[arm].append({**res, "exit_code": code})
            print(f"[{arm} #{rep + 1}] {arms[arm][-1]['itl']}", file=sys.stderr)
    srv = ServeProcess("--probe-interval", "0", "--drain-timeout", str(args.drain_timeout),
                       "--max-body-bytes", "65536", *common)  # fmt: skip
    sig = asyncio.run(sigterm_run(srv, args.requests, args.max_tokens, args.long_tokens))
    p99 = {arm: float(np.median([r["itl"]["p99_ms"] for r in runs])) for arm, runs in arms.items()}
    return {
        "command": "python " + " ".join(sys.argv),
        "itl": {
            "arms": arms,
            "p99_ms_median_of_runs": p99,
            "probe_p99_over_off": round(p99["probe_on"] / p99["probe_off"], 3) if p99["probe_off"] else None,
            "probe_interval_s": args.probe_interval,
            "streams_per_run": args.itl_streams,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
        },
        "sigterm": sig,
        "passed": bool(
            sig["every_stream_ended_cleanly"]
            and sig["exit_code"] == 0
            and sig["kv_request_blocks_at_exit"] == 0
            and sig["asgi_incomplete_response_logs"] == 0
            and sig["health_after_bad_requests"] == 200
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback); default: start one in-process")
    ap.add_argument("--model", default="ouro")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--disconnects", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("-o", "--output", type=Path)
    ap.add_argument("--robustness", action="store_true", help="subprocess servers: ITL +- probe, SIGTERM run")
    ap.add_argument("--repeats", type=int, default=2, help="--robustness: runs per probe arm")
    ap.add_argument("--itl-streams", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--probe-interval", type=float, default=5.0, help="--robustness: the probe arm's interval"
    )
    ap.add_argument("--long-tokens", type=int, default=600)
    ap.add_argument("--drain-timeout", type=float, default=3.0)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.robustness:
        return _write(run_robustness(args), args, torch.__version__)
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


def _write(res: dict[str, Any], args: argparse.Namespace, torch_version: str) -> int:
    import looptrace

    res["setup"] = {
        "server": "looptrace serve --model ouro (ouro-tiny, fp32, CPU) subprocesses on 127.0.0.1",
        "device": f"this CPU machine: {platform.machine()} {platform.processor() or ''}".strip(),
        "max_num_seqs": args.max_num_seqs,
        "python": platform.python_version(),
        "torch": torch_version,
        "looptrace": looptrace.__version__,
        "cpus": os.cpu_count(),
        "load_average_1m_after": round(os.getloadavg()[0], 2),  # other work on the machine slows the run
    }
    text = json.dumps(res, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
