"""Triton packed prefill attention (`looptrace.engine.kernels.packed_attention`) and its block table.

CPU: the kernel runs in the Triton interpreter in one child process (as in test_paged_attention.py),
in fp32 (the interpreter's `tl.dot` multiplies the bit patterns of bf16 operands, triton-lang/triton#11584,
so bf16 is judged on the GPU only), against the float64 per-row reference and the per-row Triton kernel:
spans of 1, 2, 5, 16, 17, 33 and 40 rows (one block, block edges, several blocks), chunks that start after
cached keys, GQA and MHA, padding blocks, another layer; a row's output does not change when the other
spans' queries do.

GPU (`gpu` marker): bf16 at the Ouro (16/16/128) and Huginn (55/55/96) shapes against the float64
reference and the per-row kernel, and CUDA-graph replay == eager bitwise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from looptrace.engine import kernels as K
from tests.engine.kernels.test_paged_attention import BS, make_pool, max_err, reference
from tests.helpers import interpreted_results_fixture

gpu = pytest.mark.gpu


# ------------------------------------------------------------------------------------ block table (host)


def test_blocks_cut_each_span_into_runs_of_block_rows_then_pad():
    bm = K.PACKED_BLOCK_ROWS
    blocks = K.packed_blocks([1, bm + 1, 2 * bm], 6)
    assert blocks.tolist() == [[0, 1], [1, bm], [1 + bm, 1], [2 + bm, bm], [2 + 2 * bm, bm], [0, 0]]
    assert blocks.dtype == np.int64


def test_block_count_bounds_every_split_of_the_rows():
    bm = K.PACKED_BLOCK_ROWS
    rng = np.random.default_rng(0)
    for rows in (1, 2, bm - 1, bm, bm + 1, 128, 300):
        for spans in (1, 2, 3, 8):
            if spans > rows:
                continue
            count = K.packed_block_count(rows, spans)
            for _ in range(30):  # random splits of `rows` into `spans` lengths >= 1
                cuts = np.sort(rng.choice(np.arange(1, rows), spans - 1, replace=False)) if spans > 1 else []
                lengths = np.diff([0, *cuts, rows]).tolist()
                needed = sum(math.ceil(n / bm) for n in lengths)
                assert needed <= count <= rows
                K.packed_blocks(lengths, count)  # fits


def test_too_few_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="need more than 1 blocks"):
        K.packed_blocks([K.PACKED_BLOCK_ROWS + 1], 1)


# ---------------------------------------------------------------------------------------------- helpers


def packed_case(spans, heads, kv_heads, dim, num_layers, dtype, device, gen):
    """spans: [(first position, rows)], each a request whose rows are consecutive positions. Returns q,
    caches, per-row tables (each row's request table trimmed to the row's pages, -1 padded), ctx_lens and
    the row lengths of the spans."""
    need = [math.ceil((p0 + n) / BS) for p0, n in spans]
    pool_blocks = sum(need) + 4
    kc, vc = make_pool(pool_blocks, num_layers, kv_heads, dim, dtype, device, gen)
    perm = torch.randperm(pool_blocks, generator=gen).tolist()
    width = max(need) + 2
    tables, ctx, used = [], [], 0
    for (p0, n), pages in zip(spans, need, strict=True):
        request_table = [b * num_layers for b in perm[used : used + pages]]
        used += pages
        for pos in range(p0, p0 + n):
            own = math.ceil((pos + 1) / BS)
            tables.append(request_table[:own] + [-1] * (width - own))
            ctx.append(pos + 1)
    rows = len(ctx)
    q = torch.randn(rows, heads, dim, generator=gen).to(device, dtype)
    tables_t = torch.tensor(tables, dtype=torch.int64, device=device)
    return q, kc, vc, tables_t, torch.tensor(ctx, device=device), [n for _, n in spans]


def run_packed(pk, q, kc, vc, tables, ctx, lengths, layer_id, scale, max_spans=8):
    count = K.packed_block_count(q.shape[0], max_spans)
    blocks = torch.from_numpy(K.packed_blocks(lengths, count)).to(q.device)
    return pk.packed_attention(q, kc, vc, tables, ctx, blocks, layer_id, scale)


# ------------------------------------------------------------------------------ CPU (Triton interpreter)

CPU_CASES = {  # name: (heads, kv_heads, dim, num_layers, layer_id, spans)
    "mha_d128": (4, 4, 128, 2, 1, [(0, 5), (32, 17), (7, 1)]),
    "gqa_d96": (8, 2, 96, 3, 2, [(100, 40), (0, 16)]),
    "mha_d64_layer0": (2, 2, 64, 1, 0, [(15, 2), (64, 33)]),
}


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels import packed_attention as pk
    from looptrace.engine.kernels import paged_attention as pa

    gen = torch.Generator().manual_seed(7)
    res = {}
    for name, (heads, kv_heads, dim, layers, layer_id, spans) in CPU_CASES.items():
        q, kc, vc, tables, ctx, lengths = packed_case(
            spans, heads, kv_heads, dim, layers, torch.float32, "cpu", gen
        )
        scale = dim**-0.5
        out = run_packed(pk, q, kc, vc, tables, ctx, lengths, layer_id, scale)
        ref = reference(q, kc, vc, tables, ctx, layer_id, scale)
        res[f"{name}_vs_float64"] = [out.shape == ref.shape and max_err(out, ref) < 5e-6, max_err(out, ref)]
        per_row = pa.paged_attention(q, kc, vc, tables, ctx, layer_id, scale)
        res[f"{name}_vs_per_row"] = [max_err(out, per_row) < 5e-6, max_err(out, per_row)]
        # Rows of the first span do not depend on the other spans' queries; a second call is identical.
        other = q.clone()
        other[lengths[0] :] = torch.randn(other[lengths[0] :].shape, generator=gen)
        again = run_packed(pk, other, kc, vc, tables, ctx, lengths, layer_id, scale)
        first = slice(0, lengths[0])
        same = torch.equal(again[first], out[first]) and torch.equal(
            run_packed(pk, q, kc, vc, tables, ctx, lengths, layer_id, scale), out
        )
        res[f"{name}_independent_and_deterministic"] = [same, None]
    return res


cpu_results = interpreted_results_fixture("tests.engine.kernels.test_packed_attention")


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_interpreted_matches_float64_reference(cpu_results, case):
    ok, err = cpu_results[f"{case}_vs_float64"]
    assert ok, f"max abs error {err}"


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_interpreted_matches_the_per_row_kernel(cpu_results, case):
    ok, err = cpu_results[f"{case}_vs_per_row"]
    assert ok, f"max abs error {err}"


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_interpreted_rows_ignore_other_spans_and_repeat_exactly(cpu_results, case):
    assert cpu_results[f"{case}_independent_and_deterministic"][0]


# --------------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = {"ouro": (16, 16, 128), "huginn": (55, 55, 96)}
GPU_SPANS = {
    "one_chunk": [(0, 128)],
    "later_chunks": [(384, 128)],
    "mixed": [(0, 33), (256, 64), (5, 1), (600, 30)],
}


@gpu
@pytest.mark.parametrize("spans", sorted(GPU_SPANS))
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_bf16_matches_references(shape, spans):
    from looptrace.engine.kernels import packed_attention as pk
    from looptrace.engine.kernels import paged_attention as pa

    heads, kv_heads, dim = GPU_SHAPES[shape]
    gen = torch.Generator().manual_seed(len(spans) + dim)
    q, kc, vc, tables, ctx, lengths = packed_case(
        GPU_SPANS[spans], heads, kv_heads, dim, 2, torch.bfloat16, "cuda", gen
    )
    scale = dim**-0.5
    out = run_packed(pk, q, kc, vc, tables, ctx, lengths, 1, scale)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = reference(q, kc, vc, tables, ctx, 1, scale)
    # bf16 q.k products and p rounded to bf16 for p @ v (FlashAttention's arithmetic): R3, not bitwise.
    assert torch.allclose(out.double(), ref, atol=1e-2, rtol=2e-2), max_err(out, ref)
    per_row = pa.paged_attention(q, kc, vc, tables, ctx, 1, scale)
    assert torch.allclose(out.float(), per_row.float(), atol=1e-2, rtol=2e-2), max_err(out, per_row)


@gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_graph_replay_equals_eager_bitwise(shape):
    from looptrace.engine.kernels import packed_attention as pk

    heads, kv_heads, dim = GPU_SHAPES[shape]
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, tables, ctx, lengths = packed_case(
        GPU_SPANS["mixed"], heads, kv_heads, dim, 2, torch.bfloat16, "cuda", gen
    )
    count = K.packed_block_count(q.shape[0], 8)
    blocks = torch.from_numpy(K.packed_blocks(lengths, count)).cuda()
    eager = pk.packed_attention(q, kc, vc, tables, ctx, blocks, 1, dim**-0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = pk.packed_attention(q, kc, vc, tables, ctx, blocks, 1, dim**-0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)
