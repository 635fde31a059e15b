"""The synthetic Ouro-1.4B decode token that `bench/token_ablation.py` times: the engine's own kernels at
the real shapes, random weights, one CUDA graph per variant.

`build(rows, gen)` makes the weights (24 layers, fused qkv and gate_up, bf16) and a paged K/V cache holding
a context of `CTX` keys per row; the token runs the 24 layers 4 times (96 layer passes):

    residual+norm (exact Triton) -> qkv GEMM -> write_kv -> paged attention (split-KV) -> o GEMM
    -> residual+norm -> gate_up GEMM -> silu*mul (exact Triton) -> down GEMM

`capture(fn)` captures one token as a CUDA graph (after two warm-up calls on a side stream, as the engine
does), `capture_each` captures many and skips the ones that fail to build, and `time_interleaved` times
their replays round by round, every variant once per round, so drift hits all of them alike.
A library for the bench scripts, not a benchmark itself: it needs CUDA and Triton.
"""

from __future__ import annotations

import math
import time

import torch

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
