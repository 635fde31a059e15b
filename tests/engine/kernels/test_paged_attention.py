"""Triton paged attention and K/V write (`looptrace.engine.kernels.paged_attention`).

CPU: the kernels run in the Triton interpreter in one child process (`TRITON_INTERPRET=1` must be set before
Triton decorates the kernels, so never in this process), in fp32, against a float64 dense softmax over the
gathered pages and against SDPA; batch invariance (a row alone, in another batch, with a wider table, with
poisoned padding: `torch.equal`); `write_kv` writes exactly the addressed slots. The child runs every check
and prints one JSON line; each test reads its entry.

GPU (`gpu` marker): bf16 at the Ouro (16/16/128) and Huginn (55/55/96) shapes and a GQA shape, R in
{1, 8, 64, 300}, contexts up to 700: float64 reference, SDPA, batch invariance bitwise, CUDA-graph replay ==
eager bitwise, write_kv exact. Split-KV segments (`EDGE_CONTEXTS`): contexts at the segment edges
(64, 1024, 1025) and beyond 1,024 keys (multi-tile segments: 1500, 4100) against float64 and SDPA; the same
request bitwise equal alone and at several positions inside batches of 1/8/64 rows with other contexts and
a wider table; graph replay == eager with contexts moved across the edges.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import interpreted_results_fixture

BS = 16
HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu


# ---------------------------------------------------------------------------------------------- helpers


def make_pool(num_blocks, num_layers, kv_heads, dim, dtype, device, gen):
    """Random K and V pools as entry views `[num_blocks * num_layers, BS, kv_heads, dim]`."""
    shape = (num_blocks * num_layers, BS, kv_heads, dim)
    g = torch.Generator(device=device).manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    k = torch.randn(shape, generator=g, device=device).to(dtype)
    v = torch.randn(shape, generator=g, device=device).to(dtype)
    return k, v


def make_tables(ctx, width, num_blocks, num_layers, gen, device):
    """Entry bases `[R, width]` (-1 padded): each row's pages are distinct blocks in a scattered order."""
    pages = [math.ceil(c / BS) for c in ctx]
    assert sum(pages) <= num_blocks and max(pages, default=0) <= width
    perm = torch.randperm(num_blocks, generator=gen, device="cpu").tolist()
    tables = torch.full((len(ctx), width), -1, dtype=torch.int64)
    i = 0
    for r, n in enumerate(pages):
        tables[r, :n] = torch.tensor(perm[i : i + n]) * num_layers
        i += n
    return tables.to(device)


def gather(cache, tables, ctx, layer_id, r):
    """Keys 0..ctx-1 of row r: `[ctx, kv_heads, D]`."""
    c = int(ctx[r])
    entries = tables[r, : math.ceil(c / BS)] + layer_id
    return cache[entries].reshape(-1, cache.shape[2], cache.shape[3])[:c]


def reference(q, kc, vc, tables, ctx, layer_id, scale):
    """Dense float64 softmax attention over each row's gathered pages; `[R, H * D]`; zeros for ctx 0."""
    rows, heads, dim = q.shape
    out = torch.zeros(rows, heads, dim, dtype=torch.float64, device=q.device)
    group = heads // kc.shape[2]
    for r in range(rows):
        if int(ctx[r]) == 0:
            continue
        k = gather(kc, tables, ctx, layer_id, r).double().repeat_interleave(group, dim=1)
        v = gather(vc, tables, ctx, layer_id, r).double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[r].double(), k) * scale
        out[r] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out.reshape(rows, heads * dim)


def sdpa(q, kc, vc, tables, ctx, layer_id, scale):
    """`F.scaled_dot_product_attention` in q's dtype on each row's gathered keys; `[R, H * D]`."""
    rows, heads, dim = q.shape
    out = torch.zeros(rows, heads, dim, dtype=q.dtype, device=q.device)
    group = heads // kc.shape[2]
    for r in range(rows):
        if int(ctx[r]) == 0:
            continue
        k = gather(kc, tables, ctx, layer_id, r).repeat_interleave(group, dim=1).transpose(0, 1)
        v = gather(vc, tables, ctx, layer_id, r).repeat_interleave(group, dim=1).transpose(0, 1)
        out[r] = F.scaled_dot_product_attention(q[r][:, None], k, v, scale=scale)[:, 0]
    return out.reshape(rows, heads * dim)


def widen(tables, extra):
    pad = torch.full((tables.shape[0], extra), -1, dtype=tables.dtype, device=tables.device)
    return torch.cat([tables, pad], dim=1)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def invariance_failures(pa, q, kc, vc, tables, ctx, layer_id, scale, gen, pool_blocks, num_layers):
    """Rows whose output is not bitwise the same in the batch, alone (table trimmed to its pages), with a
    wider table, and reversed among other rows that read other pages."""
    device, rows = q.device, q.shape[0]
    batch = pa.paged_attention(q, kc, vc, tables, ctx, layer_id, scale)
    wide = pa.paged_attention(q, kc, vc, widen(tables, 23), ctx, layer_id, scale)
    other_q = torch.randn(q.shape, generator=gen).to(device, q.dtype)
    other_tab = torch.randint(0, pool_blocks, (rows, tables.shape[1] + 5), generator=gen).to(device)
    other_ctx = torch.randint(1, 4 * BS + 1, (rows,), generator=gen).to(device)
    order = list(range(rows))[::-1]
    tab5 = widen(tables, 5)
    mixed_q = torch.stack([t for r in order for t in (q[r], other_q[r])])
    mixed_tab = torch.stack([t for r in order for t in (tab5[r], other_tab[r] * num_layers)])
    mixed_ctx = torch.stack([t for r in order for t in (ctx[r], other_ctx[r])])
    mixed = pa.paged_attention(mixed_q, kc, vc, mixed_tab, mixed_ctx, layer_id, scale)
    bad = []
    for r in range(rows):
        n = max(1, math.ceil(int(ctx[r]) / BS))
        alone = pa.paged_attention(
            q[r : r + 1], kc, vc, tables[r : r + 1, :n], ctx[r : r + 1], layer_id, scale
        )
        same = torch.equal(alone[0], batch[r]) and torch.equal(batch[r], wide[r])
        if not (same and torch.equal(batch[r], mixed[2 * order.index(r)])):
            bad.append(r)
    return bad


def poisoned_padding_equal(pa, q, kc, vc, tables, ctx, layer_id, scale):
    """Padding table entries pointing at a NaN page, and NaN in the slots past ctx of each row's last page,
    change nothing: keys past ctx are never read (rows must not share pages)."""
    base = pa.paged_attention(q, kc, vc, tables, ctx, layer_id, scale)
    nan = torch.full_like(kc[:1], float("nan"))
    kp, vp = torch.cat([kc, nan]), torch.cat([vc, nan])  # entry kc.shape[0]: NaN
    tab = tables.clone()
    tab[tab < 0] = kc.shape[0] - layer_id
    for r in range(q.shape[0]):
        c = int(ctx[r])
        if c % BS:
            e = int(tables[r, c // BS]) + layer_id
            kp[e, c % BS :] = float("nan")
            vp[e, c % BS :] = float("nan")
    out = pa.paged_attention(q, kp, vp, tab, ctx, layer_id, scale)
    return bool(torch.equal(out, base) and torch.isfinite(out).all())


def write_kv_case(pa, num_blocks, num_layers, kv_heads, dim, dtype, device, gen, layer_id):
    """write_kv vs index_put_ on a clone, K/V as strided slices of a fused QKV output; one padding row."""
    kc, vc = make_pool(num_blocks, num_layers, kv_heads, dim, dtype, device, gen)
    rows = 7
    qkv = torch.randn(rows, (2 + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    k = qkv[:, 2 * dim : (2 + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (2 + kv_heads) * dim :].view(rows, kv_heads, dim)
    blocks = torch.randperm(num_blocks, generator=gen)[:rows]
    went = (blocks * num_layers).to(device)
    went[3] = -1  # padding row: skipped
    woff = torch.randint(0, BS, (rows,), generator=gen).to(device)
    meta = torch.stack([went, woff], dim=1)  # strided columns, as in the engine's metadata tensor
    ek, ev = kc.clone(), vc.clone()
    keep = went >= 0
    ek[layer_id:].index_put_((went[keep], woff[keep]), k[keep])
    ev[layer_id:].index_put_((went[keep], woff[keep]), v[keep])
    pa.write_kv(k, v, kc, vc, meta[:, 0], meta[:, 1], layer_id)
    return bool(torch.equal(kc, ek) and torch.equal(vc, ev))


# ------------------------------------------------------------------------------ CPU (Triton interpreter)


def _splits():
    from looptrace.engine.kernels.paged_attention import SplitConfig

    return (SplitConfig(block_n=32, min_tiles=2), SplitConfig(block_n=128, num_warps=8),
            SplitConfig(block_n=32, max_segments=4, min_tiles=3),
            SplitConfig(block_n=32, min_tiles=2, num_warps=4, key_slots=True),
            SplitConfig(block_n=16, max_segments=4, min_tiles=3, num_warps=1, key_slots=True))  # fmt: skip


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels import paged_attention as pa

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(20260)
    res = {}
    cases = {  # name: (heads, kv_heads, dim, layer_id, num_layers, ctx, table width)
        "gqa_d96": (8, 2, 96, 2, 3, [1, 15, 16, 17, 300, 0], 22),
        "mha_d128": (4, 4, 128, 1, 2, [17, 0, 100, 1, 16, 15, 129, 256], 18),
        "mha_d96_layer0": (3, 3, 96, 0, 1, [100, 33, 1], 7),
    }
    for name, (heads, kv_heads, dim, layer_id, num_layers, ctx_list, width) in cases.items():
        pool_blocks = 40
        kc, vc = make_pool(pool_blocks, num_layers, kv_heads, dim, torch.float32, "cpu", gen)
        tables = make_tables(ctx_list, width, pool_blocks, num_layers, gen, "cpu")
        ctx = torch.tensor(ctx_list)
        q = torch.randn(len(ctx_list), heads, dim, generator=gen)
        scale = dim**-0.5
        out = pa.paged_attention(q, kc, vc, tables, ctx, layer_id, scale)
        ref = reference(q, kc, vc, tables, ctx, layer_id, scale)
        err = max_err(out, ref)
        res[f"{name}_vs_float64"] = [out.shape == ref.shape and err < 2e-6, err]
        err = max_err(out, sdpa(q, kc, vc, tables, ctx, layer_id, scale))
        res[f"{name}_vs_sdpa"] = [err < 1e-5, err]
        pad = [r for r, c in enumerate(ctx_list) if c == 0]
        res[f"{name}_padding_rows_zero"] = [bool((out[pad] == 0).all()), pad]
        bad = invariance_failures(pa, q, kc, vc, tables, ctx, layer_id, scale, gen, pool_blocks, num_layers)
        res[f"{name}_batch_invariant"] = [bad == [], bad]
        res[f"{name}_poisoned_padding"] = [
            poisoned_padding_equal(pa, q, kc, vc, tables, ctx, layer_id, scale),
            None,
        ]
        # other split policies the bench sweeps (`SplitConfig`): the same attention, another tiling
        args = (q, kc, vc, tables, ctx, layer_id, scale)
        errs = [max_err(pa.paged_attention(*args, c), ref) for c in _splits()]
        res[f"{name}_other_splits"] = [max(errs) < 2e-6, errs]
        # a step too big for one launch's scratch runs in row slices: the same bits
        slots = pa.segment_slots(width, BS, pa.split_for_head(dim))
        saved, pa.SCRATCH_BYTES = pa.SCRATCH_BYTES, 2 * heads * slots * (dim + 2) * 4  # 2 rows per launch
        try:
            sliced = pa.paged_attention(q, kc, vc, tables, ctx, layer_id, scale)
        finally:
            pa.SCRATCH_BYTES = saved
        res[f"{name}_row_slices"] = [bool(torch.equal(sliced, out)), None]
    res["write_kv_d96"] = [write_kv_case(pa, 12, 3, 2, 96, torch.float32, "cpu", gen, 2), None]
    res["write_kv_d128_layer0"] = [write_kv_case(pa, 12, 1, 3, 128, torch.float32, "cpu", gen, 0), None]
    # write then read: a row attends to the key it just wrote (the engine's per-layer order).
    kc, vc = make_pool(8, 2, 2, 96, torch.float32, "cpu", gen)
    k = torch.randn(1, 2, 96, generator=gen)
    v = torch.randn(1, 2, 96, generator=gen)
    tables = torch.tensor([[6, 2, -1]])  # entry bases of blocks 3 and 1 (2 layers)
    pa.write_kv(k, v, kc, vc, torch.tensor([2]), torch.tensor([4]), 1)
    q = torch.randn(1, 4, 96, generator=gen)
    out = pa.paged_attention(q, kc, vc, tables, torch.tensor([21]), 1, 96**-0.5)
    ref = reference(q, kc, vc, tables, torch.tensor([21]), 1, 96**-0.5)
    res["write_then_attend"] = [max_err(out, ref) < 2e-6 and torch.equal(kc[3, 4], k[0]), None]
    return res


cpu_results = interpreted_results_fixture("tests.engine.kernels.test_paged_attention")


CPU_CASES = ("gqa_d96", "mha_d128", "mha_d96_layer0")


@pytest.mark.parametrize("case", CPU_CASES)
def test_interpreted_matches_float64_reference(cpu_results, case):
    ok, err = cpu_results[f"{case}_vs_float64"]
    assert ok, f"max abs error {err}"


@pytest.mark.parametrize("case", CPU_CASES)
def test_interpreted_matches_sdpa(cpu_results, case):
    ok, err = cpu_results[f"{case}_vs_sdpa"]
    assert ok, f"max abs error {err}"


@pytest.mark.parametrize("case", CPU_CASES)
def test_interpreted_padding_rows_are_zero(cpu_results, case):
    assert cpu_results[f"{case}_padding_rows_zero"][0]


@pytest.mark.parametrize("case", CPU_CASES)
def test_interpreted_batch_invariance(cpu_results, case):
    ok, bad = cpu_results[f"{case}_batch_invariant"]
    assert ok, f"rows {bad} differ alone / in another batch / with a wider table"


@pytest.mark.parametrize("case", CPU_CASES)
def test_interpreted_other_split_configs_match_float64(cpu_results, case):
    ok, errs = cpu_results[f"{case}_other_splits"]
    assert ok, f"max abs errors {errs}"


@pytest.mark.parametrize("case", CPU_CASES)
def test_interpreted_rows_beyond_one_launchs_scratch_run_in_slices(cpu_results, case):
    """H200, base at Ouro 2048/64 C=32: a 65,536-row prefill step asked 8 GiB of partials (OOM) and its
    65,536 rows overflowed grid axis 2 ('invalid argument'); rows are now axis 0 and launches slice them."""
    assert cpu_results[f"{case}_row_slices"][0]


@pytest.mark.parametrize("case", CPU_CASES)
def test_interpreted_never_reads_padding(cpu_results, case):
    assert cpu_results[f"{case}_poisoned_padding"][0]


@pytest.mark.parametrize("case", ["write_kv_d96", "write_kv_d128_layer0", "write_then_attend"])
def test_interpreted_write_kv(cpu_results, case):
    assert cpu_results[case][0]


# --------------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = {"ouro": (16, 16, 128), "huginn": (55, 55, 96), "gqa": (16, 4, 128)}
GPU_ROWS = (1, 8, 64, 300)


def _gpu_case(shape, rows, seed, max_ctx=700, num_layers=2, layer_id=1):
    heads, kv_heads, dim = GPU_SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    ctx_list = torch.randint(1, max_ctx + 1, (rows,), generator=gen).tolist()
    if rows >= 8:
        ctx_list[1], ctx_list[2], ctx_list[3] = 0, 1, 16  # a padding row and page edges
    width = math.ceil(max_ctx / BS) + 3
    pool_blocks = sum(math.ceil(c / BS) for c in ctx_list) + 8
    kc, vc = make_pool(pool_blocks, num_layers, kv_heads, dim, torch.bfloat16, "cuda", gen)
    tables = make_tables(ctx_list, width, pool_blocks, num_layers, gen, "cuda")
    ctx = torch.tensor(ctx_list, device="cuda")
    q = torch.randn(rows, heads, dim, generator=gen).to("cuda", torch.bfloat16)
    return q, kc, vc, tables, ctx, layer_id, dim**-0.5, pool_blocks, num_layers


@gpu
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_bf16_matches_references(shape, rows):
    from looptrace.engine.kernels import paged_attention as pa

    q, kc, vc, tables, ctx, layer_id, scale, _, _ = _gpu_case(shape, rows, seed=rows)
    out = pa.paged_attention(q, kc, vc, tables, ctx, layer_id, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, q.shape[1] * q.shape[2])
    ref = reference(q, kc, vc, tables, ctx, layer_id, scale)
    # Inputs are bf16 (exact in fp32); the error is the fp32 softmax plus one bf16 rounding of the output.
    assert torch.allclose(out.double(), ref, atol=2e-3, rtol=8e-3), max_err(out, ref)
    ref_sdpa = sdpa(q, kc, vc, tables, ctx, layer_id, scale)
    assert torch.allclose(out.float(), ref_sdpa.float(), atol=2e-2, rtol=2e-2), max_err(out, ref_sdpa)
    assert (out[ctx == 0] == 0).all()


@gpu
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_batch_invariance_bitwise(shape, rows):
    from looptrace.engine.kernels import paged_attention as pa

    q, kc, vc, tables, ctx, layer_id, scale, blocks, layers = _gpu_case(shape, rows, seed=100 + rows)
    gen = torch.Generator().manual_seed(rows)
    sel = sorted({0, rows // 2, rows - 1})
    bad = invariance_failures(pa, q[sel], kc, vc, tables[sel], ctx[sel], layer_id, scale, gen, blocks, layers)
    assert bad == []
    batch = pa.paged_attention(q, kc, vc, tables, ctx, layer_id, scale)
    for r in sel:  # each selected row alone == inside the full batch of `rows`
        n = max(1, math.ceil(int(ctx[r]) / BS))
        alone = pa.paged_attention(
            q[r : r + 1], kc, vc, tables[r : r + 1, :n], ctx[r : r + 1], layer_id, scale
        )
        assert torch.equal(alone[0], batch[r]), r
    assert poisoned_padding_equal(pa, q, kc, vc, tables, ctx, layer_id, scale)


@gpu
@pytest.mark.parametrize("rows", (1, 64))
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_graph_replay_equals_eager(shape, rows):
    """Capture write_kv + attention once; replay on new rows, contexts and tables == eager, bitwise."""
    from looptrace.engine.kernels import paged_attention as pa

    q, kc, vc, tables, ctx, layer_id, scale, _, _ = _gpu_case(shape, rows, seed=7)
    kv_heads, dim = kc.shape[2], kc.shape[3]
    gen = torch.Generator().manual_seed(3)
    s_q, s_tab, s_ctx = q.clone(), tables.clone(), ctx.clone()
    s_k = torch.randn(rows, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    s_v = torch.randn(rows, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    s_went, s_woff = tables[:, 0].clone(), torch.zeros(rows, dtype=torch.int64, device="cuda")

    def step():
        pa.write_kv(s_k, s_v, kc, vc, s_went, s_woff, layer_id)
        return pa.paged_attention(s_q, kc, vc, s_tab, s_ctx, layer_id, scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_out = step()
    for trial in range(3):
        perm = torch.randperm(rows, generator=gen).to("cuda")
        s_q.normal_()
        s_tab.copy_(tables[perm])
        s_ctx.copy_((ctx[perm] - torch.randint(0, BS, (rows,), generator=gen).to("cuda")).clamp_min(0))
        s_went.copy_(tables[perm, 0])
        s_woff.random_(0, BS)
        s_k.normal_()
        s_v.normal_()
        kc_before, vc_before = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        replay_out, kc_graph, vc_graph = s_out.clone(), kc.clone(), vc.clone()
        kc.copy_(kc_before)
        vc.copy_(vc_before)
        eager = step()
        assert torch.equal(replay_out, eager), trial
        assert torch.equal(kc_graph, kc) and torch.equal(vc_graph, vc), trial


@gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_write_kv_exact(shape):
    from looptrace.engine.kernels import paged_attention as pa

    _, kv_heads, dim = GPU_SHAPES[shape]
    gen = torch.Generator().manual_seed(11)
    for layer_id in (0, 2):
        assert write_kv_case(pa, 40, 3, kv_heads, dim, torch.bfloat16, "cuda", gen, layer_id)


# ------------------------------------------------------------------ GPU: split-KV segments

# Contexts at and across the segment rules (`paged_attention.segment_keys`; Ouro: 32-key tiles, segments of
# at least 2 tiles, Huginn: 64-key one-tile segments; at most 16): one segment (63, 64), two (65), exactly
# 16 shortest segments (1024), the first longer segments (1025),
# multi-tile segments (1500: 2 x 64 keys each; 4100: 5 tiles each, a ragged last segment) and a padding row.
EDGE_CONTEXTS = (63, 64, 65, 1024, 1025, 1500, 4100, 1, 0)


def _context_case(shape, ctx_list, seed, num_layers=2, layer_id=1, spare_pages=8):
    """Inputs for the given contexts (distinct pages per row, table width of the longest row + 3)."""
    heads, kv_heads, dim = GPU_SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    width = math.ceil(max(ctx_list) / BS) + 3
    pool_blocks = sum(math.ceil(c / BS) for c in ctx_list) + spare_pages
    kc, vc = make_pool(pool_blocks, num_layers, kv_heads, dim, torch.bfloat16, "cuda", gen)
    tables = make_tables(ctx_list, width, pool_blocks, num_layers, gen, "cuda")
    ctx = torch.tensor(ctx_list, device="cuda")
    q = torch.randn(len(ctx_list), heads, dim, generator=gen).to("cuda", torch.bfloat16)
    return q, kc, vc, tables, ctx, layer_id, dim**-0.5, pool_blocks, num_layers


def test_edge_contexts_cover_the_segment_rules():
    from looptrace.engine.kernels import paged_attention as pa

    if not HAS_TRITON:
        pytest.skip("triton not importable")
    segs = {c: (pa.segment_count(c), pa.segment_keys(c)) for c in EDGE_CONTEXTS if c}
    assert segs[64] == (1, 64) and segs[65] == (2, 64) and segs[1024] == (16, 64)
    assert segs[1025] == (11, 96) and segs[1500] == (16, 96) and segs[4100] == (15, 288)
    huginn = pa.split_for_head(96)  # Ouro's 32-key tiles in two-tile segments (key slots): the same edges
    assert [pa.segment_count(c, huginn) for c in (64, 65, 1024, 1025)] == [1, 2, 16, 11]
    old_huginn = pa.SplitConfig(block_n=64, min_tiles=1)  # sessions 2-4: 64-key one-tile segments
    assert [pa.segment_count(c, old_huginn) for c in (64, 65, 1024, 1025)] == [1, 2, 16, 9]


@gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_long_and_segment_edge_contexts_match_references(shape):
    from looptrace.engine.kernels import paged_attention as pa

    q, kc, vc, tables, ctx, layer_id, scale, _, _ = _context_case(shape, list(EDGE_CONTEXTS), seed=41)
    out = pa.paged_attention(q, kc, vc, tables, ctx, layer_id, scale)
    ref = reference(q, kc, vc, tables, ctx, layer_id, scale)
    for r, c in enumerate(EDGE_CONTEXTS):  # per row, so a failure names the context
        assert torch.allclose(out[r].double(), ref[r], atol=2e-3, rtol=8e-3), (c, max_err(out[r], ref[r]))
    ref_sdpa = sdpa(q, kc, vc, tables, ctx, layer_id, scale)
    assert torch.allclose(out.float(), ref_sdpa.float(), atol=2e-2, rtol=2e-2), max_err(out, ref_sdpa)
    assert (out[ctx == 0] == 0).all()
    assert poisoned_padding_equal(pa, q, kc, vc, tables, ctx, layer_id, scale)


def _embedded(q, tables, ctx, r, batch, at, gen, pool_blocks, num_layers, extra_width):
    """A batch of `batch` rows holding row r of (q, tables, ctx) at index `at`; the other rows read random
    pages with random contexts up to the table width (wider than row r's table by `extra_width`)."""
    width = tables.shape[1] + extra_width
    other_q = torch.randn((batch, *q.shape[1:]), generator=gen).to(q.device, q.dtype)
    other_tab = (torch.randint(0, pool_blocks, (batch, width), generator=gen) * num_layers).to(q.device)
    other_ctx = torch.randint(0, width * BS + 1, (batch,), generator=gen).to(q.device)
    other_q[at], other_ctx[at] = q[r], ctx[r]
    other_tab[at] = widen(tables[r : r + 1], extra_width)[0]
    return other_q, other_tab, other_ctx


@gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_request_is_bitwise_the_same_alone_and_in_batches_of_1_8_64(shape):
    """The R0 claim of the split-KV kernel: a request's output does not depend on the batch it is in (its
    position, the batch size, the batch-mates' contexts and the table width)."""
    from looptrace.engine.kernels import paged_attention as pa

    contexts = [c for c in EDGE_CONTEXTS if c]
    q, kc, vc, tables, ctx, layer_id, scale, blocks, layers = _context_case(shape, contexts, seed=42)
    gen = torch.Generator().manual_seed(43)
    bad = []
    for r, c in enumerate(contexts):
        n = math.ceil(c / BS)
        alone = pa.paged_attention(
            q[r : r + 1], kc, vc, tables[r : r + 1, :n], ctx[r : r + 1], layer_id, scale
        )
        for batch in (1, 8, 64):
            for at in sorted({0, batch // 2, batch - 1}):
                bq, btab, bctx = _embedded(q, tables, ctx, r, batch, at, gen, blocks, layers, 5)
                out = pa.paged_attention(bq, kc, vc, btab, bctx, layer_id, scale)
                if not torch.equal(out[at], alone[0]):
                    bad.append((c, batch, at))
    assert bad == []


@gpu
@pytest.mark.parametrize("rows", (1, 8, 64))
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_graph_replay_equals_eager_across_segment_edges(shape, rows):
    """One graph captured at a 4,100-key table width; replays with contexts moved across the segment edges
    (1 .. 4,100 keys: one to thirteen segments, one to five tiles each) == eager, bitwise."""
    from looptrace.engine.kernels import paged_attention as pa

    base = [EDGE_CONTEXTS[i % len(EDGE_CONTEXTS)] for i in range(rows)]
    q, kc, vc, tables, ctx, layer_id, scale, blocks, layers = _context_case(shape, base, seed=44 + rows)
    gen = torch.Generator().manual_seed(45)
    s_q, s_tab, s_ctx = q.clone(), tables.clone(), ctx.clone()

    def step():
        return pa.paged_attention(s_q, kc, vc, s_tab, s_ctx, layer_id, scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_out = step()
    width_keys = tables.shape[1] * BS
    for trial in range(3):
        s_q.normal_()
        s_tab.copy_((torch.randint(0, blocks, tables.shape, generator=gen) * layers).to("cuda"))
        edges = torch.tensor(EDGE_CONTEXTS)[torch.randint(0, len(EDGE_CONTEXTS), (rows,), generator=gen)]
        s_ctx.copy_((edges + torch.randint(-1, 2, (rows,), generator=gen)).clamp(0, width_keys).to("cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(s_out.clone(), step()), trial


def test_segment_slots_cover_every_context_a_table_holds():
    """The grid's segment slots are the most segments of any row that fits the table. The count is not
    monotonic in the context (1,024 keys: 16 segments; 1,025: 9), so slots from the table's own width
    alone (70 pages = 1,120 keys -> 9) left a 1,000-key row's segments 9..15 unrun on the H200: no
    combine, and its ticket counter never back to zero."""
    from looptrace.engine.kernels import paged_attention as pa

    assert pa.segment_count(1000, pa.SplitConfig()) == 16 and pa.segment_slots(70, BS, pa.SplitConfig()) == 16
    configs = [pa.DEFAULT_SPLIT, pa.SplitConfig(), pa.SplitConfig(block_n=128, min_tiles=2),
               pa.SplitConfig(block_n=32, max_segments=8, min_tiles=4)]  # fmt: skip
    for cfg in configs:
        for width in range(1, 200):
            counts = [pa.segment_count(c, cfg) for c in range(1, width * BS + 1)]
            assert pa.segment_slots(width, BS, cfg) == max(counts), (cfg, width)


def test_a_65536_row_prefill_step_keeps_each_launchs_partials_bounded():
    """H200, base at Ouro 2048/64 C=32: one launch for 65,536 rows asked 8 GiB of partials (OOM)."""
    from looptrace.engine.kernels import paged_attention as pa

    slots = pa.segment_slots(2048 // BS, BS, pa.split_for_head(128))
    per = pa.rows_per_launch(65536, 16, slots, 128)
    assert slots == 16 and per < 65536 and per * 16 * slots * 130 * 4 <= pa.SCRATCH_BYTES
    assert pa.rows_per_launch(64, 16, 16, 128) == 64  # decode batches: one launch
    assert pa.rows_per_launch(65536, 16, 1, 128) == 65536  # no partials: one launch


def test_attn_slots_is_r3_switches_every_attention_op_and_is_inactive_off_triton():
    """`kernels.attn_slots` (R3, in `fast`): its variant goes onto every Triton paged-attention op;
    an engine without the Triton attention (CPU) reports the setting inactive, with the reason."""
    from looptrace.engine.assemble import install_variants
    from looptrace.engine.config import toggle_rung
    from looptrace.engine.layers import PagedAttention, TritonPagedAttention
    from tests.helpers import build_engine

    assert toggle_rung("kernels.attn_slots", False, True) == "R3"
    engine = build_engine("ouro-tiny", kernels__attn_slots=True)
    ops = [m for m in engine.model.modules() if isinstance(m, PagedAttention)]
    assert ops and not any(isinstance(op, TritonPagedAttention) for op in ops)  # CPU: the torch path
    assert "Triton attention" in engine.inactive_settings["kernels.attn_slots"]
    assert install_variants(engine.model, "kernels.attn_slots") == 0  # it refines the Triton path only
    assert install_variants(engine.model, "kernels.attention") == len(ops)
    assert install_variants(engine.model, "kernels.attn_slots") == len(ops) and all(
        op.key_slots for op in ops
    )


def test_attn_slots_takes_the_key_slot_form_for_one_row_launches_only():
    """Measured on the H200: the key-slot form is faster for one decode row and slower for 8-64 rows at
    Ouro's heads, so `kernels.attn_slots` applies it to launches of at most ONE_ROW_FORMS rows; Huginn's
    96-wide heads take it at any row count (their default split)."""
    from looptrace.engine.kernels import paged_attention as pa

    assert pa.ONE_ROW_FORMS == 1
    assert pa.launch_split(128, 1, key_slots=True).key_slots
    assert not pa.launch_split(128, 2, key_slots=True).key_slots
    assert not pa.launch_split(128, 1).key_slots
    assert pa.launch_split(96, 64).key_slots and pa.launch_split(96, 1, key_slots=True) == pa.launch_split(
        96, 8
    )
    same_tiles = pa.launch_split(128, 1, key_slots=True)
    assert (same_tiles.block_n, same_tiles.min_tiles, same_tiles.num_warps) == (
        32,
        2,
        2,
    )  # only the form differs
