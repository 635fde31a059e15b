"""Wall time and peak memory of `looptrace trace analyze` on one trace file (a benchmark, not a test).

    python bench/trace_analyze_speed.py TRACE [--runs N] [--out DIR] [--label L] [-- trace analyze options]

Each run is a fresh process, `/usr/bin/time -v looptrace trace analyze TRACE --format json -o FILE`, so the
figures include Python start-up, loading the trace and writing the report, as a user sees them. Recorded
per run: wall, user and system seconds and the maximum resident set size (from `/usr/bin/time -v`), and
the 1-minute load average before the run (other processes share the CPU: a busy machine stretches the
wall time, not the user time). The summary takes the median run. Written to DIR (default: printed only):
`trace_analyze_<trace stem>.json` (every run, the command, the commit, the versions, the machine) and
`.md` (one table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TIME_FIELDS = {
    "wall_s": r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)",
    "user_s": r"User time \(seconds\): (\S+)",
    "system_s": r"System time \(seconds\): (\S+)",
    "max_rss_kb": r"Maximum resident set size \(kbytes\): (\d+)",
}


def _seconds(clock: str) -> float:
    """`/usr/bin/time`'s h:mm:ss or m:ss.ss as seconds."""
    seconds = 0.0
    for part in clock.split(":"):
        seconds = seconds * 60 + float(part)
    return seconds


def run_once(trace: Path, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "looptrace", "trace", "analyze", str(trace)]
        cmd += ["--format", "json", "-o", str(Path(tmp) / "report.json"), *extra]
        load = os.getloadavg()[0]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"trace analyze failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        report = json.loads((Path(tmp) / "report.json").read_text())
    run: dict[str, float] = {"load_1min_before": load}
    for key, pattern in TIME_FIELDS.items():
        m = re.search(pattern, done.stderr)
        if m is None:
            raise SystemExit(f"no {key!r} in /usr/bin/time's output")
        run[key] = _seconds(m.group(1)) if key == "wall_s" else float(m.group(1))
    run["tokens"] = report["tokens"]
    run["kernels"] = report["totals"]["kernels"]
    return run


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def environment() -> dict[str, object]:
    import torch

    import looptrace

    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "looptrace": getattr(looptrace, "__version__", "?"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="directory for the .json and .md results")
    parser.add_argument("--label", default="", help="suffix of the result files (e.g. baseline)")
    args = parser.parse_args(ours)
    if not args.trace.is_file():
        raise SystemExit(f"{args.trace}: no such trace file")
    runs = []
    for i in range(args.runs):
        runs.append(run_once(args.trace, extra))
        r = runs[-1]
        print(
            f"run {i + 1}: wall {r['wall_s']:.2f} s, user {r['user_s']:.2f} s, "
            f"max RSS {r['max_rss_kb'] / 1024:.0f} MiB (load {r['load_1min_before']:.2f} before)"
        )
    median = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    result = {
        "command": " ".join(["looptrace", "trace", "analyze", str(args.trace), "--format", "json", *extra]),
        "measured_with": "/usr/bin/time -v, one fresh process per run",
        "environment": environment(),
        "runs": runs,
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
        "median_user_s": statistics.median(r["user_s"] for r in runs),
        "max_rss_mib": max(r["max_rss_kb"] for r in runs) / 1024,
        "median_run": median,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.trace.name.split(".")[0] + (f"_{args.label}" if args.label else "")
        (args.out / f"trace_analyze_{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"trace_analyze_{stem}.md").write_text(_markdown(result, args.trace))


def _markdown(result: dict, trace: Path) -> str:
    env = result["environment"]
    lines = [
        f"# `trace analyze` on {trace.name}",
        "",
        f"`{result['command']}`, measured with {result['measured_with']}; commit {env['commit'][:12]}"
        f"{' (dirty)' if env['dirty'] else ''}, Python {env['python']}, torch {env['torch']}, "
        f"{env['cpus']} CPUs ({env['processor']}).",
        "",
        "| run | wall s | user s | system s | max RSS MiB | load (1 min) before |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(result["runs"], 1):
        lines.append(
            f"| {i} | {r['wall_s']:.2f} | {r['user_s']:.2f} | {r['system_s']:.2f} | "
            f"{r['max_rss_kb'] / 1024:.0f} | {r['load_1min_before']:.2f} |"
        )
    lines += [
        "",
        f"Median wall {result['median_wall_s']:.2f} s, median user {result['median_user_s']:.2f} s, "
        f"peak RSS {result['max_rss_mib']:.0f} MiB.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
