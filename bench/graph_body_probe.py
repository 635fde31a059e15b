"""Why a profile's graph replays do not match their eager graph bodies: one summary per trace.

    python bench/graph_body_probe.py TRACE.json [--out FILE]

For each `lt.graph/<name>/<rows>` range: its thread, duration, and the kernels whose launching call lies
inside it (by correlation, any thread and the range's own thread); for each graph replay in the decode
window: its kernel count and first kernel names. A diagnostic for issue #20 (exactloop's whole-token
replays came out "unmatched" on the H200); it prints what it finds and asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from looptrace.probes import classify as cl
from looptrace.probes.counters import GRAPH_BODY_PREFIX, WINDOW_DECODE
from looptrace.probes.events import load_chrome_trace


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trace = load_chrome_trace(args.trace)
    ev = trace.events
    calls = {e.correlation: e for e in ev if cl.is_api_call(e) and e.correlation is not None}
    kernels = [e for e in ev if cl.is_kernel(e)]
    lines: list[str] = []
    bodies = sorted((e for e in ev if e.name.startswith(GRAPH_BODY_PREFIX)), key=lambda e: e.ts)
    lines.append(f"{len(bodies)} graph body ranges, {len(kernels)} kernels, {len(calls)} api calls")
    for b in bodies:
        own = any_thread = 0
        first: list[str] = []
        for k in kernels:
            c = calls.get(k.correlation)
            if c is None or not (b.ts <= c.ts < b.end):
                continue
            any_thread += 1
            if (c.pid, c.tid) == (b.pid, b.tid):
                own += 1
                if len(first) < 3:
                    first.append(k.name[:50])
        apis = Counter(c.name for c in calls.values() if b.ts <= c.ts < b.end)
        lines.append(
            f"{b.name} thread={b.tid} dur={b.dur:.0f}us kernels own-thread={own} any-thread={any_thread} "
            f"apis={dict(apis.most_common(4))} first={first}"
        )
    window = next((e for e in ev if e.name == WINDOW_DECODE), None)
    launches = [
        c
        for c in calls.values()
        if cl.is_graph_launch(c) and (window is None or window.ts <= c.ts < window.end)
    ]
    for g in sorted(launches, key=lambda e: e.ts)[:3]:
        ks = sorted((k for k in kernels if k.correlation == g.correlation), key=lambda k: k.ts)
        lines.append(f"replay corr={g.correlation} kernels={len(ks)} first={[k.name[:50] for k in ks[:3]]}")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
