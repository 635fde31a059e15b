"""The decode GEMV against cuBLAS and its byte floor: `kernels/gemv/` beside `F.linear`.

    python bench/kernel_gemv.py [--out DIR] [--copy-tbps 4.28] [--budget-s 150] [--rows 1,2,4,8]

For every projection shape of Ouro-1.4B and Huginn-0125
(`tests/engine/kernels/gemv/test_kernel.py::GPU_SHAPES`) and M in {1, 2, 4, 8}: median µs per call of cuBLAS
(`F.linear`), of the GEMV with the tile table's config (`gemv.pick_config`), and, at M = 1 and 8, of every
other tile candidate (`gemv.CANDIDATES`), so one device call shows which config wins where (the table in
gemv/tiles.py is then set from `best`). Times come from
`kernel_checks.graph_time_us` (a CUDA graph of 20 calls: no host launch cost). The 20 calls cycle through
enough copies of the weight to exceed the 50 MB L2 (>= 128 MB, at most 20 copies), so every call reads its
weight from HBM as in a real decode step. Byte floor = N * K * 2 bytes at the copy bandwidth (4.28 TB/s,
bench/results/README.md); `bw %` = floor / time. `err` = max |gemv - float64| / max |float64| (bf16 output).
Also the Ouro-1.4B decode chain at M = 1: 96 layer-loops x (qkv + o + gate_up + down) + lm_head, summed
from the rows, table config vs best candidate vs cuBLAS (H200: cuBLAS 3.96 ms, floor 2.31 ms).

Stops trying alternative candidates when `--budget-s` seconds have passed (the table's config and cuBLAS
are always timed). Writes `gemv.json` and `.md` under --out (default: $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from looptrace.engine.kernel_checks import graph_time_us  # noqa: E402
from looptrace.engine.kernels.gemv import kernel as gemv_kernel
from looptrace.engine.kernels.gemv import tiles as gemv_tiles
from tests.engine.kernels.gemv.test_kernel import GPU_SHAPES  # noqa: E402

ROWS = (1, 2, 4, 8)
REPS = 20
L2_BYTES = 128 << 20
OURO_CHAIN = {"ouro_qkv": 96, "ouro_o": 96, "ouro_gate_up": 96, "ouro_down": 96, "ouro_lm_head": 1}


def weight_copies(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    copies = max(2, min(REPS, -(-L2_BYTES // (n * k * 2))))
    return [(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16() for _ in range(copies)]


def cycling(fn, x, weights):
    """A call that uses the next weight copy each time (captured calls keep the copy they were given)."""
    state = {"i": 0}

    def call():
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return fn(x, w)

    return call


def rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.double() @ w.double().T
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def bench_shape(name, n, k, rows, copy_tbps, deadline, gen, many_rows=False):
    weights = weight_copies(n, k, gen)
    floor = n * k * 2 / (copy_tbps * 1e12) * 1e6
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        table = gemv_tiles.pick_config(m, n, k)
        configs = [table]
        if many_rows and m > 1:
            configs += [c for c in gemv_tiles.MANY_ROW_CANDIDATES if c != table]
        elif m in (1, 8) and time.monotonic() < deadline:
            configs += [c for c in gemv_tiles.CANDIDATES if c != table]
        cublas = graph_time_us(cycling(F.linear, x, weights), REPS)
        timed = []
        for cfg in configs:
            if cfg is not table and time.monotonic() > deadline:
                break
            try:
                us = graph_time_us(cycling(lambda a, b, c=cfg: gemv_kernel.gemv(a, b, c), x, weights), REPS)
                err = rel_err(gemv_kernel.gemv(x, weights[0], cfg), x, weights[0])
            except Exception as exc:  # a config that does not compile here is reported, not fatal
                print(f"{name} M={m} {cfg}: {type(exc).__name__}: {exc}", flush=True)
                continue
            split, _ = gemv_tiles.split_for(n, k, cfg)
            timed.append({"config": asdict(cfg), "split_k": split, "us": us, "err": err})
        best = min(timed, key=lambda t: t["us"])
        row = {
            "shape": name, "N": n, "K": k, "M": m, "floor_us": floor, "cublas_us": cublas,
            "table_us": timed[0]["us"], "table_err": timed[0]["err"], "best_us": best["us"],
            "best": best["config"], "best_split_k": best["split_k"], "candidates": timed,
        }  # fmt: skip
        print(json.dumps({k_: v for k_, v in row.items() if k_ != "candidates"}), flush=True)
        out.append(row)
    del weights
    torch.cuda.empty_cache()
    return out


def chain(results, key: str) -> float | None:
    at = {r["shape"]: r[key] for r in results if r["M"] == 1}
    if not all(s in at for s in OURO_CHAIN):
        return None
    return sum(at[s] * count for s, count in OURO_CHAIN.items())


def cfg_text(cfg: dict, split: int) -> str:
    kind = ("dot x-first" if cfg.get("x_first") else "dot") if cfg["dot"] else "fma"
    return f"{kind} {cfg['block_n']}x{cfg['block_k']} s{split} w{cfg['num_warps']} st{cfg['num_stages']}"


def markdown(results, chains, copy_tbps) -> str:
    lines = [
        "# Decode GEMV against cuBLAS (`bench/kernel_gemv.py`)",
        "",
        f"Median µs per call from a CUDA graph of {REPS} calls cycling weight copies beyond L2; "
        f"floor = N*K*2 bytes at {copy_tbps} TB/s; bw % = floor / time. `best` = fastest of the table "
        "config and the candidates (at M = 1 and 8). err = max |gemv - float64| / max |float64|.",
        "",
        "| shape | N | K | M | floor µs | cuBLAS µs | bw % | table µs | bw % | best µs | bw % | best config "
        "| err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f = r["floor_us"]
        lines.append(
            f"| {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {f:.2f} | {r['cublas_us']:.2f} | "
            f"{100 * f / r['cublas_us']:.0f} | {r['table_us']:.2f} | {100 * f / r['table_us']:.0f} | "
            f"{r['best_us']:.2f} | {100 * f / r['best_us']:.0f} | {cfg_text(r['best'], r['best_split_k'])} | "
            f"{r['table_err']:.1e} |"
        )
    lines += ["", "Ouro-1.4B decode chain at M = 1 (96 x (qkv + o + gate_up + down) + lm_head), ms:", ""]
    lines += [f"- {k}: {v / 1000:.3f}" if v is not None else f"- {k}: n/a" for k, v in chains.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--copy-tbps", type=float, default=4.28)
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop trying candidates after this")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default="", help="comma-separated subset of the shape names")
    parser.add_argument(
        "--many-rows", action="store_true", help="at 2-8 rows try tiles.MANY_ROW_CANDIDATES (no budget cap)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernel_gemv.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    rows = tuple(int(r) for r in args.rows.split(","))
    names = [s for s in args.shapes.split(",") if s] or list(GPU_SHAPES)
    start = time.monotonic()
    deadline = start + args.budget_s
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    # Ouro first: its chain sets the batch-1 TPOT; alternatives are tried while the budget lasts.
    for name in names:
        n, k = GPU_SHAPES[name]
        results += bench_shape(name, n, k, rows, args.copy_tbps, deadline, gen, args.many_rows)
    chains = {
        "floor": chain(results, "floor_us"),
        "cuBLAS": chain(results, "cublas_us"),
        "GEMV, table config": chain(results, "table_us"),
        "GEMV, best candidate per shape": chain(results, "best_us"),
    }
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_tbps": args.copy_tbps,
        "reps": REPS,
        "wall_s": time.monotonic() - start,
        "ouro_chain_us": chains,
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv.json").write_text(json.dumps(payload, indent=1))
    text = markdown(results, chains, args.copy_tbps)
    (out / "gemv.md").write_text(text)
    print(text)
    print(f"wall {payload['wall_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
