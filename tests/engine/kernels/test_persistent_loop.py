"""`persistent_loop` (`kernels.persistent_loop`, R3): one Ouro loop at a few decode rows as one launch.

CPU: the staged form (the same stage code, one launch per stage) runs in the Triton interpreter in a child
process: against a float64 loop over the same paged cache, run to run, alone against batched (a row's bits
do not depend on the other rows), independent of the grid size, the K/V written at each row's slot only,
no cache write for a padding row, the split tickets and barrier counters back at zero, and the shapes and
inputs `loop_fusable` refuses.
GPU (`gpu` marker): at Ouro-1.4B's shapes, the persistent launch against the staged form (bitwise), against
float64, replayed in a CUDA graph against eager, repeated, alone against batched.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import interpreted_results_fixture

HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu


@dataclass
class Case:
    state: torch.Tensor  # [R, H] bf16
    weights: object  # LoopWeights
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor  # [E, page, Hk, D]
    v_cache: torch.Tensor
    write_entry: torch.Tensor  # [R] entry base of the page holding the row's position (-1: padding)
    write_offset: torch.Tensor
    tables: torch.Tensor  # [R, nb] entry bases
    ctx_lens: torch.Tensor  # [R] keys attended (position + 1)
    page: int

    def args(self, k_cache=None, v_cache=None):
        return (
            self.state,
            self.weights,
            self.cos,
            self.sin,
            self.k_cache.clone() if k_cache is None else k_cache,
            self.v_cache.clone() if v_cache is None else v_cache,
            self.write_entry,
            self.write_offset,
            self.tables,
            self.ctx_lens,
            self.page,
        )

    def rows(self, idx: list[int]) -> Case:
        """The same rows alone (or reordered): the cache and the weights shared."""
        pick = torch.tensor(idx)
        return Case(
            self.state[pick],
            self.weights,
            self.cos[pick],
            self.sin[pick],
            self.k_cache,
            self.v_cache,
            self.write_entry[pick],
            self.write_offset[pick],
            self.tables[pick],
            self.ctx_lens[pick],
            self.page,
        )


def make_case(gen, heads, hidden, inter, layers, ctx_lens, page=4, device="cpu", scale=1.0) -> Case:
    """Random weights (norm weights near 1), a state, and a paged cache whose earlier positions hold random
    K/V; row i's pages are its own, `layers` entries per page (entry = block * layers + layer)."""
    from looptrace.engine.kernels.persistent_loop import LoopWeights

    hq, hk, d = heads
    rows = len(ctx_lens)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * s).to(torch.bfloat16)

    def near_one(*shape):
        return (1 + 0.1 * torch.randn(*shape, generator=gen, device=device)).to(torch.bfloat16)

    weights = LoopWeights(
        qkv=rand(layers, (hq + 2 * hk) * d, hidden, s=scale / math.sqrt(hidden)),
        o=rand(layers, hidden, hq * d, s=scale / math.sqrt(hq * d)),
        gate_up=rand(layers, 2 * inter, hidden, s=scale / math.sqrt(hidden)),
        down=rand(layers, hidden, inter, s=scale / math.sqrt(inter)),
        norms=near_one(layers, 4, hidden),
        final_norm=near_one(hidden),
        eps=1e-6,
        heads=heads,
    )
    pages = [math.ceil(c / page) for c in ctx_lens]
    width = max(pages)
    tables = torch.full((rows, width), -1, dtype=torch.int64)
    block = 0
    for r, n in enumerate(pages):
        for j in range(n):
            tables[r, j] = block * layers
            block += 1
    k_cache = rand(block * layers, page, hk, d)
    v_cache = rand(block * layers, page, hk, d)
    pos = torch.tensor([c - 1 for c in ctx_lens])
    write_entry = tables[torch.arange(rows), pos // page].clone()
    write_offset = pos % page
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    to = dict(device=device)
    return Case(
        rand(rows, hidden, s=scale),
        weights,
        emb.cos().bfloat16().to(**to),
        emb.sin().bfloat16().to(**to),
        k_cache,
        v_cache,
        write_entry.to(**to),
        write_offset.to(**to),
        tables.to(**to),
        torch.tensor(ctx_lens).to(**to),
        page,
    )


def reference_loop(case: Case):
    """float64: (new state [R, H], k and v written per (row, layer) [R, L, Hk, D]), no rounding anywhere;
    the cache's earlier positions are read as stored."""
    w = case.weights
    hq, hk, d = w.heads
    layers, hidden, inter = w.shape
    f = lambda t: t.detach().double().cpu()  # noqa: E731
    eps = w.eps

    def rms(x, weight):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def rot(t, c, s):
        return t * c + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], dim=-1) * s

    kc, vc, tables = f(case.k_cache), f(case.v_cache), case.tables.cpu()
    states, written_k, written_v = [], [], []
    for r in range(case.state.shape[0]):
        h = f(case.state[r])
        c, s = f(case.cos[r]), f(case.sin[r])
        ctx = int(case.ctx_lens[r])
        ks, vs = [], []
        for layer in range(layers):
            norms = f(w.norms[layer])
            x = rms(h, norms[0])
            q, k, v = (f(w.qkv[layer]) @ x).split([hq * d, hk * d, hk * d])
            q, k, v = rot(q.view(hq, d), c, s), rot(k.view(hk, d), c, s), v.view(hk, d)
            ks.append(k)
            vs.append(v)
            keys = torch.stack(
                [kc[tables[r, p // case.page] + layer, p % case.page] for p in range(ctx - 1)] + [k]
            )
            vals = torch.stack(
                [vc[tables[r, p // case.page] + layer, p % case.page] for p in range(ctx - 1)] + [v]
            )
            group = hq // hk
            keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
            att = torch.softmax(torch.einsum("hd,thd->ht", q, keys) / math.sqrt(d), dim=-1)
            out = torch.einsum("ht,thd->hd", att, vals).reshape(-1)
            h = h + rms(f(w.o[layer]) @ out, norms[1])
            gate, up = (f(w.gate_up[layer]) @ rms(h, norms[2])).split([inter, inter])
            h = h + rms(f(w.down[layer]) @ (torch.nn.functional.silu(gate) * up), norms[3])
        states.append(rms(h, f(w.final_norm)))
        written_k.append(torch.stack(ks))
        written_v.append(torch.stack(vs))
    return torch.stack(states), torch.stack(written_k), torch.stack(written_v)


def written_rows(case: Case, k_cache, v_cache):
    """[R, L, Hk, D] k and v each row's launch wrote at (write_entry + layer, write_offset)."""
    layers = case.weights.shape[0]
    ks, vs = [], []
    for r in range(case.state.shape[0]):
        e, o = int(case.write_entry[r]), int(case.write_offset[r])
        ks.append(torch.stack([k_cache[e + layer, o] for layer in range(layers)]))
        vs.append(torch.stack([v_cache[e + layer, o] for layer in range(layers)]))
    return torch.stack(ks), torch.stack(vs)


def rel_err(a, ref) -> float:
    return ((a.double().cpu() - ref).abs().max() / ref.abs().max()).item()


def _alone_batched_and_float64(pl, case: Case, tiles, name: str) -> dict:
    """`{name}_alone_vs_batched_bitwise` (each row alone = the same row in the batch) and `{name}_vs_float64`
    for the staged form under `tiles`."""
    out = pl.loop_staged(*case.args(), tiles=tiles)
    rows = case.state.shape[0]
    alone = [pl.loop_staged(*case.rows([r]).args(), tiles=tiles) for r in range(rows)]
    err = rel_err(out, reference_loop(case)[0])
    return {
        f"{name}_alone_vs_batched_bitwise": [
            all(torch.equal(alone[r][0], out[r]) for r in range(rows)),
            None,
        ],
        f"{name}_vs_float64": [err < 0.05, err],
    }


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels import persistent_loop as pl

    gen = torch.Generator().manual_seed(7)
    res: dict = {}
    tiles = pl.LoopTiles(programs=5, block_k=32, split_keys=8)
    for name, heads in (("mha", (4, 4, 16)), ("gqa", (4, 2, 16))):
        case = make_case(gen, heads, 64, 48, 2, [11, 3, 17])
        kc, vc = case.k_cache.clone(), case.v_cache.clone()
        out = pl.loop_staged(*case.args(kc, vc), tiles=tiles)
        ref, ref_k, ref_v = reference_loop(case)
        got_k, got_v = written_rows(case, kc, vc)
        errs = [rel_err(out, ref), rel_err(got_k, ref_k), rel_err(got_v, ref_v)]
        res[f"{name}_vs_float64"] = [max(errs) < 0.05, errs]
        again = pl.loop_staged(*case.args(), tiles=tiles)
        res[f"{name}_repeat_bitwise"] = [torch.equal(out, again), None]
        alone = [pl.loop_staged(*case.rows([r]).args(), tiles=tiles) for r in range(3)]
        res[f"{name}_alone_vs_batched_bitwise"] = [
            all(torch.equal(alone[r][0], out[r]) for r in range(3)),
            None,
        ]
        other_grid = pl.loop_staged(*case.args(), tiles=pl.LoopTiles(programs=3, block_k=32, split_keys=8))
        res[f"{name}_grid_independent"] = [torch.equal(out, other_grid), None]
        in_flight = [
            pl.loop_staged(
                *case.args(), tiles=pl.LoopTiles(programs=5, block_k=32, split_keys=8, lookahead=look)
            )
            for look in (1, 2, 3)
        ]
        res[f"{name}_tiles_in_flight_independent"] = [all(torch.equal(out, o) for o in in_flight), None]
        untouched = kc.clone()
        for r in range(3):
            for layer in range(2):
                untouched[int(case.write_entry[r]) + layer, int(case.write_offset[r])] = case.k_cache[
                    int(case.write_entry[r]) + layer, int(case.write_offset[r])
                ]
        res[f"{name}_writes_only_its_slots"] = [torch.equal(untouched, case.k_cache), None]
    # the persistent form itself (one program: the interpreter runs programs one after another): its ring of
    # tiles in flight carries items across stages and layers, where each staged launch refills it
    case = make_case(gen, (4, 2, 16), 64, 48, 2, [11, 3, 17])
    staged = pl.loop_staged(*case.args(), tiles=pl.LoopTiles(programs=1, block_k=32, split_keys=8))
    agree = []
    for look in (1, 2, 3):
        kc, vc = case.k_cache.clone(), case.v_cache.clone()
        one = pl.LoopTiles(programs=1, block_k=32, split_keys=8, lookahead=look)
        persistent = pl.loop_persistent(*case.args(kc, vc), tiles=one)
        kc2, vc2 = case.k_cache.clone(), case.v_cache.clone()
        pl.loop_staged(*case.args(kc2, vc2), tiles=one)
        agree.append(torch.equal(persistent, staged) and torch.equal(kc, kc2) and torch.equal(vc, vc2))
    res["persistent_one_program_equals_staged"] = [all(agree), agree]
    # one K tile per unit (block_k >= every K): one row takes x once per stage, not once per item
    case = make_case(gen, (4, 4, 16), 64, 48, 2, [11, 3])
    one_tile = pl.LoopTiles(programs=5, block_k=64, split_keys=8)
    res.update(_alone_batched_and_float64(pl, case, one_tile, "one_k_tile"))
    # every row's sums of an item in one reduction (`joint_rows`): the same per-row contract
    case = make_case(gen, (4, 2, 16), 64, 48, 2, [11, 3, 17])
    joint = pl.LoopTiles(programs=5, block_k=32, split_keys=8, joint_rows=True)
    res.update(_alone_batched_and_float64(pl, case, joint, "joint_rows"))
    one = pl.LoopTiles(programs=1, block_k=32, split_keys=8, lookahead=2, joint_rows=True)
    res["joint_rows_persistent_equals_staged"] = [
        torch.equal(pl.loop_persistent(*case.args(), tiles=one), pl.loop_staged(*case.args(), tiles=one)),
        None,
    ]
    case = make_case(gen, (4, 4, 16), 64, 48, 2, [6, 9])
    padded = case.rows([0, 1])
    padded.write_entry = torch.tensor([case.write_entry[0].item(), -1])
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = pl.loop_staged(*padded.args(kc, vc), tiles=tiles)
    row1 = int(case.write_entry[1]), int(case.write_offset[1])
    res["padding_row_writes_no_cache"] = [
        torch.equal(kc[row1[0] : row1[0] + 2, row1[1]], case.k_cache[row1[0] : row1[0] + 2, row1[1]])
        and torch.equal(out[0], pl.loop_staged(*case.rows([0]).args(), tiles=tiles)[0]),
        None,
    ]
    counters = [
        int(ws.tickets.abs().sum()) + int(ws.barrier[:2].abs().sum()) for ws in pl._WORKSPACES.values()
    ]
    res["counters_back_at_zero"] = [all(c == 0 for c in counters) and len(counters) > 0, counters]
    return res


cpu_results = interpreted_results_fixture("tests.engine.kernels.test_persistent_loop")

CPU_CHECKS = [
    f"{heads}_{name}"
    for heads in ("mha", "gqa")
    for name in (
        "vs_float64",
        "repeat_bitwise",
        "alone_vs_batched_bitwise",
        "grid_independent",
        "tiles_in_flight_independent",
        "writes_only_its_slots",
    )
] + [
    "persistent_one_program_equals_staged",
    "one_k_tile_alone_vs_batched_bitwise",
    "one_k_tile_vs_float64",
    "joint_rows_alone_vs_batched_bitwise",
    "joint_rows_vs_float64",
    "joint_rows_persistent_equals_staged",
    "padding_row_writes_no_cache",
    "counters_back_at_zero",
]


@pytest.mark.parametrize("check", CPU_CHECKS)
def test_interpreted_persistent_loop(cpu_results, check):
    ok, detail = cpu_results[check]
    assert ok, f"{check}: {detail}"


# ------------------------------------------------------------------------------------------------- GPU

OURO = dict(heads=(16, 16, 128), hidden=2048, inter=5632)


def _ouro_case(layers: int, ctx_lens: list[int], seed: int = 5) -> Case:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return make_case(
        gen, OURO["heads"], OURO["hidden"], OURO["inter"], layers, ctx_lens, page=16, device="cuda"
    )


@gpu
@pytest.mark.parametrize("rows, joint", [(1, False), (3, False), (8, False), (3, True), (8, True)])
def test_persistent_equals_staged_and_float64_at_ouro_shapes(rows, joint):
    from looptrace.engine.kernels import persistent_loop as pl

    tiles = pl.LoopTiles(joint_rows=joint)
    case = _ouro_case(4, [300 + 97 * i for i in range(rows)])
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = pl.loop_persistent(*case.args(kc, vc), tiles=tiles)
    kc2, vc2 = case.k_cache.clone(), case.v_cache.clone()
    staged = pl.loop_staged(*case.args(kc2, vc2), tiles=tiles)
    assert torch.equal(out, staged) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    ref, ref_k, ref_v = reference_loop(case)
    got_k, got_v = written_rows(case, kc, vc)
    assert rel_err(out, ref) < 0.05 and rel_err(got_k, ref_k) < 0.02 and rel_err(got_v, ref_v) < 0.02
    assert pl.barrier_timeouts() == 0


@gpu
@pytest.mark.parametrize("joint", [False, True])
def test_persistent_loop_repeats_replays_and_keeps_a_rows_bits_in_any_batch(joint):
    from looptrace.engine.kernels import persistent_loop as pl

    tiles = pl.LoopTiles(joint_rows=joint)
    case = _ouro_case(2, [512, 77, 1000])
    out = pl.loop_persistent(*case.args(), tiles=tiles)
    assert all(torch.equal(out, pl.loop_persistent(*case.args(), tiles=tiles)) for _ in range(3))
    alone = [pl.loop_persistent(*case.rows([r]).args(), tiles=tiles) for r in range(3)]
    assert all(torch.equal(alone[r][0], out[r]) for r in range(3))
    assert torch.equal(pl.loop_persistent(*case.rows([2, 0]).args(), tiles=tiles), out[[2, 0]])
    args = case.args()
    pl.loop_persistent(*args, tiles=tiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pl.loop_persistent(*args, tiles=tiles)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)
    assert pl.barrier_timeouts() == 0


@gpu
def test_fast_decodes_through_the_persistent_loop_and_repeats_its_tokens(monkeypatch):
    """`fast` + the persistent loop on Ouro-1.4B's shapes (4 layers): the setting is active, a one-row
    decode batch goes through it (seen when its graph is captured) and a three-row batch does not
    (`PersistentLoop.max_rows`), and a request's greedy tokens repeat."""
    from looptrace.engine import LLMEngine, SamplingParams
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.model_config import resolve_preset, with_overrides
    from looptrace.recipes import load_recipe

    rows_seen: list[int] = []
    real = pl.loop_persistent

    def spy(state, *args, **kwargs):
        rows_seen.append(state.shape[0])
        return real(state, *args, **kwargs)

    monkeypatch.setattr(pl, "loop_persistent", spy)
    spec = with_overrides(resolve_preset("ouro-1.4b", "cuda"), n_core=4)
    # no prefix cache: a second prefill of the same prompt would compute only the uncached rows, other GEMM
    # shapes (R1), and with random weights a near tie flips the first token (measured on the H100)
    sets = ["kernels.persistent_loop=true", "kv.prefix_caching=false"]
    sets += ["scheduler.max_model_len=512", "kv.num_blocks=1024"]
    cfg = load_recipe("fast", sets).config
    engine = LLMEngine.from_spec(spec, cfg, device="cuda", seed=1)
    assert "kernels.persistent_loop" not in engine.inactive_settings
    prompts = [[3 + j for j in range(40)], [7 + j for j in range(21)], [11 + j for j in range(33)]]
    params = SamplingParams(max_tokens=8)
    first = engine.generate(prompts[:1], params)
    assert engine.generate(prompts[:1], params) == first
    engine.generate(prompts, params)
    assert 1 in rows_seen and 3 not in rows_seen
    assert pl.barrier_timeouts() == 0


@pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")
def test_the_engine_sends_one_row_loops_through_the_launch():
    """`PersistentLoop.fits`: a one-row decode loop the kernel takes goes through the launch; the same rows
    two at a time (which the kernel itself takes, `loop_fusable`) and packed prefill rows do not."""
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.layers import AttnContext
    from looptrace.engine.models.ouro import PersistentLoop

    case = make_case(torch.Generator().manual_seed(3), (4, 2, 16), 64, 48, 2, [11, 3])

    def context(c: Case, packed=None) -> AttnContext:
        return AttnContext(c.k_cache, c.v_cache, c.write_entry, c.write_offset, c.tables, c.ctx_lens, c.cos,
                           c.sin, c.tables.shape[1], c.page, packed=packed)  # fmt: skip

    op = PersistentLoop(case.weights)
    one, two = case.rows([0]), case
    assert pl.loop_fusable(two.state, two.weights, two.cos, two.sin, two.k_cache, two.v_cache, two.tables)
    assert op.fits(one.state, context(one))
    assert not op.fits(two.state, context(two))
    assert not op.fits(one.state, context(one, packed=object()))
    # what the op did with each decode row count, in words (prefill is not recorded)
    assert op.routes == {
        1: "one launch per loop (register form)",
        2: "layer by layer (2 rows: the engine sends the register form up to 1)",
    }
