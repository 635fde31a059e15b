"""The bench suite's one entry point: `python bench/run.py MODE [--out DIR] [--dry-run] [-- EXTRA ARGS]`.

Each mode is one reproducible measurement (what it measures, its floor and its command: bench/README.md).
The command runs in a child process; EXTRA ARGS are appended to it. Before it starts, one line goes to
DIR/commands.txt with the date, the git commit, the versions, the device and the command, and its exit
code follows when it ends, so every result written under DIR says how it was made.

    python bench/run.py --list                    # the modes, one line each
    python bench/run.py tiny                      # base vs exactloop, tiny Ouro on this CPU
    python bench/run.py table2 --out /tmp/t2      # the paper's Table 2 cells (CUDA)
    python bench/run.py token -- --rounds 7       # the synthetic decode token (CUDA)
    python bench/run.py profile --dry-run         # print the command only

On the GPU machine, `bash bench/device.sh MODE` runs these (and the GPU tests) with time limits.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# Hand-picked cells get the 64 graphs the paper's Table 2 ran with (`--cells table2` sets it itself).
GRAPHS_64 = "--set cuda_graphs.max_graphs=64"
# Ouro-1.4B at batch 1 with the Table 2 prompt: the batch-1 TPOT figure of both recipes.
OURO_BATCH1 = "--model ouro -c 1 --prompt-len 512"


@dataclass(frozen=True)
class Mode:
    what: str  # what it measures, one line
    device: str  # "cuda" (needs a GPU) or "any"
    argv: tuple[str, ...]  # the command, "{out}" standing for the output folder


def looptrace(args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "looptrace", *shlex.split(args))


def script(name: str, args: str) -> tuple[str, ...]:
    return (sys.executable, str(BENCH / name), *shlex.split(args))


MODES: dict[str, Mode] = {
    "tiny": Mode(
        "paired base vs exactloop on tiny Ouro (64/16 at C = 1, 8): the bench itself, on any machine",
        "any",
        looptrace("bench --cell ouro-tiny:64/16@1,8 -o {out}/bench_tiny.json"),
    ),
    "table2": Mode(
        "paired base vs exactloop on the paper's Table 2 cells (Ouro-1.4B, Huginn-0125, real shapes)",
        "cuda",
        looptrace("bench --a base --b exactloop --cells table2 -o {out}/table2.json --plot {out}/table2.svg"),
    ),
    "cells": Mode(
        "paired base vs exactloop at the cells given after -- (`-- --cell ouro:512/128@1,8`), 3 runs",
        "any",
        looptrace(f"bench --a base --b exactloop --runs 3 {GRAPHS_64} -o {{out}}/bench_cells.json"),
    ),
    "fast-cells": Mode(
        "paired exactloop vs fast, Ouro-1.4B 512/128 at C = 1, 8, 32",
        "cuda",
        looptrace(
            f"bench --a exactloop --b fast --cell ouro:512/128@1,8,32 --runs 3 {GRAPHS_64}"
            " -o {out}/bench_exactloop_fast_ouro.json"
        ),
    ),
    "profile": Mode(
        "profile --compare exactloop fast at Ouro-1.4B batch 1, prompt 512: wall, busy and idle per token",
        "cuda",
        looptrace(
            f"profile {OURO_BATCH1} --compare exactloop fast"
            " -o {out}/profile_compare_exactloop_fast_ouro-1.4b_c1_p512.txt"
        ),
    ),
    "profile-base": Mode(
        "profile --compare base exactloop at Ouro-1.4B batch 1, prompt 512",
        "cuda",
        looptrace(
            f"profile {OURO_BATCH1} --compare base exactloop"
            " -o {out}/profile_compare_base_exactloop_ouro-1.4b_c1_p512.txt"
        ),
    ),
    "diff-fast": Mode(
        "diff exactloop fast at Ouro-1.4B's real shape, 4 requests x 16 tokens: which streams stay identical",
        "cuda",
        looptrace(
            "diff exactloop fast --model ouro-1.4b --device cuda -c 4 --prompt-len 128 --max-tokens 16"
            " --format json -o {out}/diff_exactloop_fast_ouro-1.4b_c4.json"
        ),
    ),
    "diff-base": Mode(
        "diff base exactloop on CUDA, tiny Ouro: every R0/R1 toggle's streams and logits, the R3 accuracy",
        "cuda",
        looptrace(
            "diff base exactloop --model ouro-tiny --device cuda --format json"
            " -o {out}/diff_base_exactloop_ouro-tiny.json"
        ),
    ),
    "token": Mode(
        "the synthetic Ouro-1.4B decode token: ops left out one at a time, fast's forms, exact",
        "cuda",
        script("token_ablation.py", "--out {out}"),
    ),
    "persistent-loop": Mode(
        "the persistent Ouro loop kernel alone at Ouro-1.4B shapes: checks, ms per loop vs the copy floor",
        "cuda",
        script("kernel_persistent_loop.py", "--out {out}"),
    ),
    "gemv-batch": Mode(
        "the GEMV's tiles swept at 8 rows, then fast vs fast + kernels.gemv_batch (Ouro-1.4B, C = 8, paired)",
        "cuda",
        script("gemv_batch.py", "--out {out}"),
    ),
    "gemv-compile": Mode(
        "the GEMV's many-row tiles compiled for sm_90a (no GPU): grid, registers, shared memory, MMA, per SM",
        "any",
        script("kernel_gemv_compile.py", "--out {out}"),
    ),
    "persistent-loop-faults": Mode(
        "where the persistent Ouro loop faults: each launch shape alone in a child, then the engine, 8 rows",
        "cuda",
        script("persistent_loop_faults.py", "--out {out}"),
    ),
    "persistent-loop-compile": Mode(
        "the persistent Ouro loop kernel compiled for sm_90a (no GPU): registers, spills, SASS per form",
        "any",
        script("kernel_persistent_loop_compile.py", "--out {out}"),
    ),
    "weight-stream": Mode(
        "a probe: every weight of an Ouro loop through a TMA ring (Gluon), against the copy floor and cuBLAS",
        "cuda",
        script("kernel_weight_stream.py", "--out {out}"),
    ),
    "stream-loop-compile": Mode(
        "the one-row TMA-ring Ouro loop kernel compiled for sm_90a (no GPU): registers, spills, shared bytes",
        "any",
        script("kernel_stream_loop_compile.py", "--out {out}"),
    ),
    "attention": Mode(
        "decode attention (split-KV) against its byte floor, Ouro and Huginn heads, 1-64 rows",
        "cuda",
        script("kernel_decode_attention.py", "--out {out}"),
    ),
    "prefill-attention": Mode(
        "packed prefill attention per query-block size, and decode attention beside SDPA",
        "cuda",
        script("kernel_prefill_attention.py", "--out {out}"),
    ),
    "gemv": Mode(
        "the one-row Triton GEMV against cuBLAS and its byte floor at every projection shape",
        "cuda",
        script("kernel_gemv.py", "--out {out}"),
    ),
    "exact-kernels": Mode(
        "the exact fused kernels (RMSNorm, RoPE, SiLU·mul): bitwise against eager, and their timings",
        "cuda",
        script("kernel_exact.py", "--out {out}"),
    ),
    "serve-load": Mode(
        "200 concurrent streams to `looptrace serve` on loopback, 50 hang up: no leak, server stays up",
        "any",
        script("serve_load.py", "-o {out}/serve_load.json"),
    ),
    "serve-robustness": Mode(
        "ITL with the live probe off / on, bad requests under load, SIGTERM drain (serve subprocesses)",
        "any",
        script("serve_load.py", "--robustness -o {out}/serve_robustness.json"),
    ),
    "reference-judge": Mode(
        "`looptrace serve` Ouro-1.4B in bfloat16 judged by our float32 engine: agreement and noise figure",
        "cuda",
        script("reference_judge.py", "--out {out} --model ouro-1.4b"),
    ),
    "house": Mode(
        "the house's figures: import floors, upward arrows, circles, lines per package",
        "any",
        script("house_metrics.py", "--out {out}/house_metrics.json"),
    ),
}


def command(mode: str, out: Path, extra: list[str]) -> list[str]:
    return [part.replace("{out}", str(out)) for part in MODES[mode].argv] + extra


def git_commit() -> str:
    """The checked-out commit, with "+dirty" when tracked files differ from it; "unknown" outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def environment() -> str:
    """Versions and device, one line; the GPU's name when torch sees one."""
    parts = [f"python {platform.python_version()}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{os.cpu_count()}"
    except ImportError:
        device = f"cpu x{os.cpu_count()}"
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    return f"{', '.join(parts)}; device: {device}"


def list_modes() -> str:
    width = max(map(len, MODES))
    return "\n".join(f"{name:<{width}}  [{m.device}] {m.what}" for name, m in MODES.items())


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2: the project's rule for bad input
        self.exit(2, f"bench/run.py: {message} (modes: {', '.join(MODES)})\n")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = Parser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", help="what to measure (--list shows them)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".out/bench")))
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("--list", action="store_true", help="list the modes")
    args = parser.parse_args(own)
    if not args.list and args.mode not in MODES:
        parser.error(f"unknown mode {args.mode!r}" if args.mode else "no mode given")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    if args.list:
        print(list_modes())
        return 0
    args.out = args.out.resolve()  # the child runs in the repository root
    cmd = command(args.mode, args.out, extra)
    shown = shlex.join(["python" if i == 0 else part for i, part in enumerate(cmd)])
    print(shown, flush=True)
    if args.dry_run:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "commands.txt"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with log.open("a") as f:
        f.write(f"{stamp} commit {git_commit()}; {environment()}\n  $ {shown}\n")
    code = subprocess.run(cmd, cwd=REPO).returncode
    with log.open("a") as f:
        f.write(f"  exit {code}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
