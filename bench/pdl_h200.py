"""Does programmatic dependent launch (`kernels.pdl`) shorten Ouro's decode token? (issue #22)

    python bench/pdl_h200.py [--rows 1,8] [--rounds 5] [--out DIR]

The synthetic Ouro-1.4B token of `bench/l2_prefetch_h200.py` (the engine's own kernels, random weights of
the real shapes, 24 layers x 4 loops, context 519) captured as one CUDA graph per variant:

    cublas / gemv              the projections through cuBLAS (exactloop) or the Triton GEMV (fast)
    +pdl                       every Triton kernel launched as a programmatic dependent (launch_mode)
    +pdl pf                    the same with the GEMV's L2 prefetch of its weight slice before its wait
    +pdl preload               the same with the GEMV's first weight tile loaded before its wait
                               (kernels.gemv_preload)

Reports the median ms per token replay (variants interleaved, `--rounds` rounds), the ratio to the arm
without PDL and whether the token's output is bitwise equal to it (it must be: PDL is R0). Writes
`pdl_h200.json` / `.md` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from l2_prefetch_h200 import build, capture, token_step  # noqa: E402  (the same synthetic token)


def variants():
    from looptrace.engine.kernels import gemv

    return {  # name: (linear, pdl, GEMV L2 prefetch under PDL, GEMV first-tile preload under PDL)
        "cublas": (F.linear, False, False, False),
        "cublas+pdl": (F.linear, True, False, False),
        "gemv": (gemv.linear, False, False, False),
        "gemv+pdl": (gemv.linear, True, False, False),
        "gemv+pdl pf": (gemv.linear, True, True, False),
        "gemv+pdl preload": (gemv.linear, True, False, True),
    }


def run_rows(rows: int, rounds: int, t0: float) -> list[dict]:
    from triton.testing import do_bench

    from looptrace.engine.kernels import gemv, launch_mode

    m = build(rows, torch.Generator(device="cuda").manual_seed(3))
    side = torch.cuda.Stream()
    graphs, outs = {}, {}
    for name, (linear, pdl, prefetch, preload) in variants().items():
        gemv.PREFETCH_UNDER_PDL = prefetch
        with launch_mode.dependent_launches(pdl, preload):  # the warm-ups and the capture
            graphs[name], out = capture(lambda linear=linear: token_step(m, linear, None, 0, side))
        gemv.PREFETCH_UNDER_PDL = False
        graphs[name].replay()
        torch.cuda.synchronize()
        outs[name] = out.clone()
        print(f"rows {rows}: captured {name} ({time.time() - t0:.0f} s)", flush=True)
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            times[name].append(do_bench(g.replay, warmup=5, rep=150, return_mode="median"))
    results = []
    for name in graphs:
        base = name.split("+")[0]
        ms = sorted(times[name])[len(times[name]) // 2]
        base_ms = sorted(times[base])[len(times[base]) // 2]
        results.append(
            {
                "rows": rows,
                "variant": name,
                "ms_per_token": ms,
                "rounds": times[name],
                "vs_no_pdl": ms / base_ms,
                "bitwise_vs_no_pdl": bool(torch.equal(outs[name], outs[base])),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    graphs.clear()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/pdl_h200.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    import triton

    from looptrace.engine import kernels as K

    t0 = time.time()
    K.calibrate("cuda")
    results = [r for rows in args.rows.split(",") for r in run_rows(int(rows), args.rounds, t0)]
    device = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, Triton {triton.__version__}"
    lines = [
        "# Programmatic dependent launch, Ouro-1.4B decode token (issue #22)",
        "",
        f"Device: {device}; {versions}. Command: `python bench/pdl_h200.py --rows {args.rows} --rounds "
        f"{args.rounds}` ({time.time() - t0:.0f} s). Median ms per replay of a one-token CUDA graph "
        "(96 layer passes), variants interleaved.",
        "",
        "| rows | variant | ms/token | vs no PDL | bitwise = no PDL |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} | {r['variant']} | {r['ms_per_token']:.3f} | {r['vs_no_pdl']:.3f} "
            f"| {r['bitwise_vs_no_pdl']} |"
        )
    out = Path(args.out)
    (out / "pdl_h200.json").write_text(
        json.dumps({"device": device, "versions": versions, "results": results}, indent=1)
    )
    (out / "pdl_h200.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
