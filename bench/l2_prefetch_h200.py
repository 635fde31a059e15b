"""Does prefetching the next projection's weight into L2 shorten Ouro's decode token? (issue #22)

    python bench/l2_prefetch_h200.py [--rows 1] [--rounds 3] [--out DIR]

Builds Ouro-1.4B's decode step for `--rows` rows out of the engine's own kernels, random weights of the
real shapes (24 layers x 4 loops, fused qkv and gate_up, context 519 in the paged cache), and captures one
whole token (96 layer passes) as a CUDA graph per variant:

    residual+norm (exact Triton) -> qkv GEMM -> write_kv -> paged attention (split-KV) -> o GEMM
    -> residual+norm -> gate_up GEMM -> silu*mul (exact Triton) -> down GEMM

The GEMMs are cuBLAS (`F.linear`, exactloop) or the Triton GEMV (`kernels.gemv`, fast). A prefetch
variant forks a side stream before GEMM i and issues `l2_prefetch.prefetch_l2` of the weight of GEMM
i + lead (the sequence wraps to the next loop), so the copy into L2 overlaps GEMM i and the latency-bound
kernels after it; the side stream joins at the end of the token.

Reports the median ms per token replay of each variant (rounds interleaved), the ratio to its
no-prefetch arm, and whether the token's output is bitwise equal to that arm (it must be: the prefetch
moves bytes, not values). Also a single-GEMM check: o_proj time after an L2 flush vs after a prefetch.
Writes `l2_prefetch_h200.json` / `.md` under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN, HEADS, DIM, INTER, LAYERS, LOOPS, CTX, PAGE = 2048, 16, 128, 5632, 24, 4, 519, 16
EPS = 1e-6


def build(rows: int, gen: torch.Generator) -> dict:
    dev = "cuda"

    def w(n, k):
        return (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)

    layers = [
        {
            "qkv": w(3 * HIDDEN, HIDDEN),
            "o": w(HIDDEN, HIDDEN),
            "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER),
            "n1": torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev) * 1.01,
            "n2": torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev) * 0.99,
        }
        for _ in range(LAYERS)
    ]
    pages = math.ceil((CTX + 1) / PAGE)
    entries = rows * pages * LAYERS
    kc = (torch.randn(entries, PAGE, HEADS, DIM, generator=gen, device=dev) * 0.5).to(torch.bfloat16)
    vc = torch.randn(entries, PAGE, HEADS, DIM, generator=gen, device=dev).to(torch.bfloat16)
    bases = torch.arange(rows * pages, device=dev, dtype=torch.int64).view(rows, pages) * LAYERS
    return {
        "layers": layers,
        "kc": kc,
        "vc": vc,
        "tables": bases,
        "ctx": torch.full((rows,), CTX, dtype=torch.int64, device=dev),
        "went": bases[:, CTX // PAGE].contiguous(),
        "woff": torch.full((rows,), CTX % PAGE, device=dev),
        "h0": torch.randn(rows, HIDDEN, generator=gen, device=dev).to(torch.bfloat16),
    }


def token_step(m: dict, linear, prefetch, lead: int, side: torch.cuda.Stream):
    """One decode token (96 layer passes); returns the last hidden state. `prefetch(w)` or None."""
    from looptrace.engine import kernels as K

    seq = [(p, lay[p]) for _ in range(LOOPS) for lay in m["layers"] for p in ("qkv", "o", "gate_up", "down")]
    main = torch.cuda.current_stream()
    calls = 0

    def lin(x, weight):
        nonlocal calls
        if prefetch is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(seq[(calls + lead) % len(seq)][1])
        calls += 1
        return linear(x, weight)

    h = m["h0"]
    x = K.rms_norm(h, m["layers"][0]["n1"], EPS)
    scale = DIM**-0.5
    for it in range(LOOPS * LAYERS):
        lay = m["layers"][it % LAYERS]
        q, k, v = lin(x, lay["qkv"]).split(HIDDEN, dim=-1)
        rows = q.shape[0]
        K.write_kv(
            k.view(rows, HEADS, DIM),
            v.view(rows, HEADS, DIM),
            m["kc"],
            m["vc"],
            m["went"],
            m["woff"],
            it % LAYERS,
        )
        a = K.paged_attn(
            q.view(rows, HEADS, DIM), m["kc"], m["vc"], m["tables"], m["ctx"], it % LAYERS, scale
        )
        h, x = K.residual_rms_norm(lin(a, lay["o"]), lay["n1"], EPS, h, lay["n2"], EPS)
        gate, up = lin(x, lay["gate_up"]).chunk(2, dim=-1)
        d = lin(K.silu_and_mul(gate, up), lay["down"])
        nxt = m["layers"][(it + 1) % LAYERS]["n1"]
        h, x = K.residual_rms_norm(d, lay["n2"], EPS, h, nxt, EPS)
    if prefetch is not None:
        main.wait_stream(side)
    return h


def capture(fn):
    from looptrace.engine import kernels as K

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), K.graph_warmup():
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def capture_each(thunks: dict, t0: float) -> tuple[dict, dict]:
    """One CUDA graph per named thunk (a thunk returns (graph, output)), replayed once; a variant that
    fails to build is reported and skipped, so it costs the others nothing. Returns (graphs, outputs)."""
    graphs, outs = {}, {}
    for name, thunk in thunks.items():
        try:
            graphs[name], out = thunk()
        except Exception as exc:  # noqa: BLE001 - a variant Triton cannot build is a result, not a crash
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        graphs[name].replay()
        torch.cuda.synchronize()
        outs[name] = out.clone()
        print(f"captured {name} ({time.time() - t0:.0f} s)", flush=True)
    return graphs, outs


def time_interleaved(graphs: dict, rounds: int) -> dict[str, list[float]]:
    """Median ms per replay of every graph, `rounds` rounds with the variants interleaved in each."""
    from triton.testing import do_bench

    times: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            times[name].append(do_bench(g.replay, warmup=5, rep=150, return_mode="median"))
    return times


def variants(args) -> dict:
    from looptrace.engine.kernels import gemv
    from looptrace.engine.kernels.l2_prefetch import prefetch_l2

    def pf(programs, chunk, bulk=True, lanes=32):
        return lambda t: prefetch_l2(t, programs=programs, chunk=chunk, lanes=lanes, bulk=bulk)

    out = {
        "cublas": (F.linear, None, 0),
        "cublas+pf1 p8 32K": (F.linear, pf(8, 32768), 1),
        "cublas+pf1 p32 16K": (F.linear, pf(32, 16384), 1),
        "cublas+pf1 p4 64K": (F.linear, pf(4, 65536), 1),
        "cublas+pf2 p8 32K": (F.linear, pf(8, 32768), 2),
        "cublas+pf1 line p64": (F.linear, pf(64, 128, bulk=False, lanes=256), 1),
        "gemv": (gemv.linear, None, 0),
        "gemv+pf1 p8 32K": (gemv.linear, pf(8, 32768), 1),
        "gemv+pf2 p8 32K": (gemv.linear, pf(8, 32768), 2),
    }
    return {k: v for k, v in out.items() if not args.only or k in args.only.split(",")}


def single_gemm_check(m: dict) -> dict:
    """o_proj alone: after evicting L2 (a 256 MB write) vs after a prefetch and a sync."""
    from looptrace.engine.kernels.l2_prefetch import prefetch_l2

    w = m["layers"][3]["o"]
    x = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    junk = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    res = {"cold_us": [], "prefetched_us": []}
    for _ in range(20):
        for key in ("cold_us", "prefetched_us"):
            junk.fill_(1)
            if key == "prefetched_us":
                prefetch_l2(w)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            F.linear(x, w)
            b.record()
            torch.cuda.synchronize()
            res[key].append(a.elapsed_time(b) * 1000)
    return {k: sorted(v)[len(v) // 2] for k, v in res.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/l2_prefetch_h200.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    import triton

    from looptrace.engine import kernels as K

    t0 = time.time()
    K.calibrate("cuda")
    m = build(args.rows, torch.Generator(device="cuda").manual_seed(3))
    side = torch.cuda.Stream()
    thunks = {
        name: lambda linear=linear, prefetch=prefetch, lead=lead: capture(
            lambda: token_step(m, linear, prefetch, lead, side)
        )
        for name, (linear, prefetch, lead) in variants(args).items()
    }
    graphs, outs = capture_each(thunks, t0)
    times = time_interleaved(graphs, args.rounds)
    results = []
    for name in graphs:
        base = "gemv" if name.startswith("gemv") else "cublas"
        ms = sorted(times[name])[len(times[name]) // 2]
        results.append(
            {
                "variant": name,
                "ms_per_token": ms,
                "rounds": times[name],
                "bitwise_vs_no_prefetch": bool(torch.equal(outs[name], outs[base])) if base in outs else None,
            }
        )
    for r in results:
        base = next(
            (x for x in results if x["variant"] == ("gemv" if r["variant"].startswith("gemv") else "cublas")),
            None,
        )
        r["ratio"] = r["ms_per_token"] / base["ms_per_token"] if base else None
        print(json.dumps(r), flush=True)
    check = single_gemm_check(m)
    print("single o_proj:", check, flush=True)
    device = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, Triton {triton.__version__}"
    lines = [
        f"# L2 prefetch of the next weight, Ouro-1.4B decode token, {args.rows} row(s) (issue #22)",
        "",
        f"Device: {device}; {versions}. Command: `python bench/l2_prefetch_h200.py --rows {args.rows} "
        f"--rounds {args.rounds}` ({time.time() - t0:.0f} s). Median ms per replay of a one-token CUDA "
        "graph (96 layer passes), rounds interleaved.",
        "",
        "| variant | ms/token | vs no prefetch | bitwise = no prefetch |",
        "|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        lines.append(
            f"| {r['variant']} | {r['ms_per_token']:.3f} | {ratio} | {r['bitwise_vs_no_prefetch']} |"
        )
    lines += [
        "",
        f"o_proj alone (cuBLAS, 1 row): {check['cold_us']:.1f} µs after an L2 flush, "
        f"{check['prefetched_us']:.1f} µs after prefetch_l2 + sync.",
    ]
    out = Path(args.out)
    tag = f"r{args.rows}"
    (out / f"l2_prefetch_h200_{tag}.json").write_text(
        json.dumps(
            {"device": device, "versions": versions, "results": results, "single_o_proj": check}, indent=1
        )
    )
    (out / f"l2_prefetch_h200_{tag}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
