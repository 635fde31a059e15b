"""Roofline rows for `looptrace profile`: how far each op × layer-role row of our engine is from its floor.

Our kernels are mostly Triton and cuBLAS launched inside CUDA-graph replays, so recorded ATen shapes
cannot price them. The engine knows the shapes instead: each op module's weights, the model's heads and
dimensions, the rows a decode step carries and the KV length they attend over. Per call of an op module
the floor traffic is its weights, its input and output rows once and, for paged attention, the K/V of the
row's context; FLOPs are 2 per multiply-add of its GEMMs (and QK^T, PV). Calls per token come from the
trace: the lt.op ranges of the window (eager steps) plus, for graph replays, the ranges of the replayed
graph's eager body run times its replays. The measured time of a row is its kernels' device time from the
profile (`breakdown.by_op_role`). `roofline.achieved` turns both into achieved TB/s and % of roofline.
"""

from __future__ import annotations

import bisect
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.table import Table

from looptrace.probes import counters as names
from looptrace.probes.events import Trace, TraceEvent
from looptrace.probes.ring_clock import TAIL, RingAnatomy
from looptrace.probes.roofline import DevicePeak, OpCost, achieved, device_for, floor_us

# Op kinds the model prices; the rest (sampling, metadata, readback, ...) show "n/a".
ANY_ROLE = "*"  # mean_call_costs key: the op's mean cost over all roles
PRICED = (
    "norm", "rope", "attention", "paged_attention", "mlp", "gate", "adapter", "embed", "head",
    "persistent_loop",
)  # fmt: skip


@dataclass(frozen=True)
class Shapes:
    """What one decode call sees: rows per call, mean KV length per row, element sizes."""

    rows: float
    context: float
    act_bytes: int
    kv_bytes: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int


@dataclass
class RooflineRow:
    op: str
    role: str
    calls_per_token: float
    gpu_us_per_token: float | None  # None: the row's kernels were not attributed (graph replay)
    us_per_call: float | None
    bytes_per_call: float | None
    flops_per_call: float | None
    floor_us_per_call: float | None
    achieved_tbps: float | None
    achieved_tflops: float | None
    pct_of_peak: float | None
    bound: str | None


# --- per-call costs ----------------------------------------------------------------------------------


def _own_params(module: Any) -> list[Any]:
    """Parameters of `module` that no nested op module owns (those are priced as their own rows)."""
    nested = {
        id(p)
        for _, m in module.named_modules()
        if m is not module and hasattr(m, "op_kind")
        for p in m.parameters()
    }
    return [p for p in module.parameters() if id(p) not in nested]


def _bytes(params: Iterable[Any]) -> float:
    return float(sum(p.numel() * p.element_size() for p in params))


def _matrix_elems(params: Iterable[Any]) -> float:
    return float(sum(p.numel() for p in params if p.dim() == 2))


def call_cost(kind: str, module: Any, s: Shapes) -> OpCost | None:
    """Floor bytes and FLOPs of one call of an op module at `s` (None: kind not priced)."""
    own = _own_params(module)
    w, mats, r, a = _bytes(own), _matrix_elems(own), s.rows, s.act_bytes
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    if kind in ("attention", "mlp", "gate", "adapter", "head"):
        io = {  # activation elements per row read or written once
            "attention": s.hidden + (q + 2 * kv) + q + s.hidden,  # x in; q, k, v out; attention out in; out
            "mlp": 2 * s.hidden,  # x in, out (a fused floor: the intermediate stays on chip)
            "gate": s.hidden + 1,
            "adapter": 3 * s.hidden,  # [state | injection] in, out
            "head": s.hidden + mats / s.hidden,  # hidden in, logits (vocab wide) out
        }[kind]
        return OpCost(flops=2.0 * r * mats, bytes=w + r * io * a)
    if kind == "norm":
        dim = float(sum(p.numel() for p in own)) or s.hidden
        return OpCost(flops=4.0 * r * dim, bytes=w + 2 * r * dim * a)
    if kind == "rope":
        return OpCost(flops=3.0 * r * (q + kv), bytes=r * (2 * (q + kv) + s.head_dim) * a)
    if kind == "paged_attention":
        keys = r * s.context  # every row reads its own context's K and V
        flops = 4.0 * s.num_heads * s.head_dim * keys  # QK^T and PV
        nbytes = r * 2 * q * a + r * 2 * kv * s.kv_bytes + keys * 2 * kv * s.kv_bytes
        return OpCost(flops=flops, bytes=nbytes)
    if kind == "embed":
        return OpCost(flops=0.0, bytes=r * (2 * s.hidden * a + 8))
    if kind == "persistent_loop":  # a whole loop: every layer's weights once, each layer's K/V per row
        stages = loop_stage_costs(module, s).values()
        return OpCost(flops=sum(c.flops for c in stages), bytes=sum(c.bytes for c in stages))
    return None


def loop_stage_costs(module: Any, s: Shapes) -> dict[str, OpCost]:
    """One persistent-loop call's floor, stage by stage (`ring_clock.anatomy`'s stages, then the tail):
    each GEMV stage its weights of every layer, attention each layer's K/V per row; the tail the norms'
    weights (a few hundred KB) and the state in and out (what else the stages hand over stays in L2)."""
    qkv, o, gate_up, down, *norms = module.weight_tensors()
    layers = qkv.shape[0]
    attention = call_cost("paged_attention", module, s)

    def gemv(w) -> OpCost:
        return OpCost(flops=2.0 * s.rows * w.numel(), bytes=_bytes([w]))

    return {
        "qkv": gemv(qkv),
        "attention": OpCost(flops=layers * attention.flops, bytes=layers * attention.bytes),
        "o": gemv(o),
        "gate_up": gemv(gate_up),
        "down": gemv(down),
        TAIL: OpCost(flops=0.0, bytes=_bytes(norms) + s.rows * 2 * s.hidden * s.act_bytes),
    }


def _layer_role(name: str, layers: dict[str, str]) -> str:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        role = layers.get(".".join(parts[:i]))
        if role is not None:
            return role
    return names.NONE


def mean_call_costs(engine: Any, s: Shapes) -> dict[tuple[str, str], OpCost]:
    """(op kind, layer role) -> mean per-call cost over the engine's modules of that kind and role."""
    mods = list(engine.observable_modules())
    layers = {n: m.layer_role for n, m in mods if getattr(m, "op_kind", None) == "layer"}
    acc: dict[tuple[str, str], list[OpCost]] = defaultdict(list)
    for name, module in mods:
        kind = getattr(module, "op_kind", None)
        if kind in PRICED:
            cost = call_cost(kind, module, s)
            if cost is not None:
                acc[(kind, _layer_role(name, layers))].append(cost)
    # a module shared by every layer (Ouro's rotary) sits outside them: its cost stands for any role
    for (kind, _), v in list(acc.items()):
        acc.setdefault((kind, ANY_ROLE), []).extend(v)
    return {
        k: OpCost(sum(c.flops for c in v) / len(v), sum(c.bytes for c in v) / len(v)) for k, v in acc.items()
    }


# --- calls per token from the trace ------------------------------------------------------------------


_LAYER_ROLE = re.compile(r"^([A-Za-z_]*?)\d+$")


def _role_at(t: float, layers: list[TraceEvent], starts: list[float]) -> str:
    """Role of the lt.layer range running at `t` (layer ranges do not nest), else "-"."""
    i = bisect.bisect_right(starts, t) - 1
    if i < 0 or layers[i].end <= t:
        return names.NONE
    m = _LAYER_ROLE.match(layers[i].name[len(names.LAYER_PREFIX) :])
    return (m.group(1) or names.NONE) if m else names.NONE


def _count_ops(ops: list[TraceEvent], lo: float, hi: float, layers, starts) -> Counter[tuple[str, str]]:
    out: Counter[tuple[str, str]] = Counter()
    for e in ops:
        if lo <= e.ts < hi:
            out[(e.name[len(names.OP_PREFIX) :], _role_at(e.ts, layers, starts))] += 1
    return out


def calls_per_token(trace: Trace, window: dict[str, Any], rows: float) -> dict[tuple[str, str], float]:
    """lt.op range instances per output token: eager ranges inside lt.window/decode, plus for each graph
    cache that replayed in the window its replays × the op ranges of one eager run of its body (the body
    of the smallest captured batch that holds `rows`)."""
    # Host-side ranges only: Kineto repeats each range on the GPU stream's row (`gpu_user_annotation`),
    # which doubled every count on the H200.
    ann = sorted(
        (e for e in trace.events if e.cat == names.ANNOTATION_CAT and e.name.startswith(names.PREFIX)),
        key=lambda e: (e.ts, -e.dur),
    )
    ops = [e for e in ann if e.name.startswith(names.OP_PREFIX)]
    layers = [e for e in ann if e.name.startswith(names.LAYER_PREFIX)]
    starts = [e.ts for e in layers]
    total: Counter[tuple[str, str]] = Counter()
    for w in (e for e in ann if e.name == names.WINDOW_DECODE):
        total.update(_count_ops(ops, w.ts, w.end, layers, starts))
    bodies: dict[str, list[tuple[int, TraceEvent]]] = defaultdict(list)
    for e in ann:
        if e.name.startswith(names.GRAPH_BODY_PREFIX):
            graph, _, n = e.name[len(names.GRAPH_BODY_PREFIX) :].rpartition("/")
            if n.isdigit():
                bodies[graph].append((int(n), e))
    for graph, counts in (window.get("graph") or {}).items():
        replays = counts.get("replays", 0)
        if not replays or not bodies.get(graph):
            continue
        # Sort on the batch size alone: a graph's body can run eagerly more than once (same size).
        by_size = sorted(bodies[graph], key=lambda b: b[0])
        fits = [b for b in by_size if b[0] >= rows] or by_size[-1:]
        body = fits[0][1]
        for key, n in _count_ops(ops, body.ts, body.end, layers, starts).items():
            total[key] += replays * n
    tokens = window.get("tokens") or 1
    return {k: v / tokens for k, v in total.items()}


# --- rows --------------------------------------------------------------------------------------------


def rows_per_call(window: dict[str, Any]) -> float:
    """Rows one decode call carries: output tokens per token-finishing (coda) step."""
    stages = window.get("steps_by_stage") or {}
    steps = stages.get("coda") or window.get("steps") or 1
    return max(1.0, (window.get("tokens") or 1) / steps)


def shapes_of(engine: Any, window: dict[str, Any]) -> Shapes:
    # deferred: torch loads with the engine, not with this module
    import torch

    spec = engine.spec
    act = torch.empty((), dtype=engine.dtype).element_size()
    context = window.get("context_tokens") or 0.0
    return Shapes(
        rows_per_call(window),
        float(context),
        act,
        act,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.hidden_size,
    )


def _row(
    key: tuple[str, str], us_tok: float | None, cpt: float, cost: OpCost | None, device, dtype
) -> RooflineRow:
    us_call = us_tok / cpt if cpt and us_tok is not None else None
    if cost is None:
        return RooflineRow(*key, cpt, us_tok, us_call, None, None, None, None, None, None, None)
    floor = floor_us(cost, device, dtype) if device else None
    if us_call is None:  # no measured time for the row (replayed kernels not attributed): floor only
        return RooflineRow(
            *key,
            cpt,
            us_tok,
            None,
            cost.bytes,
            cost.flops,
            floor and floor[0],
            None,
            None,
            None,
            floor and floor[1],
        )
    a = achieved(cost, us_call, device, dtype)
    return RooflineRow(
        *key,
        cpt,
        us_tok,
        us_call,
        cost.bytes,
        cost.flops,
        a.floor_us,
        a.achieved_tbps,
        a.achieved_tflops,
        a.pct_of_peak,
        a.bound,
    )


def roofline_rows(
    by_op_role: Iterable[tuple[str, str, float]],
    costs: dict[tuple[str, str], OpCost],
    calls: dict[tuple[str, str], float],
    tokens: int,
    device: DevicePeak | None,
    dtype: str | None,
) -> list[RooflineRow]:
    """One row per (op, role, device µs in the window) of the profile, measured against the priced floor;
    then the priced ops that ran (they have calls) but got no kernel time of their own (kernels of a graph
    replay the trace could not attribute): their floor alone."""
    out, seen = [], set()
    for op, role, gpu_us in by_op_role:
        key = (op, role)
        seen.add(key)
        cost = costs.get(key) or costs.get((op, ANY_ROLE))
        out.append(_row(key, gpu_us / max(tokens, 1), calls.get(key, 0.0), cost, device, dtype))
    for key, cpt in sorted(calls.items()):
        cost = costs.get(key) or costs.get((key[0], ANY_ROLE))
        if key not in seen and cost is not None:
            out.append(_row(key, None, cpt, cost, device, dtype))
    return out


def window_ring(rows: list[RooflineRow], ring: Sequence[RingAnatomy]) -> Sequence[RingAnatomy]:
    """The clocked launches that describe this window: none where its rows hold no persistent loop. The
    clocks time every captured body that takes the ring, and a body captured outside the window may (at 8
    rows the ring takes no loop, but a one-row body captured at warm-up does)."""
    return ring if any(r.op == "persistent_loop" for r in rows) else ()


def split_loop_rows(
    rows: list[RooflineRow],
    shares: dict[str, float],
    stage_costs: dict[str, OpCost],
    device: DevicePeak | None,
    dtype: str | None,
) -> list[RooflineRow]:
    """The persistent-loop row becomes one row per stage (`persistent_loop.qkv`, ...): the loop's measured
    time split by the stages' `shares` of its timed launches (`RingAnatomy.shares`), each against its own
    floor (`loop_stage_costs`). The stage rows add up to the loop's row: time, bytes and FLOPs."""
    out = []
    for r in rows:
        if r.op != "persistent_loop":
            out.append(r)
            continue
        for stage, share in shares.items():
            us = None if r.gpu_us_per_token is None else r.gpu_us_per_token * share
            key = (f"{r.op}.{stage}", r.role)
            out.append(_row(key, us, r.calls_per_token, stage_costs[stage], device, dtype))
    return out


def token_total(
    rows: list[RooflineRow], gpu_us_per_token: float, device: DevicePeak | None
) -> dict[str, Any]:
    """All priced ops of a token together: their summed floor against the window's device time per token
    (unpriced ops add time but no floor, so the share is a lower bound on how close the token is)."""
    priced = [r for r in rows if r.bytes_per_call is not None]
    nbytes = sum(r.bytes_per_call * r.calls_per_token for r in priced)
    flops = sum((r.flops_per_call or 0.0) * r.calls_per_token for r in priced)
    floor = sum((r.floor_us_per_call or 0.0) * r.calls_per_token for r in priced) if device else None
    pct = 100.0 * floor / gpu_us_per_token if floor is not None and gpu_us_per_token > 0 else None
    tbps = nbytes / gpu_us_per_token / 1e6 if gpu_us_per_token > 0 else None
    return {
        "bytes_per_token": nbytes,
        "flops_per_token": flops,
        "floor_us_per_token": floor,
        "gpu_us_per_token": gpu_us_per_token,
        "achieved_tbps": tbps,
        "pct_of_peak": pct,
    }


def _dtype_name(engine: Any) -> str | None:
    # deferred: torch loads with the engine, not with this module
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(engine.dtype)


def decode_roofline(
    engine: Any,
    trace: Trace,
    window: dict[str, Any],
    analysis: Any,
    device: DevicePeak | None,
    ring: Sequence[RingAnatomy] = (),
) -> dict[str, Any]:
    """The `roofline` block of a profile's decode window (JSON-ready); `ring`: the clocked stages of the
    persistent loop's launch (`ring_clock.measure`), which split its row by stage."""
    s = shapes_of(engine, window)
    groups = [(str(g.key[0]), str(g.key[1]), g.gpu_us) for g in analysis.breakdown.by_op_role]
    dtype = _dtype_name(engine)
    rows = roofline_rows(
        groups,
        mean_call_costs(engine, s),
        calls_per_token(trace, window, s.rows),
        int(window.get("tokens") or 1),
        device,
        dtype,
    )
    ring = window_ring(rows, ring)
    if ring:  # one loop op per engine (the model's `persistent`)
        loop = dict(engine.observable_modules())[ring[0].op]
        rows = split_loop_rows(rows, ring[0].shares(), loop_stage_costs(loop, s), device, dtype)
    tokens = int(window.get("tokens") or 1)
    return {
        "device": device.to_dict() if device else None,
        "dtype": dtype,
        "rows_per_call": s.rows,
        "context_tokens": s.context,
        "rows": [asdict(r) for r in rows],
        "token": token_total(rows, analysis.counters.gpu_us / tokens, device),
        "ring_clock": [a.to_dict() for a in ring],
        "notes": [
            "floor per call: weights, input and output rows once, paged attention's K/V of each row's "
            "context; FLOPs 2 per multiply-add; calls per token from the lt.op ranges (graph replays via "
            "their eager body run)",
            *([] if device else ["device peaks unknown (CPU or unrecognised GPU): % of roofline is n/a"]),
            *(
                [
                    "persistent_loop.<stage>: the loop's measured time split by its stages' shares of "
                    f"{ring[0].launches} timed eager launches (every program's clock at each stage's end)"
                ]
                if ring
                else []
            ),
        ],
    }


def _device(trace: Trace, engine: Any, override: str | None) -> DevicePeak | None:
    """The trace's deviceProperties (Kineto writes them on CUDA), else torch's name of the engine's GPU."""
    found = device_for(trace.device_properties, override)
    if found is None and engine.device.type == "cuda":
        # deferred: torch loads with the engine, not with this module
        import torch

        props = torch.cuda.get_device_properties(engine.device)
        found = device_for([{"name": props.name, "totalGlobalMem": props.total_memory}])
    return found


def profile_roofline(engine: Any, result: Any, override: str | None = None) -> dict[str, Any] | None:
    """Roofline block for a `ProfileResult`'s decode window (None when the window did not finish)."""
    if "decode" not in result.windows:
        return None
    window = vars(result.windows["decode"])
    device = _device(result.trace, engine, override)
    try:
        analysis = result.analyses["decode"]
        return decode_roofline(engine, result.trace, window, analysis, device, result.ring_clock)
    except Exception as exc:  # noqa: BLE001 - a pricing bug must not cost the measured report
        print(f"warning: roofline rows not computed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def roofline_table(block: dict[str, Any], title: str = "Decode roofline per op") -> Any:
    dev = block.get("device")
    where = f"{dev['name']}: {dev['peak_tbps']} TB/s" if dev else "device peaks n/a"
    rows_ctx = f"{block['rows_per_call']:.0f} rows/call, KV {block['context_tokens']:.0f} tokens/row"
    t = Table(title=f"{title} ({where}; {rows_ctx})", title_justify="left")
    for col in (
        "op",
        "role",
        "calls/tok",
        "µs/tok",
        "µs/call",
        "MB/call",
        "GFLOP/call",
        "floor µs",
        "TB/s",
        "% of roofline",
        "bound",
    ):
        t.add_column(col, justify="left" if col in ("op", "role", "bound") else "right")
    for r in block["rows"]:
        mb = None if r["bytes_per_call"] is None else r["bytes_per_call"] / 1e6
        gf = None if r["flops_per_call"] is None else r["flops_per_call"] / 1e9
        t.add_row(
            r["op"],
            r["role"],
            f"{r['calls_per_token']:.1f}",
            _fmt(r["gpu_us_per_token"], ",.1f"),
            _fmt(r["us_per_call"], ",.2f"),
            _fmt(mb, ".3g"),
            _fmt(gf, ".3g"),
            _fmt(r["floor_us_per_call"], ".3g"),
            _fmt(r["achieved_tbps"], ".3g"),
            _fmt(r["pct_of_peak"], ".1f"),
            r["bound"] or "n/a",
        )
    tok = block.get("token")
    if tok:  # the same columns for the whole token: MB, GFLOP and floor µs per token, not per call
        t.add_section()
        t.add_row(
            "token: all priced ops",
            "",
            "",
            _fmt(tok["gpu_us_per_token"], ",.1f"),
            "",
            _fmt(tok["bytes_per_token"] / 1e6, ".4g"),
            _fmt(tok["flops_per_token"] / 1e9, ".4g"),
            _fmt(tok["floor_us_per_token"], ",.1f"),
            _fmt(tok["achieved_tbps"], ".3g"),
            _fmt(tok["pct_of_peak"], ".1f"),
            "",
        )
    return t


def ring_clock_table(anatomy: dict[str, Any]) -> Any:
    """`ring_clock` of a roofline block: the persistent loop's stages per layer from the programs' clocks."""
    t = Table(
        title=(
            f"Inside {anatomy['op']}: stages per layer, medians of {anatomy['launches']} timed launches "
            f"({anatomy['programs']} programs, {anatomy['layers']} layers, {anatomy['loop_us']:,.1f} µs each)"
        ),
        title_justify="left",
    )
    for col in ("stage", "wall µs", "share", "work mean µs", "work max µs", "wait mean µs", "release µs"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    shares = anatomy["shares"]
    for st in anatomy["stages"]:
        t.add_row(
            st["stage"],
            f"{st['wall_us']:.2f}",
            f"{100 * shares[st['stage']]:.1f} %",
            f"{st['work_mean_us']:.2f}",
            f"{st['work_max_us']:.2f}",
            f"{st['wait_mean_us']:.2f}",
            f"{st['release_us']:.2f}",
        )
    t.add_row(f"{TAIL} (once)", f"{anatomy['tail_us']:.2f}", f"{100 * shares[TAIL]:.1f} %", "", "", "", "")
    return t
