"""Forward passes of a language model in a trace without step annotations (a Hugging Face `generate`, a
script's own decode loop): one forward of the model is one step.

How a forward is found, from the CPU ops the profiler recorded (`record_shapes=True` gives their shapes):

1. The lm-head: the GEMM whose output dimension is the vocabulary. The vocabulary is the row count of the
   embedding table (`aten::embedding(weight[V, H], ids)`), else the widest GEMM output of the trace. Each
   lm-head call (nested GEMM ops of one call count once) closes one forward; with no attention call
   between two of them they are not forwards of a model, and none are reported (a first lm-head with no
   attention call before it ends a forward the profiler joined midway: it is dropped).
2. Where a forward starts: the outermost module or Python `forward` event (`with_modules` /
   `with_stack`) around its lm-head that holds no other lm-head call; else its embedding lookup (the
   first one after the previous lm-head); else right after the previous forward's lm-head. The step of a
   forward runs from its start to the next forward's start, so the sampling after its lm-head (and the
   bookkeeping of `generate`) is part of it.
3. Rows: the tokens the forward computes, from the embedding lookup's ids ([B, T] → B·T), else the first
   GEMM's M. The lm-head's own M is not used: `logits_to_keep` computes only the last row.
4. Phase: a decode forward computes the fewest rows (one per sequence of the batch); a forward with more
   is a prefill (its rows are prompt tokens). Where all forwards compute the same rows, the first
   attention call decides: a query of one position against a longer key (a KV cache read) is decode,
   else prefill.

A prefill step counts its rows as prompt tokens, a decode step its rows as output tokens, as vLLM's step
annotations count them (`steps.Step`); the first output token of a `generate` call comes from the
prefill's logits and is not counted, as in vLLM/SGLang traces.
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from looptrace.probes import categories as cats
from looptrace.probes.classify import CPU_OP_CAT
from looptrace.probes.events import TraceEvent
from looptrace.probes.opstats import MODULE_PREFIX, PYTHON_CAT
from looptrace.probes.steps import DECODE, FORWARD_GRAMMAR, PREFILL, Step

FORWARD_CAT = "forward"  # category of the synthetic event that spans one forward's step


@dataclass(frozen=True)
class Forward:
    """One forward pass: its step's host span (start to the next forward's start) and its rows."""

    start: float
    end: float  # the next forward's start, or the thread's last op
    lm_head: TraceEvent
    rows: int
    phase: str  # prefill | decode
    started_by: str  # "module event" | "embedding" | "previous lm-head"


@dataclass(frozen=True)
class Forwards:
    """The forwards of a trace and how they were found (`how`: for the tokens_source text)."""

    forwards: list[Forward]
    vocab: int
    how: str

    def steps(self, pid: int | str, tid: int | str) -> list[Step]:
        """One `steps.Step` per forward: prefill rows are prompt tokens, decode rows output tokens."""
        out = []
        for i, f in enumerate(self.forwards):
            event = TraceEvent(FORWARD_CAT, f"forward#{i}", f.start, f.end - f.start, pid, tid)
            prompt, output = (f.rows, 0) if f.phase == PREFILL else (0, f.rows)
            out.append(Step(event, FORWARD_GRAMMAR, prompt, output, f.rows))
        return out


def find_forwards(events: Sequence[TraceEvent]) -> tuple[Forwards | None, list[Step]]:
    """The forwards of the trace (None where no lm-head is found) and their steps."""
    by_thread: dict[tuple, list[TraceEvent]] = defaultdict(list)
    for e in events:
        if e.cat == CPU_OP_CAT:
            by_thread[(e.pid, e.tid)].append(e)
    if not by_thread:
        return None, []
    gemms = {t: _gemm_calls(ops) for t, ops in by_thread.items()}
    vocab = _vocab(events, gemms)
    if vocab is None:
        return None, []
    heads = {t: [(e, m) for e, m, n in calls if n == vocab] for t, calls in gemms.items()}
    thread = max(heads, key=lambda t: len(heads[t]))
    lm_heads = [e for e, _ in heads[thread]]
    ops = sorted(by_thread[thread], key=lambda e: e.ts)
    if lm_heads and not _attention_between(ops, lm_heads[:1]):
        lm_heads = lm_heads[1:]  # the profiler started inside a forward: its tail is no step
    if not lm_heads or not _attention_between(ops, lm_heads):
        return None, []
    starts, started_by = _starts(events, ops, lm_heads, thread, vocab)
    first_gemms = [(e.ts, m) for e, m, _ in gemms[thread]]
    rows = [_rows(ops, first_gemms, s, h) for s, h in zip(starts, lm_heads, strict=True)]
    phases = _phases(ops, starts, lm_heads, rows)
    last = max(e.end for e in ops)
    ends = [*starts[1:], max(last, lm_heads[-1].end)]
    forwards = [
        Forward(s, e, h, r, p, how)
        for s, e, h, r, p, how in zip(starts, ends, lm_heads, rows, phases, started_by, strict=True)
    ]
    by = Counter(started_by)
    how = f"lm-head GEMM (vocabulary {vocab:,}) in each forward, starts from " + ", ".join(
        f"{n} {what}" for what, n in by.most_common()
    )
    found = Forwards(forwards, vocab, how)
    return found, found.steps(*thread)


# --- the lm-head ---------------------------------------------------------------------------------------


@functools.cache
def _is_gemm(name: str) -> bool:
    return cats.composite_category(name) is None and cats.generic_category(name) == cats.GEMM


@functools.cache
def _is_attention(name: str) -> bool:
    return cats.composite_category(name) == cats.ATTENTION


def gemm_rows_cols(e: TraceEvent) -> tuple[int, int] | None:
    """(M, N) of a GEMM op from its recorded input shapes: rows of the output (batch dims folded in) and
    its output dimension. None where the shapes are not recorded or not understood."""
    dims = e.args.get("Input Dims")
    if not isinstance(dims, list):
        return None
    shapes = [d for d in dims if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    name = e.name
    if name.endswith("::linear") and len(shapes) >= 2:  # linear(x[..., K], w[N, K], bias?)
        x, w = shapes[0], shapes[1]
        return _prod(x[:-1]), w[0]
    if name.endswith("addmm") and len(shapes) >= 3 and len(shapes[1]) == 2:  # addmm(bias, a, b)
        return shapes[1][0], shapes[2][-1]
    if len(shapes) >= 2 and len(shapes[0]) >= 2 and len(shapes[1]) >= 2:  # mm, matmul, bmm: a[.., M, K] @ b
        a, b = shapes[0], shapes[1]
        return _prod(a[:-1]), b[-1]
    return None


def _prod(xs: Iterable[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _gemm_calls(ops: list[TraceEvent]) -> list[tuple[TraceEvent, int, int]]:
    """(op, M, N) of the outermost GEMM op of each GEMM call on one thread (linear → matmul → mm is one
    call), in time order."""
    calls: list[tuple[TraceEvent, int, int]] = []
    end = float("-inf")
    for e in sorted((e for e in ops if _is_gemm(e.name)), key=lambda e: (e.ts, -e.dur)):
        if e.ts < end:  # inside the previous call
            continue
        shape = gemm_rows_cols(e)
        if shape is not None:
            calls.append((e, *shape))
            end = e.end
    return calls


def _vocab(events: Sequence[TraceEvent], gemms: dict[tuple, list[tuple[TraceEvent, int, int]]]) -> int | None:
    """Rows of the embedding table if a GEMM outputs that many columns, else the widest GEMM output."""
    widths = {n for calls in gemms.values() for _, _, n in calls}
    if not widths:
        return None
    tables = Counter(
        d[0][0]
        for e in events
        if e.cat == CPU_OP_CAT
        and e.name.endswith("::embedding")
        and isinstance(d := e.args.get("Input Dims"), list)
        and d
        and isinstance(d[0], list)
        and len(d[0]) == 2
    )
    for rows, _ in tables.most_common():
        if rows in widths:
            return rows
    return max(widths)


def _attention_between(ops: list[TraceEvent], lm_heads: list[TraceEvent]) -> bool:
    """At least one attention op before the first lm-head and between every two: forwards of a model."""
    times = sorted(e.ts for e in ops if _is_attention(e.name))
    edges = [float("-inf")] + [h.ts for h in lm_heads]
    return all(bisect.bisect_left(times, b) > bisect.bisect_left(times, a) for a, b in zip(edges, edges[1:]))


# --- where each forward starts, its rows and phase -------------------------------------------------------


def _starts(
    events: Sequence[TraceEvent], ops: list[TraceEvent], lm_heads: list[TraceEvent], thread: tuple, vocab: int
) -> tuple[list[float], list[str]]:
    modules = sorted(
        (
            e
            for e in events
            if e.cat == PYTHON_CAT
            and (e.pid, e.tid) == thread
            and (e.name.startswith(MODULE_PREFIX) or e.name.endswith(": forward"))
        ),
        key=lambda e: (e.ts, -e.dur),
    )
    module_ts = [m.ts for m in modules]
    head_ts = [h.ts for h in lm_heads]
    embeds = [e for e in ops if e.name.endswith("::embedding") and _table_rows(e) == vocab]
    embed_ts = [e.ts for e in embeds]
    starts, how = [], []
    for k, head in enumerate(lm_heads):
        lo = lm_heads[k - 1].end if k else float("-inf")
        candidates = modules[bisect.bisect_left(module_ts, lo) : bisect.bisect_right(module_ts, head.ts)]
        module = next(  # outermost first: modules are sorted by (start, -duration)
            (
                m
                for m in candidates
                if head.end <= m.end
                and bisect.bisect_left(head_ts, m.end) - bisect.bisect_left(head_ts, m.ts) == 1
            ),
            None,
        )
        j = bisect.bisect_left(embed_ts, lo)
        embed = embeds[j] if j < len(embeds) and embeds[j].ts < head.ts else None
        if module is not None:
            starts.append(module.ts)
            how.append("module event")
        elif embed is not None:
            starts.append(embed.ts)
            how.append("embedding")
        else:
            starts.append(lo if k else ops[0].ts)
            how.append("previous lm-head")
    return starts, how


def _table_rows(e: TraceEvent) -> int | None:
    dims = e.args.get("Input Dims")
    if isinstance(dims, list) and dims and isinstance(dims[0], list) and dims[0]:
        return dims[0][0]
    return None


def _rows(ops: list[TraceEvent], gemms: list[tuple[float, int]], start: float, head: TraceEvent) -> int:
    """Tokens the forward computes: its embedding lookup's ids, else the first GEMM's rows."""
    lo = bisect.bisect_left(ops, start, key=lambda e: e.ts)
    for e in ops[lo:]:
        if e.ts >= head.ts:
            break
        if e.name.endswith("::embedding"):
            dims = e.args.get("Input Dims")
            ids = dims[1] if isinstance(dims, list) and len(dims) > 1 else None
            if isinstance(ids, list) and ids and all(isinstance(x, int) for x in ids):
                return _prod(ids)
            break
    i = bisect.bisect_left(gemms, (start, -1))
    return gemms[i][1] if i < len(gemms) and gemms[i][0] <= head.ts else 1


def _phases(
    ops: list[TraceEvent], starts: list[float], lm_heads: list[TraceEvent], rows: list[int]
) -> list[str]:
    fewest = min(rows)
    if len(set(rows)) > 1:
        return [DECODE if r == fewest else PREFILL for r in rows]
    out = []
    for start, head in zip(starts, lm_heads, strict=True):
        lengths = _query_key_lengths(ops, start, head.ts)
        decode = lengths is not None and lengths[0] == 1 < lengths[1]
        out.append(DECODE if decode or (lengths is None and len(rows) > 1) else PREFILL)
    return out


def _query_key_lengths(ops: list[TraceEvent], start: float, stop: float) -> tuple[int, int] | None:
    """(query, key) positions of the first attention call in [start, stop) with 4-D q and k shapes
    ([B, H, S, D], SDPA's layout)."""
    lo = bisect.bisect_left(ops, start, key=lambda e: e.ts)
    for e in ops[lo:]:
        if e.ts >= stop:
            return None
        if _is_attention(e.name):
            dims = e.args.get("Input Dims")
            if (
                isinstance(dims, list)
                and len(dims) >= 2
                and all(isinstance(d, list) and len(d) == 4 for d in dims[:2])
            ):
                return dims[0][2], dims[1][2]
    return None
