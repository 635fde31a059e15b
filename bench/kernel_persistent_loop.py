"""The persistent Ouro loop kernel (`kernels/persistent_loop.py`) at Ouro-1.4B's shapes, alone: its checks
(persistent == staged bitwise, against float64, graph == eager, repeat, alone == batched) and its time per
loop against the copy floor measured in the same process, for each launch shape and row count asked.

    python bench/kernel_persistent_loop.py --out DIR [--layers 24] [--ctx 512] [--rows 1,2,4,8]
        [--tiles 2048:8:64:1,2048:8:64:1:j] [--rounds 5]

Writes DIR/persistent_loop.md (the table) and DIR/persistent_loop.json. CUDA only. Random weights of the real
shape (seeded): the time does not depend on the values, the checks compare two computations of one input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from looptrace.engine.kernels import persistent_loop as pl  # noqa: E402
from tests.engine.kernels.test_persistent_loop import make_case, reference_loop, rel_err, written_rows  # noqa: E402

HEADS = (16, 16, 128)
HIDDEN, INTER = 2048, 5632


def copy_floor_gbs(nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth (read + write counted once each), median of 10."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def weight_bytes(case) -> int:
    w = case.weights
    return sum(t.numel() * t.element_size() for t in (w.qkv, w.o, w.gate_up, w.down, w.norms, w.final_norm))


def checks(case, tiles: pl.LoopTiles) -> dict:
    res = {}
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = pl.loop_persistent(*case.args(kc, vc), tiles=tiles)
    kc2, vc2 = case.k_cache.clone(), case.v_cache.clone()
    staged = pl.loop_staged(*case.args(kc2, vc2), tiles=tiles)
    res["persistent_eq_staged"] = bool(
        torch.equal(out, staged) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    )
    repeats = [pl.loop_persistent(*case.args(), tiles=tiles) for _ in range(5)]
    res["repeat_bitwise_5"] = all(torch.equal(out, r) for r in repeats)
    kc3, vc3 = case.k_cache.clone(), case.v_cache.clone()
    pl.loop_persistent(*case.args(kc3, vc3), tiles=tiles)  # warm-up, then capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pl.loop_persistent(*case.args(kc3, vc3), tiles=tiles)
    graph.replay()
    torch.cuda.synchronize()
    res["graph_eq_eager"] = bool(torch.equal(captured, out))
    rows = case.state.shape[0]
    if rows > 1:
        alone = [pl.loop_persistent(*case.rows([r]).args(), tiles=tiles) for r in range(rows)]
        res["alone_eq_batched"] = all(torch.equal(alone[r][0], out[r]) for r in range(rows))
    ref, ref_k, ref_v = reference_loop(case)
    got_k, got_v = written_rows(case, kc, vc)
    res["rel_err_state_vs_float64"] = rel_err(out, ref)
    res["rel_err_kv_vs_float64"] = max(rel_err(got_k, ref_k), rel_err(got_v, ref_v))
    return res


STAGE_NAMES = ("qkv", "attention", "o", "gate_up", "down")


def stage_bytes(case) -> dict[str, int]:
    """Bytes one layer's stage must read at least: its weights (attention: the K and V rows of every row's
    context)."""
    w = case.weights
    layers = w.qkv.shape[0]
    hq, hk, d = w.heads
    kv_row = 2 * hk * d * w.qkv.element_size()
    ctx = int(case.ctx_lens.sum())
    per_layer = {name: t[0].numel() * t.element_size() for name, t in
                 (("qkv", w.qkv), ("o", w.o), ("gate_up", w.gate_up), ("down", w.down))}  # fmt: skip
    per_layer["attention"] = ctx * kv_row
    return {name: per_layer[name] * layers for name in STAGE_NAMES}


def stage_anatomy(case, tiles: pl.LoopTiles, floor_gbs: float) -> list[str]:
    """Where a loop's time goes: the staged twin's kernels under torch.profiler (each stage's kernel time
    summed over the layers, its bytes, its share of the copy bandwidth) and the gaps between kernels."""
    from torch.profiler import ProfilerActivity, profile

    args = case.args()
    for _ in range(3):
        pl.loop_staged(*args, tiles=tiles)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pl.loop_staged(*args, tiles=tiles)
        torch.cuda.synchronize()
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sorted((e for e in on_gpu if "_loop_kernel" in e.name), key=lambda e: e.time_range.start)
    layers = case.weights.qkv.shape[0]
    if len(kernels) != 5 * layers + 1:
        return [f"stage anatomy: {len(kernels)} loop kernels seen, {5 * layers + 1} expected"]
    busy = {name: 0.0 for name in STAGE_NAMES}
    for i, e in enumerate(kernels[:-1]):
        busy[STAGE_NAMES[i % 5]] += e.time_range.elapsed_us()
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    total = sum(busy.values()) + kernels[-1].time_range.elapsed_us()
    nbytes = stage_bytes(case)
    lines = [
        f"Staged twin at {case.state.shape[0]} row(s), tiles {tiles.block_k}:{tiles.num_warps}:"
        f"{tiles.split_keys}, one loop under torch.profiler: kernels {total / 1e3:.3f} ms, span "
        f"{span / 1e3:.3f} ms (gaps {(span - total) / 1e3:.3f} ms over {len(kernels) - 1} boundaries)",
        "",
        "| stage | kernel ms per loop | µs per layer | MB per loop | GB/s | % of copy |",
        "|---|---|---|---|---|---|",
    ]
    for name in STAGE_NAMES:
        us = busy[name]
        gbs = nbytes[name] / us / 1e3 if us else 0.0
        mb = nbytes[name] / 1e6
        share = 100 * gbs / floor_gbs
        lines.append(f"| {name} | {us / 1e3:.4f} | {us / layers:.2f} | {mb:.1f} | {gbs:.0f} | {share:.0f} |")
    lines.append(f"| final norm | {kernels[-1].time_range.elapsed_us() / 1e3:.4f} | | | | |")
    return lines


def time_loops(cases: dict, tile_list: list[pl.LoopTiles], rounds: int, loops_per_graph: int = 4,
               streams: dict | None = None) -> dict:  # fmt: skip
    """ms per loop launch: a CUDA graph of `loops_per_graph` launches (a token's loops) replayed 10 times per
    sample, every (rows, tiles) arm once per round, interleaved; the median of `rounds` samples. `streams`:
    one-row forms of `stream_loop` by name (each timed at one row, under tiles index -1)."""
    graphs = {}
    for name, fn in (streams or {}).items():
        if 1 not in cases:
            break
        args = cases[1].args()
        fn(*args)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(loops_per_graph):
                fn(*args)
        graphs[(1, -1, name)] = g
    for rows, case in cases.items():
        for ti, tiles in enumerate(tile_list):
            for form, fn in (("persistent", pl.loop_persistent), ("staged", pl.loop_staged)):
                if form == "staged" and (ti > 0 or rows != min(cases)):  # one staged arm: launch-bound twin
                    continue
                args = case.args()
                fn(*args, tiles=tiles)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(loops_per_graph):
                        fn(*args, tiles=tiles)
                graphs[(rows, ti, form)] = g
    samples: dict = {key: [] for key in graphs}
    for _ in range(rounds):
        for key, g in graphs.items():
            g.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                g.replay()
            end.record()
            end.synchronize()
            samples[key].append(start.elapsed_time(end) / (10 * loops_per_graph))
    return {key: statistics.median(v) for key, v in samples.items()}


def stream_checks(case, fn, tiles: pl.LoopTiles) -> dict:
    """A one-row `stream_loop` form: against float64 and the register form, repeated, graph against eager."""
    res = {}
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = fn(*case.args(kc, vc))
    torch.cuda.synchronize()
    res["barrier_timeouts"] = pl.barrier_timeouts()
    ref, ref_k, ref_v = reference_loop(case)
    got_k, got_v = written_rows(case, kc, vc)
    res["rel_err_state_vs_float64"] = rel_err(out, ref)
    res["rel_err_kv_vs_float64"] = max(rel_err(got_k, ref_k), rel_err(got_v, ref_v))
    # the bits of the state and the written K/V rows: forms that share them match bit for bit
    bits = hashlib.sha1()
    for t in (out, got_k, got_v):
        bits.update(t.contiguous().cpu().view(torch.int16).numpy().tobytes())
    res["bits"] = bits.hexdigest()[:16]
    registers = pl.loop_staged(*case.args(), tiles=tiles)
    res["rel_diff_vs_register_form"] = rel_err(out, registers.double().cpu())
    res["register_form_vs_float64"] = rel_err(registers, ref)
    res["repeat_bitwise_5"] = all(torch.equal(out, fn(*case.args())) for _ in range(5))
    args = case.args()
    fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    res["graph_eq_eager"] = bool(torch.equal(captured, out))
    return res


def parse_streams(spec: str) -> dict:
    """`SLOTS:WARPS[:ws][:kvN][:ll][:noattn][:nofma][:nobar]` entries -> one-row `stream_loop` forms
    by name (ws: the warp-specialized producer; ll: values handed over as tagged
    words, no grid barriers; kvN: the attention's first N key blocks copied to shared memory as
    each layer starts, kv0 none, 2 when not given; the rest leave a part out to time what it costs, so those
    forms are not checked)."""
    from looptrace.engine.kernels import stream_loop as sl

    # the kernel's NO_* bits by flag: timing only, outputs wrong
    ablations = {"noattn": sl.NO_ATTENTION.value, "nofma": sl.NO_FMA.value, "nobar": sl.NO_BARRIERS.value}
    forms = {}
    for item in filter(None, spec.split(",")):
        slots, warps, *rest = item.split(":")
        kv = [f for f in rest if f.startswith("kv") and f[2:].isdigit()]
        unknown = set(rest) - {"ws", "ll", *ablations, *kv}
        if unknown or not (slots.isdigit() and warps.isdigit()):
            what = f"unknown flag {sorted(unknown)[0]!r}" if unknown else "SLOTS and WARPS must be numbers"
            syntax = "SLOTS:WARPS[:ws][:kvN][:ll][:noattn][:nofma][:nobar]"
            raise ValueError(f"--stream entry {item!r}: {what} ({syntax})")
        ablate = sum(ablations[f] for f in rest if f in ablations)

        options = dict(kv_blocks=int(kv[-1][2:])) if kv else {}  # none given: `loop_streamed`'s default
        if "ll" in rest:  # values handed over as tagged words, no grid barriers
            options["linked"] = True

        def form(*a, s=int(slots), w=int(warps), ws="ws" in rest, ab=ablate, opts=options, **kw):
            return sl.loop_streamed(*a, slots=s, num_warps=w, specialized=ws, ablate=ab, **opts, **kw)

        form.ablated = bool(ablate)
        forms[f"stream {item}"] = form
    return forms


def stream_anatomy(case, streams: dict, floor_gbs: float) -> tuple[list[str], dict]:
    """Each one-row `stream_loop` form's stages from every program's clock (`loop_streamed(times=...)`: its
    arrival at and departure from each grid barrier), medians over the layers: a stage's work (a program's
    departure from the barrier before to its arrival at the barrier after: mean and slowest program), its
    wait at the barrier (mean), the release (first departure after the last arrival), the stage's wall time
    (median departures), and which programs arrive last most often."""
    from collections import Counter

    from looptrace.engine.kernels import stream_loop as sl

    layers = case.weights.shape[0]
    nbytes = stage_bytes(case)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    lines = [
        "| form | stage | wall µs | % of copy | work mean | work max | wait mean | release | last in |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary: dict = {}
    for name, fn in streams.items():
        times = torch.zeros(programs, sl.stamp_count(layers), dtype=torch.int64, device="cuda")
        for _ in range(3):  # the last of three: compiled, caches warm
            fn(*case.args(), times=times)
        torch.cuda.synchronize()
        t = times.double().cpu() / 1e3  # µs
        rows = {}
        prev, merged = t[:, 0], ""
        for layer in range(layers):
            for k, stage in enumerate(STAGE_NAMES):
                arrive, leave = t[:, 1 + 10 * layer + 2 * k], t[:, 2 + 10 * layer + 2 * k]
                if not bool(leave.any()):  # an ablated barrier: its stage's work counts in the next
                    merged = f"{stage}+"
                    continue
                stage, merged = merged + stage, ""
                r = rows.setdefault(stage, {key: [] for key in ("wall", "mean", "max", "wait", "rel")})
                r.setdefault("last", Counter())
                work = arrive - prev
                r["wall"].append(float(leave.median() - prev.median()))
                r["mean"].append(float(work.mean()))
                r["max"].append(float(work.max()))
                r["wait"].append(float((leave - arrive).mean()))
                r["rel"].append(float(leave.min() - arrive.max()))
                r["last"][int(arrive.argmax())] += 1
                prev = leave
        per_layer = float((t[:, -1].median() - t[:, 0].median()) / layers)
        summary[name] = {"us_per_layer": per_layer, "stages": {}}
        for stage, r in rows.items():
            med = {key: statistics.median(r[key]) for key in ("wall", "mean", "max", "wait", "rel")}
            stage_bytes_ = sum(nbytes[part] for part in stage.split("+"))
            share = 100 * stage_bytes_ / layers / (med["wall"] * 1e-6) / (floor_gbs * 1e9)
            last = ", ".join(f"{p} ({n})" for p, n in r["last"].most_common(3))
            summary[name]["stages"][stage] = dict(med, last=r["last"].most_common(3))
            numbers = [f"{med[key]:.2f}" for key in ("wall", "mean", "max", "wait", "rel")]
            cells = [name, stage, numbers[0], f"{share:.0f}", *numbers[1:], last]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append(f"| {name} | whole layer | {per_layer:.2f} | | | | | | |")
    return lines, summary


def parse_tiles(spec: str) -> pl.LoopTiles:
    """`BK:warps:split_keys[:lookahead][:j]` (j: every row's sums in one reduction, `joint_rows`)."""
    bk, warps, split, *rest = spec.split(":")
    joint = "j" in rest
    look = [int(x) for x in rest if x != "j"]
    return pl.LoopTiles(block_k=int(bk), num_warps=int(warps), split_keys=int(split),
                        lookahead=look[0] if look else 1, joint_rows=joint)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rows", default="1,2,4,8")
    # one tile in flight, per row and joint: two or three tiles were slower at one row on an H100, and a run
    # that included them at 8 rows died with an illegal address (bench/results/h100/kernels/)
    ap.add_argument("--tiles", default="2048:8:64:1,2048:8:64:1:j")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check-layers", type=int, default=24)
    ap.add_argument("--check-tiles", default="0", help="which --tiles entries (0-based) get the checks")
    forms = "SLOTS:WARPS[:ws][:kvN][:ll][:noattn][:nofma][:nobar],..."
    ap.add_argument("--stream", default="", help=f"one-row TMA-ring forms (stream_loop): {forms}")
    args = ap.parse_args()
    args.check_tiles = [int(i) for i in args.check_tiles.split(",")]
    try:
        streams = parse_streams(args.stream)
    except ValueError as e:
        print(f"bench/kernel_persistent_loop.py: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/kernel_persistent_loop.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tile_list = []
    for spec in args.tiles.split(","):
        tile_list.append(parse_tiles(spec))
    gen = torch.Generator(device="cuda").manual_seed(11)
    floor = copy_floor_gbs()
    print(f"copy floor {floor:.0f} GB/s", flush=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    cases = {
        r: make_case(
            gen,
            HEADS,
            HIDDEN,
            INTER,
            args.layers,
            [args.ctx + 37 * i for i in range(r)],
            page=16,
            device="cuda",
        )
        for r in rows_list
    }
    result: dict = {
        "barrier_timeouts": 0,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_floor_gbs": floor,
        "layers": args.layers,
        "ctx": args.ctx,
        "checks": {},
        "ms_per_loop": {},
    }
    check_case = make_case(
        gen,
        HEADS,
        HIDDEN,
        INTER,
        args.check_layers,
        [args.ctx, args.ctx + 100, 40],
        page=16,
        device="cuda",
        scale=1.0,
    )
    tags = args.tiles.split(",")
    for index in args.check_tiles:  # each launch shape compiles its own code
        tag, tiles = tags[index], tile_list[index]
        for name, case in (("rows1", check_case.rows([0])), ("rows3", check_case)):
            res = checks(case, tiles)
            result["checks"][f"{tag}/{name}"] = res
            print(tag, name, res, f"{time.time() - t0:.0f}s", flush=True)
    for name, fn in list(streams.items()):  # checked at one row before any timing
        if fn.ablated:
            continue
        gave_up = pl.barrier_timeouts()
        res = stream_checks(check_case.rows([0]), fn, tile_list[0])
        result["checks"][f"{name}/rows1"] = res
        print(name, res, f"{time.time() - t0:.0f}s", flush=True)
        if pl.barrier_timeouts() > gave_up:  # a wait gave up: its timings would be its timeouts'
            print(f"{name}: waits gave up in its checks; not timed", flush=True)
            del streams[name]
    times = time_loops(cases, tile_list, args.rounds, streams=streams)
    wbytes = weight_bytes(cases[rows_list[0]])
    floor_ms = wbytes / floor / 1e6
    lines = [
        f"# Persistent Ouro loop at Ouro-1.4B shapes ({args.layers} layers, ctx {args.ctx}+), "
        f"{result['device']}",
        "",
        f"copy floor {floor:.0f} GB/s; weights per loop {wbytes / 1e9:.3f} GB -> floor {floor_ms:.3f} ms",
        "",
        "| rows | tiles (block_k:warps:split_keys[:lookahead][:j]) | form | ms per loop | x floor | GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for (rows, ti, form), ms in sorted(times.items()):
        tag = args.tiles.split(",")[ti] if ti >= 0 else "TMA ring"
        result["ms_per_loop"][f"{rows}/{tag}/{form}"] = ms
        lines.append(
            f"| {rows} | {tag} | {form} | {ms:.4f} | {ms / floor_ms:.2f} | {wbytes / ms / 1e6:.0f} |"
        )
    result["barrier_timeouts"] = pl.barrier_timeouts()
    anatomy = stage_anatomy(cases[rows_list[0]], tile_list[0], floor)  # the first row count and launch shape
    lines += ["", "## Stage anatomy", "", *anatomy]
    print("\n".join(anatomy), flush=True)
    if streams and 1 in cases:
        stream_lines, result["stream_anatomy"] = stream_anatomy(cases[1], streams, floor)
        lines += [
            "",
            "## Stage anatomy of the TMA-ring forms (one launch, every program's clock, µs per layer)",
            "",
            *stream_lines,
        ]
        print("\n".join(stream_lines), flush=True)
    lines += [
        "",
        f"barrier waits that gave up: {result['barrier_timeouts']}",
        "",
        "## Checks",
        "",
        "```",
        json.dumps(result["checks"], indent=1),
        "```",
    ]
    (args.out / "persistent_loop.md").write_text("\n".join(lines) + "\n")
    (args.out / "persistent_loop.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
