"""The `dead_kv` finding: decode attention that reads key/value slots holding nothing live.

A decode row attends to its context (prompt + tokens so far). An attention that gathers a padded key length
(whole pages, a static maximum length, a capture bucket) computes over the dead slots too: looptrace's
torch attention path gathers whole pages (on CUDA the full-width block table of the longest context), a
Hugging Face static cache attends over its maximum length. The trace shows it where both numbers are in it:

- the keys read: the attention call's recorded key shape (`record_shapes`; SDPA's `k[B, Hk, Sk, D]`,
  B rows of Sk keys each), through `DeviceItem.shapes`;
- the keys live: the step's `lt.kv/<n>` marker (looptrace's engine: the context lengths of the step's
  rows, summed; `Analysis.live_keys`).

A decode attention's time grows with the keys it reads, so the dead share of its keys is taken as the
share of its time spent on them; exact-length attention (a paged kernel that reads only the row's pages
and stops at its length) removes it. Silent without shapes or markers, and when the time on dead slots is
under `MIN_SAVING_PCT` of the decode attention's time.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from looptrace.probes.counters import Analysis
from looptrace.probes.events import TraceEvent
from looptrace.probes.finding import MIN_SAVING_PCT, Finding
from looptrace.probes.window_items import DeviceItem

ATTENTION_OP = "scaled_dot_product"  # the SDPA ops (aten::scaled_dot_product_attention and its backends)


@dataclass(frozen=True)
class AttentionCall:
    """One decode attention call: rows, keys each row read (its key length), live keys, device time."""

    rows: int
    keys_read: int  # per row
    live: int  # summed over the rows
    us: float

    @property
    def dead_share(self) -> float:
        read = self.rows * self.keys_read
        return max(0.0, read - self.live) / read if read else 0.0


def attention_calls(
    items: Sequence[DeviceItem], live_keys: Sequence[tuple[float, int]]
) -> list[AttentionCall]:
    """Decode attention calls (one query per row) with recorded key shapes, each with the live keys of the
    step marker before it."""
    times = [ts for ts, _ in live_keys]
    by_call: dict[int, list[DeviceItem]] = defaultdict(list)
    outer: list[TraceEvent] = []  # the outermost SDPA op of each call (its backend op nests inside it)
    for item in sorted((i for i in items if i.shapes is not None), key=lambda i: i.shapes.ts):
        op = item.shapes
        if ATTENTION_OP not in op.name:
            continue
        if not (outer and _within(op, outer[-1])):
            outer.append(op)
        by_call[id(outer[-1])].append(item)
    out = []
    for op in outer:
        call = by_call[id(op)]
        dims = op.args.get("Input Dims") or []
        if len(dims) < 2 or len(dims[0]) != 4 or len(dims[1]) != 4 or dims[0][2] != 1:
            continue  # no shapes, or not a decode call (one query per row)
        k = bisect.bisect_right(times, op.ts) - 1
        if k < 0:
            continue  # no marker: the live keys are unknown
        out.append(AttentionCall(dims[1][0], dims[1][2], live_keys[k][1], sum(i.event.dur for i in call)))
    return out


def _within(inner: TraceEvent, op: TraceEvent) -> bool:
    same_thread = (inner.pid, inner.tid) == (op.pid, op.tid)
    return same_thread and op.ts <= inner.ts and inner.end <= op.end


def dead_kv(analysis: Analysis) -> Finding | None:
    c = analysis.counters
    calls = attention_calls(analysis.device_items, analysis.live_keys)
    if not calls:
        return None
    tokens = c.tokens
    wall = c.wall_us if c.wall_us else c.host_us
    device_us = c.gpu_busy_us if c.gpu_busy_us else c.gpu_us
    attention_us = sum(a.us for a in calls)
    dead_us = sum(a.us * a.dead_share for a in calls)
    # The threshold is on the attention's own time: the dead share is set by the KV layout, while the
    # attention's share of the step depends on the model's size (small in a tiny model on a CPU).
    if not device_us or not attention_us or 100.0 * dead_us / attention_us < MIN_SAVING_PCT:
        return None
    read = sum(a.rows * a.keys_read for a in calls)
    live = sum(a.live for a in calls)
    word = "GPU" if c.mode == "gpu" else "CPU op"
    lengths = sorted({a.keys_read for a in calls})
    return Finding(
        kind="dead_kv",
        cost=(
            f"decode attention reads {read / len(calls):,.1f} keys per call where {live / len(calls):,.1f} "
            f"are live ({100.0 * (read - live) / read:.0f} % dead): {dead_us / tokens:,.1f} µs/token of "
            f"{word} time on dead slots ({100.0 * dead_us / device_us:.0f} % of the {word} busy time)"
        ),
        cost_us_per_token=dead_us / tokens,
        cost_pct_of_wall=100.0 * dead_us / wall if wall else 0.0,
        where=f"{len(calls) / tokens:,.1f} attention calls/token (SDPA over gathered keys)",
        evidence=(
            f"key lengths read {', '.join(str(n) for n in lengths[:6])} (recorded shapes) against the live "
            f"context of each step (lt.kv markers); attention {attention_us / tokens:,.1f} µs/token"
        ),
        remedy=(
            "attend over the live keys only: looptrace's engine kernels.attention=triton (the paged kernel "
            "reads only the row's pages, up to its length), vLLM's paged attention; Hugging Face: a dynamic "
            "cache instead of a static one"
        ),
        saving_us_per_token=dead_us / tokens,
        saving_pct_of_wall=100.0 * dead_us / wall if wall else 0.0,
        estimate=(
            "per decode attention call, its time × the dead share of the keys it read (a decode row's "
            "attention time grows with its keys)"
        ),
    )
