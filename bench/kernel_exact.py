"""Exact fused kernels on a CUDA GPU: bitwise checks against the engine's eager ops and timings.

    python bench/kernel_exact.py [--out DIR]   # DIR: $OUT or /tmp; writes exact_kernels.{md,json}
    python bench/kernel_exact.py --sections timings               # timings only
    python bench/kernel_exact.py --sections checks --variants rope,silu_mul

A fresh machine compiles every variant first (calibrate() compiled 10 one-kernel variants in 41 s, H200);
the Triton cache (~/.triton/cache) makes later processes on the same machine start at once.

Checks: for each kernel variant x model width x row bucket, the number of (row count, input kind, eager |
graph) cases whose output is bitwise equal (`torch.equal` and equal bit patterns) to the eager engine op.
Variants beyond the shipped ones are diagnostics: the one-kernel RMSNorm with each warp-shuffle order, and
the SiLU kernel compiled with FMA contraction on / libdevice flush-to-zero on.
Timings: `triton.testing.do_bench` median, microseconds per call: eager call (host launch included) and
CUDA-graph replay of 20 calls divided by 20 (GPU time), for the eager op and the exact kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import zlib

import torch

from looptrace.engine import kernel_checks as checks
from looptrace.engine import kernels
from looptrace.engine.kernels import reduce_order

MODELS = checks.MODELS
BUCKETS = checks.BUCKETS
KINDS = checks.KINDS
TIMING_ROWS = (1, 8, 32, 128, 512, 2048)
SILU_VARIANTS = {
    "": None,
    " (fp fusion on)": {"enable_fp_fusion": True, "enable_reflect_ftz": False},
    " (libdevice ftz on)": {"enable_fp_fusion": False, "enable_reflect_ftz": True},
}


def log(*a):
    print(*a, flush=True)


def env_info() -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": p.name,
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "default_shuffle_order": reduce_order.default_shuffle_order(),
    }


def mean_order_probe() -> dict:
    """Emulated CUDA mean (elementwise fp32 adds on the GPU) vs torch's mean, per order: equal rows."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    out = {}
    for n in (2048, 5280):
        for rows in (1, 2, 3, 4, 7, 8, 15, 16, 17, 64, 300):
            key = f"N={n} rows={rows}"
            out[key] = {}
            xs = []
            for _ in range(8):
                x = torch.randn(rows, n, generator=gen, device="cuda") * torch.exp2(
                    torch.randint(-20, 20, (rows, n), generator=gen, device="cuda").float()
                )
                xs.append(x.bfloat16().float().pow(2))
            for order in ("desc", "asc"):
                eq = tot = 0
                for sq in xs:
                    ref = sq.mean(-1)
                    emu = reduce_order.emulate_mean(sq, order)
                    eq += int((emu == ref).sum())
                    tot += rows
                out[key][order] = [eq, tot]
    return out


def variants():
    """(label, maker(spec, rows, kind, gen) -> Case) for every kernel variant checked."""
    v = [
        (
            "rmsnorm one-kernel (auto order)",
            lambda s, r, k, g: checks.rmsnorm_case(s, r, k, g, "cuda", "auto"),
        ),
        (
            "rmsnorm one-kernel, desc shuffle",
            lambda s, r, k, g: checks.rmsnorm_case(s, r, k, g, "cuda", "one:desc"),
        ),
        (
            "rmsnorm one-kernel, asc shuffle",
            lambda s, r, k, g: checks.rmsnorm_case(s, r, k, g, "cuda", "one:asc"),
        ),
        ("rmsnorm three-kernel", lambda s, r, k, g: checks.rmsnorm_case(s, r, k, g, "cuda", "three")),
        ("rmsnorm q/k-norm, strided (OLMo)", None),
        ("rope", lambda s, r, k, g: checks.rope_case(s, r, k, g, "cuda")),
    ]
    for label, opts in SILU_VARIANTS.items():
        v.append(
            (
                f"silu_mul{label}",
                lambda s, r, k, g, o=opts, lab=label: checks.silu_case(s, r, k, g, "cuda", o, lab),
            )
        )
    return v


def run_checks(results: dict, only: str = "", on_variant=lambda: None) -> dict:
    for label, maker in variants():
        if only and not any(tok.strip() and tok.strip() in label for tok in only.split(",")):
            continue
        res = results[label] = {}
        t0 = time.time()
        for model in MODELS:
            spec = checks.spec(model)
            if maker is None:  # OLMo's q/k norm over a strided slice of Wqkv
                if model != "olmo-retrofit-1b":
                    continue
                make = lambda s, r, k, g: checks.rmsnorm_case(s, r, k, g, "cuda", "auto", qk=True)  # noqa: E731
            else:
                make = maker
            res[model] = {}
            for bucket, rows_list in BUCKETS.items():
                eq = tot = 0
                fails = []
                gen = torch.Generator(device="cuda").manual_seed(
                    zlib.crc32(f"{label}|{model}|{bucket}".encode())
                )
                for rows in rows_list:
                    for kind in KINDS:
                        try:
                            case = make(spec, rows, kind, gen)
                            if not case.uses_kernel:
                                fails.append(f"rows={rows} {kind}: fell back to eager")
                                tot += 2
                                continue
                            for mode in ("eager", "graph"):
                                ok, diff = checks.compare(case, mode)
                                tot += 1
                                eq += ok
                                if not ok:
                                    fails.append(f"rows={rows} {kind} {mode}: {diff} differ")
                        except Exception as e:  # record and keep going: one device call checks everything
                            tot += 2
                            fails.append(f"rows={rows} {kind}: {type(e).__name__}: {str(e)[:200]}")
                res[model][bucket] = {"equal": eq, "total": tot, "failures": fails[:12]}
        log(
            f"checked {label} in {time.time() - t0:.1f}s:",
            {m: sum(b["equal"] for b in r.values()) for m, r in res.items()},
        )
    return results


def run_timings(deadline: float = float("inf")) -> dict:
    from triton.testing import do_bench

    out = {}
    gen = torch.Generator(device="cuda").manual_seed(11)
    makers = {
        "rmsnorm (one-kernel)": lambda s, r: checks.rmsnorm_case(s, r, "random", gen, "cuda", "auto"),
        "rmsnorm (three-kernel)": lambda s, r: checks.rmsnorm_case(s, r, "random", gen, "cuda", "three"),
        "rope": lambda s, r: checks.rope_case(s, r, "random", gen, "cuda"),
        "silu_mul": lambda s, r: checks.silu_case(s, r, "random", gen, "cuda"),
    }
    for label, make in makers.items():
        for model in MODELS:
            spec = checks.spec(model)
            for rows in TIMING_ROWS:
                key = f"{label}|{model}|{rows}"
                if time.time() > deadline:
                    out[key] = {"error": "skipped: time budget"}
                    continue
                try:
                    case = make(spec, rows)
                    case.exact()
                    torch.cuda.synchronize()
                    out[key] = {
                        "eager_us": do_bench(case.eager, warmup=10, rep=60, return_mode="median") * 1000,
                        "exact_us": do_bench(case.exact, warmup=10, rep=60, return_mode="median") * 1000,
                        "eager_graph_us": checks.graph_time_us(case.eager),
                        "exact_graph_us": checks.graph_time_us(case.exact),
                    }
                except Exception as e:
                    out[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        log(f"timed {label}")
    return out


def render(env, calib, probe, results, timings, elapsed) -> str:
    lines = [
        "# Exact fused kernels: bitwise checks and timings",
        "",
        f"Device: {env.get('gpu')} ({env.get('sms')} SMs); torch {env.get('torch')} "
        f"(CUDA {env.get('cuda')}), "
        f"Triton {env.get('triton')}, Python {env.get('python')}. Command: `python bench/kernel_exact.py` "
        f"({elapsed:.0f} s).",
        "",
        f"`kernels.calibrate()` on this GPU: {calib}. torch-version default shuffle order: "
        f"{env.get('default_shuffle_order')}.",
        "",
        "## Bitwise checks (equal / total cases)",
        "",
        "A case = one row count x one input kind ("
        + ", ".join(KINDS)
        + ") x {eager call, CUDA-graph replay}, "
        "compared with `torch.equal` and bit patterns against the engine's eager op. Buckets: "
        + "; ".join(f"{b}: rows {', '.join(map(str, r))}" for b, r in BUCKETS.items())
        + ".",
        "",
    ]
    for label, res in results.items():
        lines += [
            f"### {label}",
            "",
            "| model | " + " | ".join(BUCKETS) + " | all |",
            "|---" * (len(BUCKETS) + 2) + "|",
        ]
        for model, buckets in res.items():
            cells = [f"{b['equal']}/{b['total']}" for b in buckets.values()]
            eq = sum(b["equal"] for b in buckets.values())
            tot = sum(b["total"] for b in buckets.values())
            lines.append(f"| {model} | " + " | ".join(cells) + f" | **{eq}/{tot}** |")
        fails = [f"{m} {bk}: {f}" for m, bs in res.items() for bk, b in bs.items() for f in b["failures"]]
        if fails:
            lines += ["", "First failures:", ""] + [f"- {f}" for f in fails[:10]]
        lines.append("")
    lines += [
        "## Mean-order probe (emulated CUDA order with elementwise fp32 adds vs torch.mean, equal rows)",
        "",
        "| shape | desc | asc |",
        "|---|---|---|",
    ]
    for key, v in probe.items():
        lines.append(f"| {key} | {v['desc'][0]}/{v['desc'][1]} | {v['asc'][0]}/{v['asc'][1]} |")
    lines += [
        "",
        "## Timings (µs per call, do_bench median)",
        "",
        "eager call = Python call incl. launches; graph = CUDA-graph replay of 20 calls / 20 (GPU time).",
        "",
        "| kernel | model | rows | eager call | exact call | eager graph | exact graph | graph speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, t in timings.items():
        label, model, rows = key.split("|")
        if "error" in t:
            lines.append(f"| {label} | {model} | {rows} | error: {t['error']} |||||")
            continue
        lines.append(
            f"| {label} | {model} | {rows} | {t['eager_us']:.1f} | {t['exact_us']:.1f} | "
            f"{t['eager_graph_us']:.2f} | {t['exact_graph_us']:.2f} | "
            f"{t['eager_graph_us'] / t['exact_graph_us']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def write(out_dir, env, calib, probe, results, timings, errors, elapsed) -> str:
    md = render(env, calib, probe, results, timings, elapsed)
    if errors:
        md += "\n## Errors\n\n" + "\n".join(f"```\n{e}\n```" for e in errors) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "exact_kernels.md"), "w") as f:
        f.write(md)
    blob = {
        "env": env,
        "calibrate": calib,
        "mean_order_probe": probe,
        "checks": results,
        "timings_us": timings,
        "errors": errors,
        "elapsed_s": elapsed,
    }
    with open(os.path.join(out_dir, "exact_kernels.json"), "w") as f:
        json.dump(blob, f, indent=1)
    return md


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--sections", default="calibrate,probe,checks,timings", help="comma list to run")
    ap.add_argument("--variants", default="", help="comma list of substrings: check only matching variants")
    ap.add_argument(
        "--budget-s", type=float, default=1e9, help="stop timing new shapes after this many seconds"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernel_exact.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    sections = set(args.sections.split(","))
    t0 = time.time()
    env, calib, probe, results, timings, errors = {}, {}, {}, {}, {}, []

    def save():
        write(args.out, env, calib, probe, results, timings, errors, time.time() - t0)

    steps = {
        "env": lambda: env.update(env_info()),
        "calibrate": lambda: calib.update(kernels.calibrate("cuda")),
        "probe": lambda: probe.update(mean_order_probe()),
        "checks": lambda: run_checks(results, args.variants, save),
        "timings": lambda: timings.update(run_timings(t0 + args.budget_s)),
    }
    for name, step in steps.items():
        if name != "env" and name not in sections:
            continue
        try:
            step()
            log(f"{name} done at {time.time() - t0:.1f}s")
        except Exception:
            errors.append(f"{name}: {traceback.format_exc()[-2000:]}")
            log(errors[-1])
        save()  # partial results survive a timeout
    md = write(args.out, env, calib, probe, results, timings, errors, time.time() - t0)
    log(md)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
