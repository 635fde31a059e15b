"""The decode GEMV (`looptrace.engine.kernels.gemv`) and its toggle (`kernels.gemv`, recipe `fast`).

CPU: the kernel runs in the Triton interpreter in one child process (`TRITON_INTERPRET=1` must be set before
Triton decorates the kernel, so never in this process), on small shapes that reach every code path (split-K
with ragged and even K, tensor-core and CUDA-core products, N not a multiple of the tile, 3-D input), in fp32
and bf16, against float64 with the bound below; run-to-run bitwise; the split counters left at zero. In this
process: the fast recipe is exactloop + `kernels.gemv`, graded R3; an engine asking for `kernels.gemv` on CPU
changes nothing (and imports no Triton); the `GemvLinear` variants on a CPU model switch its projections
and leave every output bit unchanged (`linear` is `F.linear` off CUDA).

GPU (`gpu` marker): bf16 at the real projection shapes of Ouro-1.4B and Huginn-0125, M = 1..8, every tile
candidate at two shapes: float64 bound; CUDA-graph replay == eager bitwise; repeated calls bitwise equal.

Error bound (`bound`): the products of bf16 values are exact in fp32, the fp32 sum of K terms is within
`K * 2^-24 * sum|x_k w_k|` of the exact sum (the classic gamma_K bound), and the final rounding to the output
dtype adds `u_out * |y|` (u_out = 2^-24 for fp32, 2^-8 for bf16 round-to-nearest; the interpreter truncates
bf16, 2^-7). Checked with a factor 2 of slack on the sum term.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import ROOT, interpreted_results_fixture, tickets_left_zero

HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu


def bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype, interpreted: bool):
    """Elementwise bound on the error of `x @ w.T` summed in fp32, rounded once to out_dtype (module doc)."""
    k = x.shape[-1]
    magnitude = x.double().abs() @ w.double().abs().T
    u_out = 2.0**-24 if out_dtype == torch.float32 else 2.0 ** (-7 if interpreted else -8)
    return 2 * k * 2.0**-24 * magnitude + u_out * ref.abs()


def within_bound(y, x, w, interpreted: bool) -> tuple[bool, float]:
    """(all elements inside the bound, worst error / bound ratio)."""
    ref = x.double().reshape(-1, x.shape[-1]) @ w.double().T
    err = (y.double().reshape(ref.shape) - ref).abs()
    lim = bound(x.reshape(-1, x.shape[-1]), w, ref, y.dtype, interpreted)
    ratio = (err / lim.clamp_min(1e-300)).max().item()
    return bool((err <= lim).all()), ratio


# ------------------------------------------------------------------------------ CPU (Triton interpreter)

# name: (M, N, K, TileConfig kwargs or None for the table)
CPU_CASES = {
    "m1_table": (1, 40, 64, None),
    "m1_split_ragged_k": (1, 50, 100, dict(block_n=16, block_k=16, split_k=3)),
    "m3_cuda_cores_split": (3, 40, 96, dict(block_n=16, block_k=32, split_k=2)),
    "m2_dot_split3": (2, 33, 80, dict(block_n=16, block_k=32, split_k=3, dot=True)),
    "m8_dot_even_k": (8, 64, 128, dict(block_n=32, block_k=32, split_k=2, dot=True)),
    "m8_dot_x_first_split": (8, 64, 128, dict(block_n=32, block_k=32, split_k=2, dot=True, x_first=True)),
    "m3_dot_x_first_ragged": (3, 40, 80, dict(block_n=16, block_k=32, dot=True, x_first=True)),
    "m5_table_dot": (5, 24, 48, None),
    "m7_cuda_cores": (7, 20, 64, dict(block_n=16, block_k=16)),
}


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    gen = torch.Generator().manual_seed(22)
    res = {}
    for name, (m, n, k, kw) in CPU_CASES.items():
        cfg = gemv_tiles.TileConfig(**kw) if kw else None
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=gen).to(dtype)
            w = torch.randn(n, k, generator=gen).to(dtype)
            y = gemv_kernel.gemv(x, w, cfg)
            ok, ratio = within_bound(y, x, w, interpreted=True)
            tag = f"{name}_{str(dtype).split('.')[-1]}"
            res[f"{tag}_vs_float64"] = [ok and y.shape == (m, n) and y.dtype == dtype, ratio]
            res[f"{tag}_deterministic"] = [torch.equal(y, gemv_kernel.gemv(x, w, cfg)), None]
    x3 = torch.randn(2, 3, 64, generator=gen)
    w = torch.randn(24, 64, generator=gen)
    y3 = gemv_kernel.gemv(x3, w, gemv_tiles.TileConfig(block_n=16, block_k=16, split_k=2))
    res["three_d_input"] = [y3.shape == (2, 3, 24) and within_bound(y3, x3, w, True)[0], None]
    res["counters_left_zero"] = tickets_left_zero()
    return res


cpu_results = interpreted_results_fixture("tests.engine.kernels.gemv.test_kernel")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_interpreted_gemv_within_float64_bound(cpu_results, case, dtype):
    ok, ratio = cpu_results[f"{case}_{dtype}_vs_float64"]
    assert ok, f"worst error / bound = {ratio}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_interpreted_gemv_is_deterministic(cpu_results, case, dtype):
    assert cpu_results[f"{case}_{dtype}_deterministic"][0]


def test_interpreted_gemv_takes_leading_dims_and_leaves_counters_zero(cpu_results):
    assert cpu_results["three_d_input"][0]
    assert cpu_results["counters_left_zero"][0], cpu_results["counters_left_zero"][1]


# ------------------------------------------------------------------------------------ toggle and recipe


def test_fast_recipe_is_exactloop_plus_the_r3_gemv():
    from dataclasses import asdict

    from looptrace.engine.config import toggle_rung
    from looptrace.recipes import load_recipe

    fast, exact = load_recipe("fast").config, load_recipe("exactloop").config
    assert fast.kernels.gemv and not exact.kernels.gemv
    assert not fast.kernels.l2_prefetch  # measured slower on the H200 (bench/results/h200/decode-token/)
    assert fast.kernels.pdl and not exact.kernels.pdl  # R0; Table 2's exactloop was measured without it
    a, b = asdict(fast), asdict(exact)
    assert not (fast.kernels.gemv_silu or fast.kernels.gemv_norm)  # R0, measured slower (bench/results/)
    assert fast.kernels.gemv_preload and not exact.kernels.gemv_preload
    assert fast.kernels.attn_prefetch and not exact.kernels.attn_prefetch  # R0, under PDL only
    assert fast.kernels.attn_slots and not exact.kernels.attn_slots  # R3: one row faster, 8-64 rows slower
    assert fast.kernels.gemv_silu_out  # R0 output form (bench/results/README.md)
    assert not fast.kernels.gemv_norm_out  # R0, measured slower (bench/results/README.md)
    assert fast.kernels.gemv_rope_out and not exact.kernels.gemv_rope_out  # R0 (bench/results/README.md)
    assert not (exact.kernels.gemv_silu_out or exact.kernels.gemv_norm_out)
    assert not (fast.kernels.persistent_loop or exact.kernels.persistent_loop)  # R3, measured slower (H100)
    assert fast.kernels.persistent_loop_tma and not exact.kernels.persistent_loop_tma  # R3, one row faster
    fast_only = ("gemv", "l2_prefetch", "pdl", "gemv_silu", "gemv_norm", "gemv_preload", "attn_prefetch")
    fast_only += ("gemv_silu_out", "gemv_norm_out", "gemv_rope_out", "persistent_loop", "persistent_loop_tma")
    for key in (*fast_only, "attn_slots"):
        a["kernels"].pop(key)
        b["kernels"].pop(key)
    assert a == b
    assert toggle_rung("kernels.l2_prefetch", False, True) == "R0"
    assert toggle_rung("kernels.attn_prefetch", False, True) == "R0"
    assert toggle_rung("kernels.attn_slots", False, True) == "R3"
    assert toggle_rung("kernels.gemv", False, True) == "R3"


def test_an_engine_asking_for_the_gemv_on_cpu_leaves_its_model_untouched():
    """`kernels.gemv` on CPU: inactive in the plan, so `assemble` installs no `GemvLinear`; no module
    patched, Triton not imported."""
    code = (
        "import sys; from tests.helpers import build_engine; from looptrace.engine.layers import GemvLinear;"
        "e = build_engine('ouro-tiny', kernels__gemv=True); assert 'kernels.gemv' in e.inactive_settings;"
        "assert not any(isinstance(x, GemvLinear) for x in e.model.modules());"
        "assert not any('forward' in vars(x) or 'fused_linear' in vars(x) for x in e.model.modules());"
        "assert 'triton' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_the_gemv_variants_on_cpu_change_no_output_bit(preset):
    if not HAS_TRITON:
        pytest.skip("triton not importable")
    from looptrace.engine.assemble import install_variants
    from looptrace.engine.kernels.gemv.forms import linear
    from looptrace.engine.layers import GemvLinear
    from looptrace.engine.model_config import PRESETS
    from looptrace.engine.models import build_model

    torch.manual_seed(0)
    model = build_model(PRESETS[preset]).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {id(m): torch.randn(3, m.in_features) for m in linears}
    before = {id(m): m(x[id(m)]) for m in linears}
    switched = install_variants(model, "kernels.gemv")
    assert switched >= sum(m.bias is None for m in linears) > 0
    assert all(isinstance(m, GemvLinear) == (m.bias is None) for m in linears)
    for m in linears:
        assert torch.equal(m(x[id(m)]), before[id(m)])
    a, w = torch.randn(2, 16), torch.randn(8, 16)
    assert torch.equal(linear(a, w), F.linear(a, w))


def test_the_batch_variants_route_up_to_eight_rows_where_the_plain_ones_route_one(monkeypatch):
    """`kernels.gemv_batch` over `kernels.gemv`: the plain and the fused projections hand 2-8 rows to the
    GEMV too (one row only without it); 9 rows and more stay with `F.linear`. The GEMV's domain check is
    patched open and the GEMV recorded, so the routing is what is tested, on CPU."""
    if not HAS_TRITON:
        pytest.skip("triton not importable")
    from looptrace.engine.assemble import install_variants
    from looptrace.engine.kernels.gemv import forms, tiles
    from looptrace.engine.layers import GemvBatchLinear, GemvLinear
    from tests.helpers import build_engine

    routed = []
    monkeypatch.setattr(tiles, "supported", lambda x, w, b: b is None)
    monkeypatch.setattr(forms, "gemv", lambda x, w: routed.append(x.shape[0]) or F.linear(x, w))
    model = build_engine("ouro-tiny", kernels__fused_projections=True).model
    install_variants(model, "kernels.gemv")
    attn, head = model.model.layers[0].self_attn, model.lm_head
    rows_seen = {}
    for setting in (None, "kernels.gemv_batch"):
        if setting:
            assert install_variants(model, setting) > 0
        for rows in (1, 2, 8, 9):
            routed.clear()
            head(torch.randn(rows, head.in_features))
            attn.fused_linear(torch.randn(rows, attn.qkv.shape[1]), attn.qkv)
            rows_seen[setting, rows] = list(routed)
    assert isinstance(head, GemvBatchLinear) and isinstance(head, GemvLinear)
    assert rows_seen == {
        (None, 1): [1, 1], (None, 2): [], (None, 8): [], (None, 9): [],
        ("kernels.gemv_batch", 1): [1, 1], ("kernels.gemv_batch", 2): [2, 2],
        ("kernels.gemv_batch", 8): [8, 8], ("kernels.gemv_batch", 9): [],
    }  # fmt: skip


def test_a_shape_kept_on_cublas_routes_one_row_to_the_gemv_and_more_to_f_linear(monkeypatch):
    """`tiles.CUBLAS_MANY_ROWS`: under `kernels.gemv_batch` a listed projection shape takes the GEMV at one
    row only, and neither fused form takes its rows; other shapes still route 2-8 rows, fused forms too."""
    if not HAS_TRITON:
        pytest.skip("triton not importable")
    from looptrace.engine.kernels import gemv_rope
    from looptrace.engine.kernels.gemv import forms, tiles

    routed = []
    monkeypatch.setattr(tiles, "supported", lambda x, w, b: b is None)
    monkeypatch.setattr(
        forms, "gemv", lambda x, w: routed.append((tuple(w.shape), x.shape[0])) or F.linear(x, w)
    )
    # q/k/v weights of 64-wide heads: (2 + 2 x 1) x 64 rows kept on cuBLAS, (1 + 2 x 1) x 64 not
    kept, other = torch.randn(256, 32), torch.randn(192, 32)
    monkeypatch.setattr(tiles, "CUBLAS_MANY_ROWS", frozenset({(256, 32)}))
    batch = forms.route_rows(batch=True)
    for rows in (1, 4):
        for w in (kept, other):
            forms.linear(torch.randn(rows, 32), w, route_rows=batch)
    assert routed == [((256, 32), 1), ((192, 32), 1), ((192, 32), 4)]
    assert [tiles.takes_rows(rows, kept, batch) for rows in (0, 1, 2, 8)] == [False, True, False, False]
    assert [tiles.takes_rows(rows, other, batch) for rows in (1, 8, 9)] == [True, True, False]
    x4 = torch.randn(4, 32)
    assert [forms.gate_up_silu_fusable(x4, w, route_rows=batch) for w in (kept, other)] == [False, True]
    cos = sin = torch.ones(4, 64, dtype=torch.bfloat16)
    cache = torch.empty(2, 4, 1, 64)
    fusable = [gemv_rope.qkv_rope_fusable(x4, w, cos, sin, cache, cache, heads, route_rows=batch)
               for w, heads in ((kept, (2, 1, 64)), (other, (1, 1, 64)))]  # fmt: skip
    assert fusable == [False, True]


# --------------------------------------------------------------------------------------------------- GPU

# (N, K) of every projection: Ouro-1.4B (hidden 2048, 16 x 128 heads, intermediate 5632, vocab 49152) and
# Huginn-0125 (hidden 5280, 55 x 96 heads, intermediate 17920, vocab 65536, adapter 10560 -> 5280).
GPU_SHAPES = {
    "ouro_qkv": (6144, 2048),
    "ouro_o": (2048, 2048),
    "ouro_gate_up": (11264, 2048),
    "ouro_gate": (5632, 2048),
    "ouro_down": (2048, 5632),
    "ouro_lm_head": (49152, 2048),
    "huginn_qkv": (15840, 5280),
    "huginn_o": (5280, 5280),
    "huginn_fc": (35840, 5280),
    "huginn_down": (5280, 17920),
    "huginn_adapter": (5280, 10560),
    "huginn_lm_head": (65536, 5280),
}


def _gpu_inputs(n, k, m=8, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
    return x, w


@gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_gemv_within_float64_bound_for_1_to_8_rows(shape):
    from looptrace.engine.kernels.gemv.kernel import gemv
    from looptrace.engine.kernels.gemv.tiles import MAX_ROWS

    n, k = GPU_SHAPES[shape]
    x, w = _gpu_inputs(n, k)
    bad = {}
    for m in range(1, MAX_ROWS + 1):
        y = gemv(x[:m], w)
        ok, ratio = within_bound(y, x[:m], w, interpreted=False)
        if not ok or y.shape != (m, n) or y.dtype != torch.bfloat16:
            bad[m] = ratio
    assert bad == {}, f"rows: worst error / bound {bad}"


@gpu
@pytest.mark.parametrize("shape", ["ouro_o", "ouro_down", "huginn_qkv"])
def test_gpu_every_tile_candidate_is_correct(shape):
    from looptrace.engine.kernels.gemv.kernel import gemv
    from looptrace.engine.kernels.gemv.tiles import CANDIDATES, MANY_ROW_CANDIDATES

    n, k = GPU_SHAPES[shape]
    x, w = _gpu_inputs(n, k, seed=1)
    for cfg in CANDIDATES + MANY_ROW_CANDIDATES[::5]:
        for m in (1, 3, 8):
            ok, ratio = within_bound(gemv(x[:m], w, cfg), x[:m], w, interpreted=False)
            assert ok, (cfg, m, ratio)


@gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("shape", ["ouro_qkv", "ouro_down", "ouro_lm_head", "huginn_o"])
def test_gpu_graph_replay_equals_eager_and_runs_repeat_bitwise(shape, rows):
    from looptrace.engine.kernel_checks import in_graph
    from looptrace.engine.kernels.gemv.kernel import gemv

    n, k = GPU_SHAPES[shape]
    x, w = _gpu_inputs(n, k, seed=rows)
    s_x = x[:rows].clone()
    out, graph = in_graph(lambda: (gemv(s_x, w),))
    first = gemv(s_x, w)
    assert torch.equal(out[0], first)
    for _ in range(5):
        assert torch.equal(gemv(s_x, w), first)
    for trial in range(3):  # new inputs in the captured buffer: replay == eager on them
        s_x.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], gemv(s_x, w)), trial


@gpu
def test_gpu_linear_dispatch():
    from looptrace.engine.kernels.gemv.forms import linear
    from looptrace.engine.kernels.gemv.kernel import gemv

    x, w = _gpu_inputs(2048, 2048, m=9)
    assert torch.equal(linear(x[:1], w), gemv(x[:1], w))  # one row: the GEMV (ROUTE_ROWS)
    assert torch.equal(linear(x[:4], w), F.linear(x[:4], w))  # 2-8 rows: cuBLAS (faster there on the H200)
    assert torch.equal(linear(x, w), F.linear(x, w))  # 9 rows: cuBLAS
    assert torch.equal(linear(x[:4], w, route_rows=8), gemv(x[:4], w))  # kernels.gemv_batch: the GEMV
    b = torch.zeros(2048, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(linear(x[:1], w, b), F.linear(x[:1], w, b))  # a bias: cuBLAS


def test_fast_recipe_on_cpu_records_the_gemv_as_inactive():
    from tests.helpers import build_engine

    engine = build_engine("ouro-tiny", kernels__gemv=True)
    assert engine.inactive_settings["kernels.gemv"] == "the Triton GEMV runs only on CUDA with Triton"
