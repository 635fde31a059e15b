"""Where do the TTFT spikes of single bench rounds come from? (issue #22, `bench --a exactloop --b fast`)

    python bench/ttft_spikes_h200.py [--out DIR] -- BENCH ARGS...

Runs `looptrace bench BENCH ARGS` in this process with three recorders on: Triton compilations
(`triton.knobs.runtime.jit_post_compile_hook`: kernel and specialisation), Python garbage collections
(`gc.callbacks`: generation and pause) and the bench's rounds (`EngineBackend.run`: cell, arm, round,
start, end). Writes `ttft_spikes.json` (every event) and `ttft_spikes.md` (per round: its TTFT, and the
compilations and collections that fell inside it) under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
EVENTS: list[dict] = []


def _now() -> float:
    return round(time.perf_counter() - T0, 4)


def _on_compile(*args, **kwargs) -> None:
    EVENTS.append({"kind": "compile", "t": _now(), "what": str(kwargs.get("repr", ""))[:160]})


_gc_start: dict[int, float] = {}


def _on_gc(phase: str, info: dict) -> None:
    gen = info.get("generation", -1)
    if phase == "start":
        _gc_start[gen] = time.perf_counter()
        return
    pause = (time.perf_counter() - _gc_start.pop(gen, time.perf_counter())) * 1e3
    EVENTS.append({"kind": "gc", "t": _now(), "generation": gen, "pause_ms": round(pause, 3)})


def _record_rounds() -> None:
    from looptrace.drive import bench_run

    real = bench_run.EngineBackend.run

    def run(self, handle, cell, arm, round):
        start = _now()
        out = real(self, handle, cell, arm, round)
        EVENTS.append({"kind": "round", "t": start, "end": _now(), "cell": cell.label, "arm": arm,
                       "round": round, "ttft_p50_ms": out.get("ttft_p50_ms")})  # fmt: skip
        return out

    bench_run.EngineBackend.run = run


def _summary(events: list[dict]) -> str:
    rounds = [e for e in events if e["kind"] == "round"]
    lines = [
        "| cell | arm | round | TTFT p50 ms | compiles inside | gc pauses >= 1 ms inside (gen: ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rounds:
        inside = [e for e in events if e["kind"] != "round" and r["t"] <= e["t"] <= r["end"]]
        compiles = [e["what"].split("[")[0] for e in inside if e["kind"] == "compile"]
        gcs = [e for e in inside if e["kind"] == "gc" and e["pause_ms"] >= 1]
        pauses = [f"{e['generation']}: {e['pause_ms']:.1f}" for e in gcs]
        ttft = r["ttft_p50_ms"]
        lines.append(
            f"| {r['cell']} | {r['arm']} | {r['round']} | {ttft:.1f} | {len(compiles)} "
            f"{sorted(set(compiles))[:4]} | {', '.join(pauses[:8])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args, bench_args = parser.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    import triton

    triton.knobs.runtime.jit_post_compile_hook = _on_compile
    gc.callbacks.append(_on_gc)
    _record_rounds()
    from looptrace.cli.main import app

    try:
        app(["bench", *bench_args], standalone_mode=False)
    finally:
        out = Path(args.out)
        (out / "ttft_spikes.json").write_text(json.dumps(EVENTS, indent=1))
        (out / "ttft_spikes.md").write_text(
            f"# TTFT spikes: `looptrace bench {' '.join(bench_args)}`\n\n" + _summary(EVENTS)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
