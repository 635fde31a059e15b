"""The reference judge at real shape: `looptrace serve` in bfloat16 on the GPU, judged by our engine in
float32 on the same GPU. Starts the server (a subprocess, port chosen by the OS), runs

    looptrace diff URL URL --served-dtype bfloat16 --reference MODEL --reference-dtype float32
        --reference-device cuda --format json -o OUT/reference_judge.json

(the endpoint against itself: its streams are compared with themselves and scored by the reference), and
writes OUT/reference_judge_summary.json: per-position agreement of the served tokens with the float32
argmax, how far the served logprobs are from the reference's, and the bfloat16 noise figure.

    python bench/reference_judge.py --out OUT [--model ouro-1.4b] [--weights DIR] [--num-requests 16]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def start_server(model: str, weights: str | None, device: str) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "looptrace", "serve", "--model", model, "--dtype", "bfloat16"]
    # The reference engines (float32 and bfloat16 weights) share the GPU: the server's KV pool leaves room
    argv += ["--set", "kv.gpu_memory_utilization=0.5"]
    argv += ["--device", device, "--port", "0", *(["--weights", weights] if weights else [])]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    found: list[str] = []

    def read() -> None:  # the server prints its URL on stderr; keep draining so it never blocks
        for line in proc.stderr:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if m and not found:
                found.append(m.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if found and _healthy(found[0]):
            return proc, found[0]
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"looptrace serve did not come up (exit {proc.poll()})")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def summary(report: dict) -> dict:
    ref = report["reference"]
    return {
        "model": ref["preset"],
        "reference": {k: ref[k] for k in ("dtype", "device", "weights")},
        "served_dtype": "bfloat16",
        "workload": report["header"]["workload"],
        "agreement": ref["agreement"]["a"],
        "noise": ref["noise"],
        "divergences": ref["blame_counts"],
        "streams": report["summary"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="ouro-1.4b")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run with a tiny model")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.device == "cuda" and not _cuda():
        print("bench/reference_judge.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(args.model, args.weights, args.device)
    report_path = args.out / "reference_judge.json"
    try:
        diff = [sys.executable, "-m", "looptrace", "diff", url, url, "--served-dtype", "bfloat16"]
        diff += ["--reference", args.weights or args.model, "--reference-dtype", "float32"]
        diff += ["--reference-device", args.device, "--num-requests", str(args.num_requests), "-c", "1"]
        diff += ["--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
        diff += ["--format", "json", "-o", str(report_path), "--no-progress"]
        print(" ".join(diff), file=sys.stderr)
        rc = subprocess.run(diff).returncode
    finally:
        proc.terminate()
        proc.wait(60)
    if not report_path.exists():
        return rc or 1
    out = summary(json.loads(report_path.read_text()))
    (args.out / "reference_judge_summary.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
