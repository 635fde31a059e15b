"""Loop structure of looped models in traces without looptrace's ranges (vLLM, SGLang, Hugging Face, or one
of our own traces with its lt.* ranges stripped).

A looped model (Ouro, Huginn-0125) runs one block of L layers R times per token. In launch order, the
kernels (or leaf CPU ops) of one forward are

    prelude  [prelude layers]  R × ( head  L × [layer]  tail )  [coda layers]  coda

where head/tail are per-loop ops (Huginn: the adapter that opens each loop; Ouro: the loop's final norm
and exit gate). A plain transformer is N × [layer] once per forward: no repeated block, no loops.

1. Layer passes. Where module paths give layer indices (`Context.layer` = "layer<i>", vLLM's
   `model.layers.<i>`), each run of one index is a layer pass, and an index that does not follow the
   previous one (0 after L-1) starts a new block. Otherwise attention calls anchor the layers: the ops
   from one attention call to the next are the layer period; calls linked by exactly that period form a
   block; a layer starts where the ops before a block's first call stop matching the period's end (its
   input norm, QKV GEMM, RoPE, KV write), the shortest such match over the blocks of several layers.
   Indices that give no chain (one module per (loop, layer), numbered loop × L + layer) fall back to the
   attention anchors.
2. Loops. Two or more consecutive blocks with the same ops, separated by the same gap (both up to a
   one-off op, e.g. a first-use allocation), are the passes of one recurrent block; not when the gap
   samples a token (successive forwards of a plain model in one sequence spanning several steps), nor when
   a block's edge layers are not whole copies of the layer period (alternating layer types: sliding/full
   attention, dense/MoE). Chains whose passes have another layer count than the widest-covering one are
   dropped (one recurrent block per model: Huginn's coda layers also run twice in a prefill step).
3. The gap between two passes splits into the tail of one and the head of the next: its ops that the
   last pass also runs after its layers are tail, those the first pass also runs before its layers are
   head (tail wins where both hold); ops that are neither run between loops (stage recurrent, no loop).
4. Ops before the first pass are prelude, after the last coda (between two chains of passes in one
   sequence: coda up to the last sampling op, then prelude); layer passes there are prelude<i>/coda<i>,
   numbered on across the region's blocks (a repeat of its first block starts again at 0). Ops after the
   last sampling op prepare the next forward: prelude.
5. A prefill forward (`prefill=`): its prelude and loops are stage prefill, as looptrace's ranges name its
   prefill step; its last coda pass (where the coda runs again for the last prompt row), the ops leading
   to it and sampling keep theirs; the ops after sampling take the next forward's stage.

Hints (`layers_per_loop`, `loops`: the CLI's --layers-per-loop / --loops) keep only chains of that shape;
where no chain is found, they split the largest block of k = loops × layers_per_loop layers into loops (a
model whose loops run back to back, with no op between them, looks like a deeper plain transformer).

Limits. Kernel names (`names=`) match far more precisely than categories: with categories alone a per-loop
op can pass for the end of a layer and shift layer boundaries (the loop index stays right on our traces).
Successive forwards of a plain model with no recognisable sampling op between them look like loops: pass
one sequence per engine step where the trace has step annotations, else per forward (`forwards`). Where an
engine runs one loop per step (our engine's decode), the ops between two passes are the end of one step and
the start of the next (a state write and gate readback, then a state gather and metadata); the host pause
between the steps (`times=`) splits them, as `profile`'s loop ranges do; without times the tail wins.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from looptrace.probes import categories as cats
from looptrace.probes.context import NONE, Context

RECURRENT, PRELUDE, CODA, SAMPLE = "recurrent", "prelude", "coda", "sample"
PREFILL_STAGE = "prefill"  # a prefill forward's stage: the name of looptrace's prefill step
_INDEX_RE = re.compile(r"(\d+)$")
_SAMPLING_NAME_RE = re.compile(r"argmax|multinomial|sampl|top_p|top_k_")

Span = tuple[int, int]  # [start, end) of op positions in one step


@dataclass
class LoopStructure:
    """What `detect_loops` found: the steps' contexts (changed only where loops were found) and how."""

    steps: list[list[Context]]
    how: str | None = None  # e.g. "repeated op pattern: 4 layers × 8 loops (...)"; None: no loops found
    loops: int | None = None  # most common loops per chain of recurrent passes
    layers_per_loop: int | None = None
    chains: int = 0  # chains of recurrent passes (one per forward of the looped block)
    sources: list[str] = field(default_factory=list)  # how each chain was found

    @property
    def found(self) -> bool:
        return self.chains > 0


@dataclass
class _Block:
    """Consecutive layer passes; `whole` = its edge layers are complete copies of the layer period."""

    layers: list[Span]
    whole: bool = True

    @property
    def start(self) -> int:
        return self.layers[0][0]

    @property
    def end(self) -> int:
        return self.layers[-1][1]


@dataclass
class _Chain:
    blocks: list[_Block]
    head: int  # ops of each gap that open the next pass
    tail: int  # ops of each gap that close the previous pass
    source: str
    # Each gap holds an engine-step boundary (`_split_at_step_boundary`): in a gap longer than the usual
    # one (a one-off op), the ops before the head close the previous pass.
    step_split: bool = False


def infer_loops(
    step_ops: Sequence[Sequence[Context]],
    *,
    names: Sequence[Sequence[str]] | None = None,
    layers_per_loop: int | None = None,
    loops: int | None = None,
    times: Sequence[Sequence[float]] | None = None,
) -> list[list[Context]]:
    """Each step's contexts with stage/loop/layer/role filled where a looped pattern is found (module
    docstring), unchanged elsewhere. `names`: the kernel (or op) names, same shape: finer than the
    categories in `Context.op` for matching repeats; `times`: as for `detect_loops`."""
    found = detect_loops(step_ops, names=names, layers_per_loop=layers_per_loop, loops=loops, times=times)
    return found.steps


def detect_loops(
    step_ops: Sequence[Sequence[Context]],
    *,
    names: Sequence[Sequence[str]] | None = None,
    layers_per_loop: int | None = None,
    loops: int | None = None,
    prefill: Sequence[bool] | None = None,
    times: Sequence[Sequence[float]] | None = None,
) -> LoopStructure:
    """`infer_loops`, plus a summary of the loop structure for the report. `prefill`: per step, whether it
    is a prefill forward: its ops get stage "prefill" (sampling stays "sample"), their loops and layers
    kept, as looptrace's ranges give a prefill step. `times`: per step, each op's host start time (a
    kernel's launch), which shows where an engine that runs one loop per step starts its next step."""
    for hint, flag in ((layers_per_loop, "layers_per_loop"), (loops, "loops")):
        if hint is not None and hint < 1:
            raise ValueError(f"{flag} must be >= 1")
    if names is not None and len(names) != len(step_ops):
        raise ValueError("names must have one sequence per step")
    if prefill is not None and len(prefill) != len(step_ops):
        raise ValueError("prefill must have one flag per step")
    if times is not None and [len(t) for t in times] != [len(c) for c in step_ops]:
        raise ValueError("times must have one host time per op of each step")
    found = []
    for s, ctxs in enumerate(step_ops):
        ctxs = list(ctxs)
        keys = _keys(ctxs, names[s] if names is not None else None)
        blocks, chains = _find_chains(ctxs, keys, layers_per_loop, loops)
        if times is not None:
            chains = [_split_at_step_boundary(ch, keys, times[s]) for ch in chains]
        found.append((ctxs, keys, blocks, chains))
    width = _dominant_width([ch for *_, chains in found for ch in chains])
    # One recurrent block per model: a repeat of another width is something else (e.g. Huginn's coda
    # layers, run once to fill the coda KV of the prompt and once more for its last position).
    found = [
        (c, k, b, [ch for ch in chains if len(ch.blocks[0].layers) == width]) for c, k, b, chains in found
    ]
    flags = list(prefill) if prefill is not None else [False] * len(found)
    coda = _decode_coda([(c, k, chains) for (c, k, _, chains), p in zip(found, flags) if not p])
    out = LoopStructure([])
    shapes: Counter[tuple[int, int]] = Counter()
    for step, (ctxs, keys, blocks, chains) in enumerate(found):
        phases = (flags[step], step + 1 < len(flags) and flags[step + 1])
        out.steps.append(_assign(ctxs, keys, blocks, chains, *phases, coda=coda) if chains else ctxs)
        for ch in chains:
            shapes[(width, len(ch.blocks))] += 1
            out.sources.append(ch.source)
    out.chains = sum(shapes.values())
    if out.chains:
        (out.layers_per_loop, out.loops), _ = shapes.most_common(1)[0]
        out.how = _describe(shapes, out.sources, len(step_ops))
    return out


# --- symbols ----------------------------------------------------------------------------------------------


def _keys(ctxs: list[Context], names: Sequence[str] | None) -> list[Hashable]:
    """What two ops must share to count as a repeat: the category, and the name where given."""
    if names is None:
        return [c.op for c in ctxs]
    if len(names) != len(ctxs):
        raise ValueError("names must match the step's contexts one to one")
    return [(c.op, n) for c, n in zip(ctxs, names)]


def _is_sampling(ctx: Context, key: Hashable) -> bool:
    if ctx.op == cats.SAMPLING:
        return True
    name = key[1] if isinstance(key, tuple) else None
    return isinstance(name, str) and _SAMPLING_NAME_RE.search(name.lower()) is not None


def _prefix(keys: Sequence[Hashable], start: int, stop: int, pattern: Sequence[Hashable]) -> int:
    """How many of keys[start:stop] match the start of `pattern`."""
    n = 0
    while n < len(pattern) and start + n < stop and keys[start + n] == pattern[n]:
        n += 1
    return n


def _suffix(keys: Sequence[Hashable], start: int, stop: int, pattern: Sequence[Hashable]) -> int:
    """How many of keys[start:stop], read backwards from stop, match the end of `pattern`."""
    n = 0
    while n < len(pattern) and stop - 1 - n >= start and keys[stop - 1 - n] == pattern[-1 - n]:
        n += 1
    return n


# --- 1. layer passes ------------------------------------------------------------------------------------


def _layer_index(ctx: Context) -> int | None:
    m = _INDEX_RE.search(ctx.layer) if ctx.layer else None
    return int(m.group(1)) if m else None


def _indexed_blocks(ctxs: list[Context]) -> list[_Block]:
    """Blocks from module-path layer indices (when at least half the ops carry one): a pass is a run of
    one index (ops without an index inside it included); an index other than previous + 1 opens a block."""
    index = [_layer_index(c) for c in ctxs]
    if 2 * sum(i is not None for i in index) < len(ctxs) or len({i for i in index if i is not None}) < 2:
        return []
    passes: list[list[int]] = []  # [index, start, end]
    for pos, i in enumerate(index):
        if i is None:
            continue
        if passes and passes[-1][0] == i:
            passes[-1][2] = pos + 1
        else:
            passes.append([i, pos, pos + 1])
    runs: list[list[list[int]]] = []
    for j, p in enumerate(passes):
        if j and p[0] == passes[j - 1][0] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [_Block([(start, end) for _, start, end in run]) for run in _split_runs(runs)]


def _split_runs(runs: list[list[list[int]]]) -> list[list[list[int]]]:
    """Cut each run where it enters or leaves the recurrent layers: the indices visited most often (once
    per loop; other layers once per forward). Kineto numbers module instances in call order, so Huginn's
    layers are prelude 0-1, core 2-5, coda 6-7, and the first and last core passes continue the prelude's
    and the coda's numbering: runs 0..5, 2..5 × (R-2), 2..7."""
    visits = Counter(p[0] for run in runs for p in run)
    top = max(visits.values())
    core = {i for i, n in visits.items() if n == top}
    if top < 2 or len(core) == len(visits):
        return runs
    out: list[list[list[int]]] = []
    for run in runs:
        cuts = [j for j in range(1, len(run)) if (run[j][0] in core) != (run[j - 1][0] in core)]
        out += [run[a:b] for a, b in zip([0, *cuts], [*cuts, len(run)])]
    return out


def _attention_calls(ctxs: list[Context]) -> list[int]:
    """Position of each attention call's first op; attention ops with no GEMM between are one call
    (e.g. a split-KV kernel and its combine kernel)."""
    calls: list[int] = []
    gemm_since = True
    for pos, c in enumerate(ctxs):
        if c.op == cats.ATTENTION:
            if gemm_since:
                calls.append(pos)
            gemm_since = False
        elif c.op == cats.GEMM:
            gemm_since = True
    return calls


def _anchored_blocks(ctxs: list[Context], keys: list[Hashable]) -> list[_Block]:
    """Blocks of layer passes anchored on attention calls (module docstring, step 1)."""
    calls = _attention_calls(ctxs)
    if len(calls) < 2:
        return []
    segments = [tuple(keys[a:b]) for a, b in zip(calls, calls[1:])]
    period = Counter(segments).most_common(1)[0][0]  # ties: the first seen
    groups: list[list[int]] = []
    for j, a in enumerate(calls):
        if j and segments[j - 1] == period:  # exact: a loop's gap can be a single op (vLLM Ouro's norm)
            groups[-1].append(a)
        else:
            groups.append([a])
    n = len(keys)
    lows = [0] + [g[-1] + 1 for g in groups[:-1]]  # the ops a group's first layer can reach back to
    highs = [g[0] for g in groups[1:]] + [n]
    heads = [min(_suffix(keys, lo, g[0], period), len(period) - 1) for g, lo in zip(groups, lows)]
    # Layer head: the shortest match over the blocks. Ops before a block that look like the end of a
    # layer lengthen it (a per-loop GEMM like an MLP's last one) but cannot shorten it; a block at the
    # very start of the sequence may be cut off, so it does not count when its whole prefix matched.
    # Blocks of one layer count only where no block has more: a lone layer (Huginn's coda layers in a
    # CPU trace, each after an op the others lack) can have a shorter head than the model's layers.
    counted = [h for k, h in enumerate(heads) if k or h < groups[0][0]] or heads
    multi = [h for k, h in enumerate(heads) if len(groups[k]) > 1 and (k or h < groups[0][0])]
    head = min(multi or counted)
    tail = len(period) - head
    blocks: list[_Block] = []
    prev_end = 0
    for g, h, hi in zip(groups, heads, highs):
        t = _prefix(keys, g[-1], hi, period)
        layers = [(a - head, b - head) for a, b in zip(g, g[1:])] + [(g[-1] - head, g[-1] + min(t, tail))]
        layers[0] = (max(g[0] - min(h, head), prev_end), layers[0][1])
        blocks.append(_Block(layers, whole=h >= head and t >= tail))
        prev_end = layers[-1][1]
    return blocks


# --- 2. chains of recurrent passes ------------------------------------------------------------------------


def _find_chains(
    ctxs: list[Context], keys: list[Hashable], layers_per_loop: int | None, loops: int | None
) -> tuple[list[_Block], list[_Chain]]:
    """The step's layer blocks, and the chains of recurrent passes among them: from module layer indices
    where they give a chain, else from the op pattern (indices that never repeat, e.g. one module per
    (loop, layer) numbered loop × L + layer, make one long block: the pattern still shows the loops)."""
    indexed = _indexed_blocks(ctxs)
    if indexed:
        blocks, chains = _chains_of(ctxs, keys, indexed, "module layer indices", layers_per_loop, loops)
        if chains:
            return blocks, chains
    return _chains_of(ctxs, keys, _anchored_blocks(ctxs, keys), "repeated op pattern", layers_per_loop, loops)


def _chains_of(
    ctxs: list[Context],
    keys: list[Hashable],
    blocks: list[_Block],
    source: str,
    layers_per_loop: int | None,
    loops: int | None,
) -> tuple[list[_Block], list[_Chain]]:
    chains: list[_Chain] = []
    candidates = 0
    i = 0
    while i < len(blocks):
        j = _chain_end(ctxs, keys, blocks, i)
        run = blocks[i : j + 1]
        shape_ok = (layers_per_loop is None or len(run[0].layers) == layers_per_loop) and (
            loops is None or len(run) == loops
        )
        if j > i and all(b.whole for b in run):
            candidates += 1
            if shape_ok:
                chains.append(_split_gaps(keys, blocks, i, j, source))
            i = j + 1
        else:
            i += 1
    if not candidates and (layers_per_loop or loops):  # loops back to back: only a hint can split them
        split = _split_block(blocks, layers_per_loop, loops)
        if split is not None:
            chains.append(split)
    return blocks, chains


def _dominant_width(chains: list[_Chain]) -> int | None:
    """Layers per pass of the chains that cover the most ops."""
    ops: Counter[int] = Counter()
    for ch in chains:
        ops[len(ch.blocks[0].layers)] += ch.blocks[-1].end - ch.blocks[0].start
    return max(ops.items(), key=lambda kv: (kv[1], kv[0]))[0] if ops else None


def _similar(a: Sequence[Hashable], b: Sequence[Hashable]) -> bool:
    """Equal, or equal but for a few ops inserted at one place (a one-off op such as a first-use
    allocation: our engine's first recurrent step zeroes a buffer once): a common prefix and suffix cover
    the shorter, and the longer has at most max(2, a tenth) more ops."""
    if a == b:
        return True
    short, long = (a, b) if len(a) <= len(b) else (b, a)
    if not 0 < len(long) - len(short) <= max(2, len(short) // 10):
        return False
    p = _prefix(long, 0, len(long), short)
    return p + _suffix(long, p, len(long), short[p:]) >= len(short)


def _content(keys: list[Hashable], b: _Block) -> tuple:
    return tuple(keys[b.start : b.end])


def _gap(keys: list[Hashable], blocks: list[_Block], j: int) -> tuple:
    return tuple(keys[blocks[j].end : blocks[j + 1].start])


def _chain_end(ctxs: list[Context], keys: list[Hashable], blocks: list[_Block], i: int) -> int:
    """Last block j such that blocks i..j have the same ops and the same non-sampling gaps (both up to a
    one-off op, `_similar`)."""
    first = _content(keys, blocks[i])
    gap = None
    j = i
    width = len(blocks[i].layers)
    while j + 1 < len(blocks) and len(blocks[j + 1].layers) == width:
        if not _similar(_content(keys, blocks[j + 1]), first):
            break
        g = _gap(keys, blocks, j)
        sampled = any(_is_sampling(ctxs[p], keys[p]) for p in range(blocks[j].end, blocks[j + 1].start))
        if sampled or (gap is not None and not _similar(g, gap)):
            break
        gap, j = (g if gap is None else gap), j + 1
    return j


def _split_gaps(keys: list[Hashable], blocks: list[_Block], i: int, j: int, source: str) -> _Chain:
    """Tail / head lengths of the chain's gaps (the most common one) from what precedes its first pass and
    follows its last."""
    first, last = blocks[i], blocks[j]
    gap = Counter(_gap(keys, blocks, k) for k in range(i, j)).most_common(1)[0][0]
    lo = blocks[i - 1].end if i else 0
    hi = blocks[j + 1].start if j + 1 < len(blocks) else len(keys)
    tail = _prefix(keys, last.end, hi, gap)
    head = min(_suffix(keys, lo, first.start, gap), len(gap) - tail)
    return _Chain(blocks[i : j + 1], head, tail, source)


# An engine step boundary is a host pause this many times the chain's typical time per op.
STEP_PAUSE_FACTOR = 8.0


def _split_at_step_boundary(ch: _Chain, keys: list[Hashable], times: Sequence[float]) -> _Chain:
    """Where every gap of the chain holds an engine-step boundary (our engine, or any engine that runs one
    loop per step: the host pauses between two steps to schedule the next), the boundary splits the gap:
    the ops before it close the previous pass (its state write, its gate read back), those after it open
    the next (its state gather, its metadata). Between two passes the op pattern alone cannot tell (a
    gather after the last pass opens the coda step, a state write before the first pass ends the
    prelude's). The boundary: the same place in most gaps, among the splits the passes at the chain's ends
    allow (the ops a head takes must also open the first pass, a tail's also close the last), with a
    median pause at least STEP_PAUSE_FACTOR times the chain's median time per op; else the chain stays."""
    first, last = ch.blocks[0], ch.blocks[-1]
    gaps = [(a.end, b.start) for a, b in zip(ch.blocks, ch.blocks[1:])]
    usual = Counter(tuple(keys[a:b]) for a, b in gaps).most_common(1)[0][0]
    n = len(usual)
    if n == 0 or len(gaps) < 2:
        return ch
    lo_end = first.start - n  # the chain's first pass can reach back this far for its head
    allowed = [
        k
        for k in range(n + 1)
        if _suffix(keys, max(lo_end, 0), first.start, usual[k:]) == n - k
        and _prefix(keys, last.end, len(keys), usual[:k]) == k
    ]
    if not allowed:
        return ch
    same = [a for a, b in gaps if tuple(keys[a:b]) == usual]
    pauses = {k: sorted(times[a + k] - times[a + k - 1] for a in same) for k in allowed}
    best = max(allowed, key=lambda k: pauses[k][len(same) // 2])
    votes = sum(max(allowed, key=lambda k: times[a + k] - times[a + k - 1]) == best for a in same)
    span = [times[i + 1] - times[i] for i in range(first.start, last.end - 1)]
    typical = sorted(span)[len(span) // 2] if span else 0.0
    if 3 * votes < 2 * len(same) or pauses[best][len(same) // 2] < STEP_PAUSE_FACTOR * max(typical, 1e-9):
        return ch
    return dataclasses.replace(ch, head=n - best, tail=best, step_split=True)


def _split_block(blocks: list[_Block], layers_per_loop: int | None, loops: int | None) -> _Chain | None:
    """With a hint and no chain: the largest block whose layers divide into loops, as back-to-back passes."""
    for b in sorted(blocks, key=lambda b: -len(b.layers)):
        k = len(b.layers)
        per = layers_per_loop or (k // loops if loops else 0)
        if per < 1 or k % per or k // per < 2 or (loops is not None and k // per != loops):
            continue
        parts = [_Block(b.layers[r * per : (r + 1) * per]) for r in range(k // per)]
        hint = ", ".join(
            f"--{flag} {v}" for flag, v in (("layers-per-loop", layers_per_loop), ("loops", loops)) if v
        )
        return _Chain(parts, 0, 0, f"hint {hint}")
    return None


# --- 3-4. contexts ------------------------------------------------------------------------------------------


def _last_pass_end(ch: _Chain, n: int) -> int:
    """Where the chain's last pass ends, its tail included."""
    return min(ch.blocks[-1].end + ch.tail, n)


def _decode_coda(steps: list[tuple[list[Context], list[Hashable], list[_Chain]]]) -> tuple | None:
    """The ops a decode forward runs from its last loop to its sampling op (the coda: its state gather,
    coda layers, final norm, lm-head), the most common over the decode forwards; None without one."""
    seen: Counter[tuple] = Counter()
    for ctxs, keys, chains in steps:
        if not chains:
            continue
        end = _last_pass_end(chains[-1], len(keys))
        sample = next((p for p in range(end, len(keys)) if _is_sampling(ctxs[p], keys[p])), None)
        if sample is not None:
            seen[tuple(keys[end:sample])] += 1
    return seen.most_common(1)[0][0] if seen else None


def _assign(
    ctxs: list[Context],
    keys: list[Hashable],
    blocks: list[_Block],
    chains: list[_Chain],
    prefill: bool = False,
    next_prefill: bool = False,
    coda: tuple | None = None,
) -> list[Context]:
    """New contexts: loop passes, layers and stages of every op of a step with loops. A prefill forward
    computes its prelude and loops as stage prefill (the coda and sampling keep theirs); the prelude ops
    after the last sampling prepare the next forward and take its stage. `coda`: the decode forwards'
    coda ops (`_decode_coda`): where a prefill forward ends with the same ops before its sampling, they
    are its coda and all before them (the coda layers over every prompt row, the hand-off of the state)
    is prefill."""
    n = len(ctxs)
    stage: list[str] = [NONE] * n
    loop: list[int | None] = [None] * n
    layer: list[str | None] = [None] * n
    spans: list[Span] = []  # each chain's [first head, last tail)
    prev_end = 0
    for c, ch in enumerate(chains):
        nxt = chains[c + 1].blocks[0].start if c + 1 < len(chains) else n
        start = max(ch.blocks[0].start - ch.head, prev_end)
        end = min(_last_pass_end(ch, n), nxt)
        last = len(ch.blocks) - 1
        stage[start:end] = [RECURRENT] * (end - start)  # ops between loops (neither tail nor head) too
        hi = start
        for r, b in enumerate(ch.blocks):
            lo = max(b.start - ch.head, hi) if r else start  # a shorter gap than the usual: tail first
            if r == last:
                hi = end
            elif ch.step_split:
                hi = max(ch.blocks[r + 1].start - ch.head, b.end)
            else:
                hi = min(b.end + ch.tail, ch.blocks[r + 1].start)
            loop[lo:hi] = [r] * (hi - lo)
            for j, (s, e) in enumerate(b.layers):
                layer[s:e] = [f"core{j}"] * (e - s)
        spans.append((start, end))
        prev_end = end
    repeats = _outside(ctxs, keys, spans, stage, layer, blocks)
    # A prefill computes every prompt row up to its last coda pass (which may run for the last row only).
    coda_from = max([p for p in repeats if p >= spans[-1][1]], default=spans[-1][1])
    last_sample = max((p for p in range(spans[-1][1], n) if stage[p] == SAMPLE), default=None)
    if prefill and coda and last_sample is not None:
        first_sample = min(p for p in range(spans[-1][1], last_sample + 1) if stage[p] == SAMPLE)
        lead = first_sample - len(coda)
        if lead >= spans[-1][1] and tuple(keys[lead:first_sample]) == coda:
            coda_from = lead
    for p in range(n):
        if last_sample is not None and p > last_sample:
            if next_prefill and stage[p] == PRELUDE:
                stage[p] = PREFILL_STAGE
        elif prefill and (stage[p] in (PRELUDE, RECURRENT) or (stage[p] == CODA and p < coda_from)):
            stage[p] = PREFILL_STAGE
    roles = {name: _role(name) for name in set(layer)}
    shared: dict[tuple, Context] = {}  # frozen: equal results can be one object (replace costs µs per op)
    out = []
    for p, c in enumerate(ctxs):
        key = (c, stage[p], loop[p], layer[p]) if c.op_range is None else None  # op ranges: unhashable
        new = shared.get(key) if key is not None else None
        if new is None:
            new = dataclasses.replace(c, stage=stage[p], loop=loop[p], layer=layer[p], role=roles[layer[p]])
            if key is not None:
                shared[key] = new
        out.append(new)
    return out


def _role(layer: str | None) -> str:
    return (layer.rstrip("0123456789") or NONE) if layer else NONE


def _outside(
    ctxs: list[Context],
    keys: list[Hashable],
    spans: list[Span],
    stage: list[str],
    layer: list[str | None],
    blocks: list[_Block],
) -> list[int]:
    """Prelude / coda (and sample) stages, and prelude<i> / coda<i> layers, around the chains (the blocks
    inside each region: chain blocks lie in the chains' spans). Returns where the ops that lead to a repeat of
    a region's first block start (a prefill's coda layers run once for every prompt row, then once more for
    the last row)."""
    n = len(ctxs)
    edges = [0] + [e for _, e in spans]
    starts = [s for s, _ in spans] + [n]
    regions: list[tuple[int, int, str]] = []
    for k, (lo, hi) in enumerate(zip(edges, starts)):
        if k == 0:
            regions.append((lo, hi, PRELUDE))
            continue
        # After a chain: coda up to the last sampling op, then prelude (what follows the sampling prepares
        # the next forward: its positions, its inputs), also after the sequence's last chain.
        sampled = [p for p in range(lo, hi) if _is_sampling(ctxs[p], keys[p])]
        cut = sampled[-1] + 1 if sampled else hi
        regions += [(lo, cut, CODA), (cut, hi, PRELUDE)]
    repeats: list[int] = []  # where a repeat of a region's first block starts, with the ops leading to it
    k = 0  # blocks and regions are both in sequence order: one sweep
    for lo, hi, name in regions:
        for p in range(lo, hi):
            stage[p] = SAMPLE if name == CODA and _is_sampling(ctxs[p], keys[p]) else name
        while k < len(blocks) and blocks[k].start < lo:
            k += 1
        first, index = None, 0
        while k < len(blocks) and blocks[k].end <= hi:
            # Layers are numbered on across the region's blocks (its layers need not run as one block);
            # a repeat of the region's first block is a repeated pass: coda0.. again.
            content = _content(keys, blocks[k])
            if first is None:
                first, lead_in = content, keys[lo : blocks[k].start]
            elif content == first and len(blocks[k].layers) > 1:
                index = 0
                # the repeat starts with the ops that led into the first block (e.g. the coda's inputs)
                repeats.append(blocks[k].start - _suffix(keys, blocks[k - 1].end, blocks[k].start, lead_in))
            for s, e in blocks[k].layers:
                layer[s:e] = [f"{name}{index}"] * (e - s)
                index += 1
            k += 1
    return repeats


def _describe(shapes: Counter[tuple[int, int]], sources: list[str], steps: int) -> str:
    """One line for the report, e.g. "repeated op pattern: 4 layers × 8 loops (16 chains of passes in 2
    steps)"."""
    source = ", ".join(sorted(set(sources)))
    layer_counts = sorted({k for k, _ in shapes})
    loop_counts = sorted({r for _, r in shapes})
    ks = _range_text(layer_counts)
    rs = _range_text(loop_counts)
    total = sum(shapes.values())
    chains = f"{total} chain{'s' if total != 1 else ''} of passes in {steps} step{'s' if steps != 1 else ''}"
    return f"{source}: {ks} layers × {rs} loops ({chains})"


def _range_text(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"
