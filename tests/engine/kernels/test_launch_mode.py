"""`kernels.pdl` (R0): the engine's Triton kernels launched as programmatic dependents.

CPU: the launch mode's scope (`launch_mode`); every Triton kernel of the engine takes the `PDL` constexpr
and opens with the PDL preamble before anything else (checked on the source, so a new kernel or a load
moved above the wait fails here); the PTX compiled for sm_90 orders `launch_dependents` < the GEMV's weight
prefetch < `wait` < the first global access, and holds no `griddepcontrol` without PDL; the engine on CPU
records the setting as inactive. GPU (`gpu` marker): a chain of the real kernels captured as one CUDA graph
under PDL computes bit for bit what it computes eagerly without it (cuBLAS and GEMV projections, 1 and 4
rows), and the `fast` recipe with `kernels.pdl` generates the same tokens as without it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from looptrace.engine.kernels import launch_mode
from tests.helpers import ROOT

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")
KERNELS_DIR = ROOT / "looptrace" / "engine" / "kernels"
# The prefetch experiment's kernel writes nothing and reads only weights: it needs no wait.
NOT_IN_CHAIN = {"_prefetch_kernel"}


def test_the_launch_mode_is_scoped_and_off_by_default():
    assert launch_mode.pdl_args() == {"PDL": False} and not launch_mode.active()
    with launch_mode.dependent_launches(True):
        assert launch_mode.pdl_args() == {"PDL": True, "launch_pdl": True}
        with launch_mode.dependent_launches(False):
            assert launch_mode.pdl_args() == {"PDL": False}
        assert launch_mode.active()
    assert launch_mode.pdl_args() == {"PDL": False}
    with pytest.raises(RuntimeError), launch_mode.dependent_launches(True):
        raise RuntimeError("a failed step")
    assert not launch_mode.active()  # restored on the way out of a failed step
    assert not launch_mode.supported("cpu")


def test_the_launch_plan_is_entered_per_scope_and_restored():
    plan = launch_mode.LaunchPlan(dependent=True, weight_preload=True, kv_prefetch=False)
    assert launch_mode.current() == launch_mode.LaunchPlan()
    with launch_mode.entered(plan):
        assert launch_mode.weight_preload() and not launch_mode.kv_prefetch()
        with launch_mode.entered(launch_mode.LaunchPlan(weight_preload=True)):
            assert launch_mode.current() == launch_mode.LaunchPlan()  # no preload without PDL
        assert launch_mode.current() == plan
    assert launch_mode.current() == launch_mode.LaunchPlan()


def _jit_kernels() -> list[tuple[Path, ast.FunctionDef]]:
    """Every `@triton.jit` function of the kernels package that is launched (its name ends in `_kernel`)."""
    out = []
    for path in sorted(KERNELS_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            launched = isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
            if launched and any("jit" in ast.unparse(d) for d in node.decorator_list):
                out.append((path, node))
    return out


def _calls(stmt: ast.stmt) -> list[str]:
    """The functions a statement calls, in order; a load through L2 only (`.cg`, the attention's reads of
    step metadata before its wait) is named `tl.load.cg`."""
    out = []
    for n in ast.walk(stmt):
        if isinstance(n, ast.Call):
            name = ast.unparse(n.func)
            cg = any(k.arg == "cache_modifier" and ast.unparse(k.value) == "'.cg'" for k in n.keywords)
            out.append(f"{name}.cg" if name == "tl.load" and cg else name)
    return out


def test_every_kernel_opens_with_the_pdl_preamble():
    """The wait must precede every global access of a kernel body: `await_inputs(PDL)` as the first call,
    or (the GEMV) `let_dependents_launch`, the weight prefetch, `wait_for_inputs` before any other call."""
    kernels = [(p, k) for p, k in _jit_kernels() if k.name not in NOT_IN_CHAIN]
    assert len(kernels) >= 12  # rmsnorm 4, rope 3, silu_mul, paged attention 2, packed attention, GEMV
    for path, kernel in kernels:
        params = [a.arg for a in kernel.args.args]
        assert "PDL" in params, f"{path.name}:{kernel.name} takes no PDL constexpr"
        calls = [c for stmt in kernel.body for c in _calls(stmt)]
        before_wait = calls[: calls.index("wait_for_inputs")] if "wait_for_inputs" in calls else None
        if before_wait is None:
            assert calls[:1] == ["await_inputs"], f"{path.name}:{kernel.name} starts with {calls[:3]}"
        else:  # only index math, the launch hint and the weight prefetch may come before the wait
            allowed = {"tl.program_id", "tl.arange", "let_dependents_launch", "_prefetch_slice"}
            allowed |= {"_weight_rows", "_pair_rows"}  # the GEMVs' row indices (index math only)
            allowed |= {"tl.zeros", "weight_tile"}  # the GEMV's weight preload (weights: never written)
            # the persistent loop's stream position (index math) and its first weight tiles (never written)
            allowed |= {"_item_counts", "_stage_start", "_fill_ring"}
            # the TMA-ring loop (Gluon): its layouts, shared memory and mbarriers, its stream's counts and the
            # ring's first fill (weights: never written)
            allowed |= {"gl.program_id", "gl.num_programs", "gl.BlockedLayout", "gl.SwizzledSharedLayout"}
            allowed |= {"gl.allocate_shared_memory", "mbarrier.MBarrierLayout", "xs._reinterpret"}
            allowed |= {"gl.static_range", "mbarrier.init", "bars.index", "empty.index", "fence_async_shared"}
            allowed |= {"gl.thread_barrier", "_share", "_issue"}
            # the attention's addressing and its K/V prefetch (kernels.attn_prefetch: hints only)
            allowed |= {"tl.program_id(0).to", "layer_id.to", "(head // GROUP).to", "_prefetch_segment"}
            assert set(before_wait) <= allowed, f"{path.name}:{kernel.name}: {before_wait} before the wait"


def _compile_sm90(fn, signature: dict, constexprs: dict, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


# The GEMV kernel's non-constexpr arguments of a plain launch (the fused forms add theirs)
GEMV_SIGNATURE = {
    "x_ptr": "*bf16",
    "w_ptr": "*bf16",
    "y_ptr": "*bf16",
    "part_ptr": "*fp32",
    "ticket_ptr": "*i32",
}
GEMV_SIGNATURE |= {"N": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}


def one_row_gemv(n: int, k: int, **more):
    """(tile config, constexprs) of the one-row GEMV launch `gemv` makes for W [n, k] (EVEN_K shapes)."""
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    cfg = gemv_tiles.pick_config(1, n, k)
    split, per_split = gemv_tiles.split_for(n, k, cfg)
    consts = dict(K=k, M=1, M_PAD=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_TILES=per_split,
                  SPLIT_K=split, EVEN_K=True, DOT=False, PRECISION="tf32")  # fmt: skip
    return cfg, consts | more


def fused_gemv_ptx(n: int, k: int, norm_width: int, one_split: bool = False, **consts) -> list[str]:
    """The sm_90 PTX lines of the one-row GEMV for W [n, k] in a fused form (`consts`: X_FORM or Y_FORM and
    what they change), compiled on the CPU with the forms' launch options under PDL; the norm constants are
    those of a row `norm_width` wide; `one_split`: K not split (the SiLU output form's launch)."""
    from looptrace.engine.kernels.device_helpers import EXACT_OPTIONS
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel
    from looptrace.engine.kernels.reduce_order import reduce_shape

    sig = GEMV_SIGNATURE | {
        name: "*bf16" for name in ("u_ptr", "res_ptr", "wy_ptr", "wn_ptr", "h_ptr", "x_out_ptr")
    }
    sig |= {"factor": "fp32", "eps_y": "fp32", "eps_n": "fp32"}
    shape = reduce_shape(1, norm_width)
    norm = dict(LANES=shape.lanes, VECS=shape.vectors_per_lane, DESC=True, CHUNK=2048)
    cfg, constexprs = one_row_gemv(n, k, PDL=True, PREFETCH=False, PRELOAD=0, **norm)
    if one_split:
        constexprs |= dict(K_TILES=k // cfg.block_k, SPLIT_K=1)
    constexprs |= consts
    compiled = _compile_sm90(
        gemv_kernel._gemv_kernel, sig, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=True, **EXACT_OPTIONS,
    )  # fmt: skip
    return compiled.asm["ptx"].splitlines()


def _first(ptx: list[str], pattern: str) -> int:
    hits = [i for i, line in enumerate(ptx) if re.search(pattern, line)]
    return hits[0] if hits else -1


@needs_triton
def test_sm90_gemv_ptx_waits_before_its_first_load_and_prefetches_before_waiting():
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    cfg, consts = one_row_gemv(2048, 5632)  # Ouro's down projection: split K, tickets
    for pdl in (False, True):
        constexprs = consts | {"PDL": pdl, "PREFETCH": pdl, "PRELOAD": 0}
        compiled = _compile_sm90(
            gemv_kernel._gemv_kernel, GEMV_SIGNATURE, constexprs, num_warps=cfg.num_warps, launch_pdl=pdl
        )
        ptx = compiled.asm["ptx"].splitlines()
        hint, prefetch = (
            _first(ptx, "griddepcontrol.launch_dependents"),
            _first(ptx, "cp.async.bulk.prefetch"),
        )
        wait, access = _first(ptx, "griddepcontrol.wait"), _first(ptx, r"\b(ld|st|atom)\.global")
        assert compiled.metadata.launch_pdl is pdl
        if pdl:
            assert 0 <= hint < prefetch < wait < access, (hint, prefetch, wait, access)
        else:
            assert (hint, prefetch, wait) == (-1, -1, -1) and access >= 0


def test_prefetch_tiles_are_clamped_to_the_split_and_need_pdl_and_the_preload_toggle(monkeypatch):
    """`TileConfig.prefetch_tiles`: tiles after the preloaded ones, never past the program's split; none
    without PDL, without `kernels.gemv_preload` (early=False) or for an unaligned weight;
    PREFETCH_UNDER_PDL: the whole slice after the preload."""
    from functools import partial

    from looptrace.engine.kernels.gemv import kernel as gemv_kernel
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    w = torch.zeros(64, 256, dtype=torch.bfloat16)  # 16-byte aligned rows
    cfg = gemv_tiles.TileConfig(prefetch_tiles=3)
    tiles = partial(gemv_kernel._prefetch_tiles, weight=w, pdl=True, early=True)
    assert tiles(cfg, per_split=8, preload=1) == 3
    assert tiles(cfg, per_split=3, preload=1) == 2
    assert tiles(cfg, per_split=1, preload=1) == 0
    assert tiles(cfg, per_split=8, preload=1, pdl=False) == 0
    assert tiles(cfg, per_split=8, preload=1, early=False) == 0
    assert tiles(gemv_tiles.TileConfig(), per_split=8, preload=1) == 0
    assert tiles(cfg, per_split=8, preload=0, weight=w[:, 1:]) == 0  # a 2-byte offset
    monkeypatch.setattr(gemv_kernel, "PREFETCH_UNDER_PDL", True)
    assert tiles(gemv_tiles.TileConfig(), per_split=8, preload=1, early=False) == 7


@needs_triton
def test_sm90_gemv_prefetches_its_next_tiles_and_preloads_before_the_wait():
    """Preload + prefetch (one row, PDL): the first tile's loads and the bulk L2 prefetches of the tiles
    after it come before `griddepcontrol.wait`; no store or atomic does."""
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    cfg, constexprs = one_row_gemv(6144, 2048, PDL=True, PREFETCH=2, PRELOAD=1)
    compiled = _compile_sm90(
        gemv_kernel._gemv_kernel, GEMV_SIGNATURE, constexprs, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=True,
    )  # fmt: skip
    ptx = compiled.asm["ptx"].splitlines()
    wait = _first(ptx, "griddepcontrol.wait")
    before = ptx[:wait]
    assert any(re.search(r"\bld\.global", line) for line in before)
    assert any("cp.async.bulk.prefetch.L2" in line for line in before)
    assert not any(re.search(r"\b(st|atom)\.global", line) for line in before)
    assert not any("cp.async.bulk.prefetch" in line for line in ptx[wait:])


@needs_triton
def test_sm90_gemv_preload_loads_weights_before_the_wait():
    """`kernels.gemv_preload`: the first weight tile's loads come before `griddepcontrol.wait`; the
    activation, partial and ticket accesses (everything a kernel before may write) after it."""
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel

    cfg, constexprs = one_row_gemv(6144, 2048, PDL=True, PREFETCH=False)  # Ouro's q/k/v projection
    orders = {}
    for preload in (0, 1):
        compiled = _compile_sm90(
            gemv_kernel._gemv_kernel, GEMV_SIGNATURE, {**constexprs, "PRELOAD": preload},
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=True,
        )  # fmt: skip
        ptx = compiled.asm["ptx"].splitlines()
        wait = _first(ptx, "griddepcontrol.wait")
        loads_before = [line for line in ptx[:wait] if re.search(r"\bld\.global", line)]
        writes_before = [line for line in ptx[:wait] if re.search(r"\b(st|atom)\.global", line)]
        orders[preload] = (len(loads_before), len(writes_before))
    assert orders[0] == (0, 0)
    assert orders[1][0] > 0 and orders[1][1] == 0, orders


ATTN_SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "tab_ptr": "*i64", "ctx_ptr": "*i64"}
ATTN_SIGNATURE |= {"out_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32", "ticket_ptr": "*i32"}
ATTN_SIGNATURE |= {"layer_id": "i32", "qk_scale": "fp32"}
ATTN_SIGNATURE |= {n: "i32" for n in ("stride_qr", "stride_qh", "stride_e", "stride_s", "stride_kh")}
ATTN_SIGNATURE |= {n: "i32" for n in ("stride_t", "stride_c", "stride_or", "seg_stride")}


@needs_triton
@pytest.mark.parametrize("dim", [128, 96])
def test_sm90_attention_prefetch_reads_only_through_l2_before_the_wait(dim):
    """`kernels.attn_prefetch`: before `griddepcontrol.wait` the attention kernel only loads through L2
    (`ld.global.cg`: the context length and page entries) and issues bulk L2 prefetches of K/V rows; no
    plain load (K, V, q), no store, no atomic. Without it nothing comes before the wait."""
    from looptrace.engine.kernels import paged_attention as pa

    cfg = pa.split_for_head(dim)
    d_a, d_b = pa.head_split(dim)
    consts = dict(GROUP=1, HEAD_DIM=dim, D_A=d_a, D_B=d_b, DB_W=max(d_b, 16), PAGE=16, BLOCK=cfg.block_n,
                  MAX_SEGS=cfg.max_segments, MIN_TILES=cfg.min_tiles, KEY_SLOTS=cfg.key_slots,
                  PDL=True)  # fmt: skip
    counts = {}
    for prefetch in (0, pa.prefetch_keys(cfg)):
        compiled = _compile_sm90(
            pa._attn_kernel, ATTN_SIGNATURE, consts | dict(PREFETCH_KEYS=prefetch), num_warps=cfg.num_warps,
            launch_pdl=True,
        )  # fmt: skip
        ptx = compiled.asm["ptx"].splitlines()
        before = ptx[: _first(ptx, "griddepcontrol.wait")]
        counts[prefetch] = [
            sum(bool(re.search(pattern, line)) for line in before)
            for pattern in (
                r"ld\.global\.cg",
                r"\bld\.global(?!\.cg)",
                r"\b(st|atom)\.global",
                r"cp\.async\.bulk\.prefetch",
            )
        ]
    assert counts[0] == [0, 0, 0, 0]
    cg, plain, writes, prefetches = counts[pa.prefetch_keys(cfg)]
    assert cg > 0 and prefetches == 2 and plain == 0 and writes == 0, counts


@needs_triton
def test_sm90_exact_kernel_ptx_waits_before_any_global_access():
    from looptrace.engine.kernels import silu_mul

    signature = {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32"}
    signature |= {"stride_g": "i32", "stride_u": "i32", "stride_o": "i32"}
    compiled = _compile_sm90(
        silu_mul._silu_mul_kernel, signature, {"BLOCK": 1024, "PDL": True}, launch_pdl=True
    )
    ptx = compiled.asm["ptx"].splitlines()
    wait, access = _first(ptx, "griddepcontrol.wait"), _first(ptx, r"\b(ld|st)\.global")
    assert 0 <= _first(ptx, "griddepcontrol.launch_dependents") < wait < access


def test_the_engine_on_cpu_records_pdl_as_inactive():
    from tests.helpers import build_engine

    engine = build_engine("ouro-tiny", kernels__pdl=True)
    assert not engine.plan.launch.dependent
    assert "compute capability 9" in engine.inactive_settings["kernels.pdl"]
    from looptrace.engine import SamplingParams

    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0]) == 2


def test_the_engine_on_cpu_records_the_attention_prefetch_as_inactive():
    """`kernels.attn_prefetch` acts only under PDL on the Triton attention: inactive on CPU, with why."""
    from tests.helpers import build_engine

    engine = build_engine("ouro-tiny", kernels__attn_prefetch=True)
    assert not engine.plan.launch.kv_prefetch
    assert "kernels.pdl" in engine.inactive_settings["kernels.attn_prefetch"]


def test_pdl_is_declared_r0_and_off_in_exactloop():
    from looptrace.engine.config import toggle_rung
    from looptrace.recipes import load_recipe

    assert toggle_rung("kernels.pdl", False, True) == "R0"
    assert not load_recipe("exactloop").config.kernels.pdl


# ----------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
HIDDEN, HEADS, DIM, INTER, PAGE, CTX, EPS = 2048, 16, 128, 5632, 16, 100, 1e-6


def _chain(rows: int, linear, passes: int = 6, fold_rope: bool = False):
    """A decode chain of the engine's kernels at Ouro-1.4B's shapes (2 layers, `passes` layer passes);
    `fold_rope` (one row): the q/k/v GEMV does RoPE and the K/V write itself (`kernels.gemv_rope_out`)."""
    from looptrace.engine.kernels import gemv_rope, paged_attention, rmsnorm, rope, silu_mul

    gen = torch.Generator(device="cuda").manual_seed(5)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    shapes = dict(
        qkv=(3 * HIDDEN, HIDDEN), o=(HIDDEN, HIDDEN), gate_up=(2 * INTER, HIDDEN), down=(HIDDEN, INTER)
    )
    layers = [{name: rnd(*shape) for name, shape in shapes.items()} for _ in range(2)]
    for lay in layers:
        lay["n1"], lay["n2"] = 1 + rnd(HIDDEN), 1 + rnd(HIDDEN)
    pages = -(-(CTX + 1) // PAGE)
    kc, vc = (
        rnd(rows * pages * 2, PAGE, HEADS, DIM, scale=0.5),
        rnd(rows * pages * 2, PAGE, HEADS, DIM, scale=1),
    )
    tables = torch.arange(rows * pages, device="cuda").view(rows, pages) * 2
    ctx = torch.full((rows,), CTX + 1, device="cuda")
    went, woff = tables[:, CTX // PAGE].contiguous(), torch.full((rows,), CTX % PAGE, device="cuda")
    h0 = rnd(rows, HIDDEN, scale=1)
    cos, sin = rnd(rows, DIM, scale=1), rnd(rows, DIM, scale=1)

    def token():
        h = h0
        x = rmsnorm.rms_norm(h, layers[0]["n1"], EPS)
        for i in range(passes):
            lay = layers[i % 2]
            if fold_rope:
                q = gemv_rope.qkv_rope_write(
                    x, lay["qkv"], cos, sin, kc, vc, went, woff, i % 2, (HEADS, HEADS, DIM)
                )
            else:
                q, k, v = linear(x, lay["qkv"]).split(HIDDEN, dim=-1)
                q, k, v = (t.view(rows, HEADS, DIM) for t in (q, k, v))
                q = rope.rope_half_write_kv(q, k, v, cos, sin, kc, vc, went, woff, i % 2)
            a = paged_attention.paged_attention(q, kc, vc, tables, ctx, i % 2, DIM**-0.5)
            h, x = rmsnorm.residual_rms_norm(linear(a, lay["o"]), lay["n1"], EPS, h, lay["n2"], EPS)
            gate, up = linear(x, lay["gate_up"]).chunk(2, dim=-1)
            d = linear(silu_mul.silu_mul(gate, up), lay["down"])
            h, x = rmsnorm.residual_rms_norm(d, lay["n2"], EPS, h, layers[(i + 1) % 2]["n1"], EPS)
        return h, x

    return token


@gpu
@pytest.mark.skipif(not launch_mode.supported("cuda"), reason="PDL needs sm_90+")
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize(
    "projection", ["cublas", "gemv", "gemv+preload", "gemv+preload+l2", "cublas+kv", "gemv+preload+rope"]
)
def test_a_chain_captured_under_pdl_equals_the_eager_chain_bitwise(rows, projection, monkeypatch):
    """Under PDL (and, for the GEMV, with its weight preload, kernels.gemv_preload, and its next tiles
    prefetched into L2 before the wait, `TileConfig.prefetch_tiles`; for the attention, with its K/V
    prefetched into L2 before its wait, kernels.attn_prefetch, the newest key written by the kernel just
    before it; one row with RoPE and the K/V write in the q/k/v GEMV, kernels.gemv_rope_out, whose eager
    chain must also equal the plain GEMV's): the same bits."""
    import dataclasses

    import torch.nn.functional as F

    from looptrace.engine import kernels as K
    from looptrace.engine.kernels.gemv import kernel as gemv_kernel
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    if projection.endswith("+l2"):  # every tile of the table asks L2 for its next two tiles
        table_pick = gemv_tiles.pick_config

        def pick(m, n, k):
            return dataclasses.replace(table_pick(m, n, k), prefetch_tiles=2)

        # both users of the table: the plain GEMV's launch and the one-row forms' config
        monkeypatch.setattr(gemv_kernel, "pick_config", pick)
        monkeypatch.setattr(gemv_tiles, "pick_config", pick)
    linear = F.linear if projection.startswith("cublas") else gemv_kernel.gemv
    preload, kv = "+preload" in projection, projection.endswith("+kv")
    fold = projection.endswith("+rope")
    if fold and rows > 1:
        pytest.skip("the folded RoPE form takes one row")
    token = _chain(rows, linear, fold_rope=fold)
    if fold:  # R0: the eager chains with and without the fold agree bit for bit
        with K.graph_warmup():
            plain, folded = _chain(rows, linear)(), token()
        assert all(torch.equal(a, b) for a, b in zip(plain, folded))
    with K.graph_warmup():
        eager = token()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), launch_mode.dependent_launches(True, preload, kv):
            for _ in range(2):
                token()  # compiles the PDL variants outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with launch_mode.dependent_launches(True, preload, kv), torch.cuda.graph(graph):
            captured = token()
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(eager, captured))
        with launch_mode.dependent_launches(True, preload, kv):
            again = token()  # eager launches under PDL as well
    assert all(torch.equal(a, b) for a, b in zip(eager, again))


@gpu
@pytest.mark.skipif(not launch_mode.supported("cuda"), reason="PDL needs sm_90+")
@pytest.mark.parametrize("recipe", ["fast", "exactloop"])
def test_recipe_with_pdl_generates_the_same_tokens(recipe):
    from looptrace.engine import LLMEngine, SamplingParams
    from looptrace.recipes import load_recipe

    prompts = [[3 + i + j for j in range(5 + 7 * i)] for i in range(4)]
    outs = []
    for pdl in (False, True):
        # A fixed pool: sized from free memory, an engine would leave the next test only scraps
        sets = [f"kernels.pdl={str(pdl).lower()}", "scheduler.max_model_len=256", "kv.num_blocks=2048"]
        engine = LLMEngine.from_preset("ouro-tiny", load_recipe(recipe, sets).config, device="cuda", seed=1)
        assert engine.plan.launch.dependent is pdl
        outs.append(engine.generate(prompts, SamplingParams(max_tokens=12, seed=3)))
        outs.append(engine.generate(prompts[:1], SamplingParams(max_tokens=12, seed=3)))  # batch 1
        del engine
        torch.cuda.empty_cache()
    assert outs[0] == outs[2] and outs[1] == outs[3]
