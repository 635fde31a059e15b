"""Where does Ouro's batch-1 decode token go under PDL, and what does each of `fast`'s kernel forms buy?

    python bench/token_ablation.py [--rounds 5] [--out DIR] [--only NAME,NAME]
    python bench/token_ablation.py --gemv-sweep              # the GEMV-only chain, tiles swept per weight
    python bench/token_ablation.py --gemv-unsplit-prefetch   # o / down unsplit, L2 prefetch depths

The synthetic Ouro-1.4B token of `bench/synthetic_token.py` (the engine's own kernels, random weights of
the real shapes, 24 layers x 4 loops, context 519, one row), captured as one CUDA graph per variant:

    fast                  Triton GEMV + PDL + first weight tile before the wait; plain attention
    fast -OP              the same without one op (attn, write_kv, norm, silu): its marginal cost is the
                          difference (the chain is dependent, so a kernel's cost is what it adds to it)
    fast gemv-only        only the four projections per layer pass
    fast attn-pf          the attention prefetches its segment's K/V rows into L2 before its wait
                          (`kernels.attn_prefetch`)
    fast slots ...        the attention's per-key-slot softmax (`SplitConfig.key_slots`)
    ... steps             the residual norm in its step form, not in one pass
    ... silu-out/norm-out the GEMV's fused output forms (`kernels.gemv_silu_out`, `kernels.gemv_norm_out`)
    fast full             every one-row form the `fast` recipe runs (key slots, K/V prefetch, silu-out, the
                          tile table), K/V written without RoPE
    fast full rope        RoPE of q and k with the K/V write in one launch (`rope_half_write_kv`)
    fast full rope-out    the same work done by the q/k/v GEMV itself (`kernels.gemv_rope_out`): the
                          token as the `fast` recipe runs it
    fast full pfN ...     the GEMV asks L2 for N more weight tiles before its wait
                          (`TileConfig.prefetch_tiles`)
    fast full o+down ...  o and down without the split-K tail (other sums: R3)
    exact, exact+pdl      cuBLAS projections (exactloop), without and with PDL for the Triton kernels;
    exact rope            as the `exactloop` recipe runs it

Reports the median ms per token replay (variants interleaved, `--rounds` rounds), each ablation's
marginal µs per layer pass, the token's projection weights over this GPU's measured copy bandwidth, and
whether each full variant's output is bitwise equal to its family's first arm (it must be: preloads and
prefetches move no values; key slots are another reduction order). Writes `token_ablation.json` / `.md`
(`gemv_sweep.*`, `gemv_unsplit_prefetch.*`) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_token import (  # noqa: E402
    CTX,
    DIM,
    EPS,
    HEADS,
    HIDDEN,
    INTER,
    LAYERS,
    LOOPS,
    build,
    capture,
    capture_each,
    time_interleaved,
)

PASSES = LAYERS * LOOPS
QKV_HEADS = (HEADS, HEADS, DIM)  # Ouro-1.4B: 16 q heads, 16 k/v heads of 128
# bytes of the four projections' weights read per token (qkv, o, gate_up, down); over the device's copy
# bandwidth they give the GEMVs' floor (2.31 ms at the H200's measured 4.28 TB/s)
WEIGHT_BYTES_PER_TOKEN = PASSES * 2 * HIDDEN * (3 * HIDDEN + HIDDEN + 2 * INTER + INTER)


def copy_bandwidth(gib: int = 1, reps: int = 20) -> float:
    """This GPU's device-to-device copy bandwidth in bytes/s (bytes read + written, best of `reps`).

    Measured, not taken from a datasheet: the lent card may be an H100 (3.35 TB/s peak) or an H200 (4.8).
    """
    n = gib * 2**30 // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * n * 2 / best


@dataclass(frozen=True)
class Variant:
    gemv: bool = True  # Triton GEMV (fast) or cuBLAS (exact)
    pdl: bool = True
    attn_prefetch: bool = False
    key_slots: bool = False
    silu_out: bool = False  # kernels.gemv_silu_out: the gate/up GEMV stores SiLU·mul itself
    norm_out: bool = False  # kernels.gemv_norm_out: the o / down GEMVs run the residual norm themselves
    tiles: tuple = ()  # (weight name, TileConfig) overrides of the GEMV's tile table (--gemv-sweep)
    one_pass: bool = True  # the residual norm's one-pass form at one row (`rmsnorm.ONE_PASS_ROWS`)
    # before the attention: "write" K/V only; "launch" RoPE + the K/V write in one kernel (the engine's
    # `kernels.rope_kv_write`); "fold" that kernel's work in the q/k/v GEMV (`kernels.gemv_rope_out`)
    rope: str = "write"
    skip: frozenset = field(default_factory=frozenset)  # ops left out: attn, write_kv, norm, silu, all
    family: str = "fast"  # bitwise comparisons are within a family (the full variants only)


def variants() -> dict[str, Variant]:
    fast = Variant()
    exact = Variant(gemv=False, pdl=False, family="exact")
    out = {"fast": fast}
    for op in ("attn", "write_kv", "norm", "silu"):
        out[f"fast -{op}"] = replace(fast, skip=frozenset({op}), family="")
    out["fast gemv-only"] = replace(fast, skip=frozenset({"all"}), family="")
    out["fast attn-pf"] = replace(fast, attn_prefetch=True)
    out["fast slots"] = replace(fast, key_slots=True, family="slots")
    out["fast slots attn-pf"] = replace(fast, key_slots=True, attn_prefetch=True, family="slots")
    # the one-row attention as `fast` runs it: key slots and the K/V prefetch
    slots_pf = replace(fast, key_slots=True, attn_prefetch=True, family="slots")
    out["fast slots attn-pf steps"] = replace(slots_pf, one_pass=False)
    out["fast slots attn-pf silu-out"] = replace(slots_pf, silu_out=True)
    out["fast slots attn-pf norm-out"] = replace(slots_pf, norm_out=True)
    out["fast slots attn-pf silu-out norm-out"] = replace(slots_pf, silu_out=True, norm_out=True)
    full = replace(slots_pf, silu_out=True, family="fast full")  # the tile table's tiles
    out["fast full"] = full
    out["fast full rope"] = replace(full, rope="launch", family="fast full rope")
    out["fast full rope-out"] = replace(full, rope="fold", family="fast full rope")  # R0: the same bits
    for depth in PREFETCH_DEPTHS:  # R0: hints only, the same bits as fast full
        out[f"fast full pf{depth}"] = replace(full, tiles=prefetched(depth))
        out[f"fast full pf{depth} no-down"] = replace(full, tiles=prefetched(depth, ("qkv", "o", "gate_up")))
    from looptrace.engine.kernels.gemv.tiles import TileConfig

    for label in ("4x512 w2 k1", "8x256 w2 k1", "8x256 w4 k2"):  # R3: other sums than fast full
        cfg = TileConfig(**UNSPLIT[label])
        out[f"fast full o+down {label}"] = replace(full, tiles=(("o", cfg), ("down", cfg)), family="")
    out["exact steps"] = replace(exact, one_pass=False)
    out["exact"] = exact
    out["exact rope"] = replace(exact, rope="launch", family="exact rope")  # the engine's exactloop
    out["exact -attn"] = replace(exact, skip=frozenset({"attn"}), family="")
    out["exact+pdl"] = replace(exact, pdl=True)
    out["exact slots"] = replace(exact, key_slots=True, family="exact slots")
    out["exact+pdl slots attn-pf"] = replace(
        exact, pdl=True, key_slots=True, attn_prefetch=True, family="exact slots"
    )
    return out


def token_step(m: dict, linear, skip: frozenset, silu_out: bool = False, norm_out: bool = False,
               rope: str = "write"):  # fmt: skip
    """One decode token (96 layer passes) with the ops in `skip` left out; returns the last hidden state.
    silu_out / norm_out / rope="fold": the GEMV's fused output forms (the same bits as the launches they
    replace); rope: see `Variant.rope`."""
    from looptrace.engine.kernels import gemv_rope, paged_attention, rmsnorm, rope, silu_mul
    from looptrace.engine.kernels.gemv import forms as gemv_forms

    h = m["h0"]
    x = rmsnorm.rms_norm(h, m["layers"][0]["n1"], EPS)
    scale = DIM**-0.5
    rows = h.shape[0]
    for it in range(PASSES):
        lay = m["layers"][it % LAYERS]
        if "all" in skip:  # the projections alone, each feeding the next
            a = linear(x, lay["qkv"])[:, :HIDDEN]
            gate = linear(linear(a, lay["o"]), lay["gate_up"])[:, : gate_width(lay)]
            x = linear(gate, lay["down"])
            continue
        cache = (m["kc"], m["vc"], m["went"], m["woff"], it % LAYERS)
        if rope == "fold":
            if not gemv_rope.qkv_rope_fusable(x, lay["qkv"], m["cos"], m["sin"], m["kc"], m["vc"], QKV_HEADS):
                raise SystemExit("token_ablation: kernels.gemv_rope_out does not take Ouro's qkv here")
            q = gemv_rope.qkv_rope_write(x, lay["qkv"], m["cos"], m["sin"], *cache, QKV_HEADS)
        else:
            q, k, v = (t.view(rows, HEADS, DIM) for t in linear(x, lay["qkv"]).split(HIDDEN, dim=-1))
            if rope == "launch":
                q = rope.rope_half_write_kv(q, k, v, m["cos"], m["sin"], *cache)
            elif "write_kv" not in skip:
                paged_attention.write_kv(k, v, *cache)
        a = q.reshape(rows, HIDDEN)
        if "attn" not in skip:
            a = paged_attention.paged_attention(
                q.view(rows, HEADS, DIM), m["kc"], m["vc"], m["tables"], m["ctx"], it % LAYERS, scale
            )
        nxt = m["layers"][(it + 1) % LAYERS]["n1"]
        if norm_out:
            h, x = gemv_forms.linear_residual_norm(a, lay["o"], lay["n1"], EPS, h, lay["n2"], EPS)
        elif "norm" in skip:
            x = linear(a, lay["o"])
        else:
            h, x = rmsnorm.residual_rms_norm(linear(a, lay["o"]), lay["n1"], EPS, h, lay["n2"], EPS)
        if silu_out:
            act = gemv_forms.gate_up_silu(x, lay["gate_up"])
        else:
            gate, up = linear(x, lay["gate_up"]).chunk(2, dim=-1)
            act = gate if "silu" in skip else silu_mul.silu_mul(gate, up)
        if norm_out:
            h, x = gemv_forms.linear_residual_norm(act, lay["down"], lay["n2"], EPS, h, nxt, EPS)
        elif "norm" in skip:
            x = linear(act, lay["down"])
        else:
            h, x = rmsnorm.residual_rms_norm(linear(act, lay["down"]), lay["n2"], EPS, h, nxt, EPS)
    return x if "norm" in skip or "all" in skip else h


def rope_rows(position: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos / sin of one row at `position` (bf16 [1, DIM]), as `layers.RotaryHalf` gives them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, DIM, 2, device="cuda").float() / DIM))
    angle = torch.cat([position * inv_freq, position * inv_freq])[None]
    return angle.cos().bfloat16(), angle.sin().bfloat16()


def gate_width(lay: dict) -> int:
    return lay["gate_up"].shape[0] // 2


def capture_variant(m: dict, v: Variant):
    from looptrace.engine.kernels import launch_mode, rmsnorm
    from looptrace.engine.kernels import paged_attention as pa
    from looptrace.engine.kernels.gemv import forms as gemv_forms
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    linear = gemv_forms.linear if v.gemv else F.linear
    saved, saved_pick, saved_pass = pa.DEFAULT_SPLIT, gemv_tiles.pick_config, rmsnorm.ONE_PASS_ROWS
    pa.DEFAULT_SPLIT = replace(pa.DEFAULT_SPLIT, key_slots=v.key_slots)
    rmsnorm.ONE_PASS_ROWS = v.one_pass
    if v.tiles:  # this variant's tile for each overridden weight shape, the table's for the others
        shapes = {tuple(m["layers"][0][name].shape): cfg for name, cfg in v.tiles}
        gemv_tiles.pick_config = lambda rows, n, k: shapes.get((n, k)) or saved_pick(rows, n, k)
    try:  # the warm-ups and the capture under the variant's launch mode
        with launch_mode.dependent_launches(v.pdl, v.gemv and v.pdl, v.attn_prefetch):
            return capture(lambda: token_step(m, linear, v.skip, v.silu_out, v.norm_out, v.rope))
    finally:
        pa.DEFAULT_SPLIT, gemv_tiles.pick_config, rmsnorm.ONE_PASS_ROWS = saved, saved_pick, saved_pass


def gemv_sweep() -> dict[str, Variant]:
    """The four projections alone (the GEMV-only chain) with one weight's tile config replaced at a time:
    a tile that streams better in the dependent chain than alone shows here (`--gemv-sweep`)."""
    from looptrace.engine.kernels.gemv.tiles import TileConfig

    only = replace(Variant(), skip=frozenset({"all"}), family="")
    out = {"gemv-only": only}
    candidates = {
        "32x128 w4": TileConfig(block_n=32, block_k=128),
        "16x256 w4": TileConfig(block_n=16, block_k=256),
        "16x512 w4 s2": TileConfig(block_n=16, block_k=512, num_stages=2),
        "32x256 w4": TileConfig(block_n=32, block_k=256),
        "64x128 w4": TileConfig(block_n=64, block_k=128),
        "32x128 w8": TileConfig(block_n=32, block_k=128, num_warps=8),
        "32x128 w2": TileConfig(block_n=32, block_k=128, num_warps=2),
        "16x128 w2 s4": TileConfig(block_n=16, block_k=128, num_warps=2, num_stages=4),
        "64x256 w8 s2": TileConfig(block_n=64, block_k=256, num_warps=8, num_stages=2),
        "8x512 w2 s2": TileConfig(block_n=8, block_k=512, num_warps=2, num_stages=2),
    }
    for weight in ("qkv", "o", "gate_up", "down"):
        for label, cfg in candidates.items():
            out[f"gemv-only {weight} {label}"] = replace(only, tiles=((weight, cfg),))
    return out


# o and down (N = 2048) without the split-K tail (no partials, no ticket, no combine: each program
# streams whole rows), and split in two at most
UNSPLIT = {
    "4x512 w2 k1": dict(block_n=4, block_k=512, num_warps=2, split_k=1),
    "4x512 w4 k1": dict(block_n=4, block_k=512, split_k=1),
    "8x256 w2 k1": dict(block_n=8, block_k=256, num_warps=2, split_k=1),
    "8x512 w4 s2 k1": dict(block_n=8, block_k=512, num_stages=2, split_k=1),
    "2x1024 w2 k1": dict(block_n=2, block_k=1024, num_warps=2, split_k=1),
    "4x1024 w4 s2 k1": dict(block_n=4, block_k=1024, num_stages=2, split_k=1),
    "8x256 w4 k2": dict(block_n=8, block_k=256, split_k=2),
    "16x256 w4 k2": dict(block_n=16, block_k=256, split_k=2),
}
PREFETCH_DEPTHS = (1, 2, 4)  # tiles after the preloaded one asked of L2 before the PDL wait


def table_tile(weight: str):
    """The tile the GEMV's table gives one of Ouro's projections at one row."""
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    n, k = {"qkv": (3 * HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
            "down": (HIDDEN, INTER)}[weight]  # fmt: skip
    return gemv_tiles.pick_config(1, n, k)


def prefetched(depth: int, weights=("qkv", "o", "gate_up", "down")) -> tuple:
    """Tile overrides: the table's tile of each weight with `depth` tiles prefetched before the wait."""
    return tuple((w, replace(table_tile(w), prefetch_tiles=depth)) for w in weights)


def gemv_unsplit_prefetch() -> dict[str, Variant]:
    """`--gemv-unsplit-prefetch`: the GEMV-only chain with o / down unsplit (`UNSPLIT`), and each weight's
    table tile prefetching 1, 2 or 4 tiles into L2 before its wait (`TileConfig.prefetch_tiles`)."""
    from looptrace.engine.kernels.gemv.tiles import TileConfig

    only = replace(Variant(), skip=frozenset({"all"}), family="")
    out = {"gemv-only": only}
    for weight in ("o", "down"):
        for label, kw in UNSPLIT.items():
            out[f"gemv-only {weight} {label}"] = replace(only, tiles=((weight, TileConfig(**kw)),))
    for weight in ("qkv", "o", "gate_up", "down"):
        for depth in PREFETCH_DEPTHS:
            out[f"gemv-only {weight} pf{depth}"] = replace(only, tiles=prefetched(depth, (weight,)))
    for depth in PREFETCH_DEPTHS:
        out[f"gemv-only all pf{depth}"] = replace(only, tiles=prefetched(depth))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument(
        "--gemv-sweep", action="store_true", help="the GEMV-only chain, tiles swept per weight"
    )
    parser.add_argument(
        "--gemv-unsplit-prefetch",
        action="store_true",
        help="the GEMV-only chain: o / down unsplit, L2 prefetch depths",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/token_ablation.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    import triton

    from looptrace.engine import kernels as K

    t0 = time.time()
    K.calibrate("cuda")
    copy_bw = copy_bandwidth()
    m = build(1, torch.Generator(device="cuda").manual_seed(3))
    m["cos"], m["sin"] = rope_rows(CTX)
    sweep = args.gemv_sweep or args.gemv_unsplit_prefetch
    pool = gemv_sweep() if args.gemv_sweep else gemv_unsplit_prefetch() if sweep else variants()
    chosen = {n: v for n, v in pool.items() if not args.only or n in args.only.split(",")}
    graphs, outs = capture_each({n: lambda v=v: capture_variant(m, v) for n, v in chosen.items()}, t0)
    times = time_interleaved(graphs, args.rounds)
    median = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    ref = "gemv-only" if sweep else "fast"  # the "vs" column's arm
    firsts: dict[str, str] = {}
    results = []
    for name in graphs:
        v = chosen[name]
        family = v.family
        first = firsts.setdefault(family, name) if family else None
        base = "exact" if not v.gemv else "fast"
        marginal = None
        if v.skip and base in median and "all" not in v.skip:
            marginal = (median[base] - median[name]) * 1000 / PASSES
        results.append(
            {
                "variant": name,
                "ms_per_token": median[name],
                "rounds": times[name],
                "vs_ref": median[name] / median[ref] if ref in median else None,
                "copy_bw_fraction": WEIGHT_BYTES_PER_TOKEN / copy_bw / (median[name] / 1000),
                "marginal_us_per_pass": marginal,
                "bitwise_vs": first,
                "bitwise": bool(torch.equal(outs[name], outs[first])) if first else None,
            }
        )
        print(json.dumps(results[-1]), flush=True)
    device = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, Triton {triton.__version__}"
    flags = " --gemv-sweep" if args.gemv_sweep else " --gemv-unsplit-prefetch" if sweep else ""
    lines = [
        "# Ouro-1.4B batch-1 decode token: ablations and early loads under PDL",
        "",
        f"Device: {device}; {versions}. Command: `python bench/token_ablation.py --rounds "
        f"{args.rounds}{flags}` "
        f"({time.time() - t0:.0f} s). Median ms per replay of a one-token CUDA graph (96 layer passes), "
        "variants interleaved; marginal = what the left-out op adds per layer pass; weights at copy bw = "
        f"the token's {WEIGHT_BYTES_PER_TOKEN / 1e9:.2f} GB of projection weights at "
        f"{copy_bw / 1e12:.2f} TB/s (this GPU's copy bandwidth, measured in the same call) over the "
        "token's time.",
        "",
        f"| variant | ms/token | vs {ref} | weights at copy bw | marginal µs/pass | bitwise = |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r['vs_ref']:.3f}" if r["vs_ref"] else "-"
        marg = f"{r['marginal_us_per_pass']:.2f}" if r["marginal_us_per_pass"] is not None else "-"
        same = (
            f"{r['bitwise_vs']}: {r['bitwise']}"
            if r["bitwise_vs"] and r["bitwise_vs"] != r["variant"]
            else "-"
        )
        bw = f"{r['copy_bw_fraction']:.0%}"
        lines.append(f"| {r['variant']} | {r['ms_per_token']:.3f} | {ratio} | {bw} | {marg} | {same} |")
    stem = "gemv_sweep" if args.gemv_sweep else "gemv_unsplit_prefetch" if sweep else "token_ablation"
    out = Path(args.out)
    (out / f"{stem}.json").write_text(
        json.dumps(
            {"device": device, "versions": versions, "copy_bw_tbps": copy_bw / 1e12, "results": results},
            indent=1,
        )
    )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
