"""Bitwise checks of the exact kernels against the engine's eager ops (shared by the GPU tests and
`bench/kernel_exact.py`). Imports torch and the engine layers only; Triton loads on the first exact call.

It sits in `looptrace/engine/`, above both floors it compares: the kernels (`engine/kernels/`) and the
layers (`engine/layers.py`) whose eager ops are the reference; a kernel module never imports the layers.

A *case* is one (kernel, model, row count, input kind): `eager()` runs the engine's eager op, `exact()` the
fused kernel, both on the same static inputs, so `exact` can also be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from looptrace.engine.layers import RMSNorm, RotaryHalf, RotaryInterleaved
from looptrace.engine.model_config import PRESETS, ModelSpec

MODELS = ("ouro-1.4b", "huginn-0125", "olmo-retrofit-1b")
# One row count per mean-order bucket (lanes per row 512 / 256 / 128 / 64 / 32) plus the > 256 eager range.
BUCKETS = {
    "1": (1,),
    "2-3": (2, 3),
    "4-7": (4, 7),
    "8-15": (8, 15),
    ">=16": (16, 64, 256),
    ">256": (257, 1024),
}
TEST_ROWS = (1, 3, 5, 13, 64, 300)
KINDS = ("random", "wide", "tiny", "large", "ties", "exp-edge")
TIE_VALUES = (1.5, 1.25, 1.75, 0.75, 3.0, 1.0078125, 1.0234375)


def bucket_of(rows: int) -> str:
    if rows > 256:
        return ">256"
    if rows >= 16:
        return ">=16"
    return "1" if rows == 1 else "2-3" if rows < 4 else "4-7" if rows < 8 else "8-15"


def _bits(shape, gen, device, exp_lo: int, exp_hi: int, mant: tuple[int, ...] | None = None) -> torch.Tensor:
    """bf16 from raw bits: random sign, biased exponent in [exp_lo, exp_hi] (0 = subnormal), mantissa."""
    sign = torch.randint(0, 2, shape, generator=gen, device=device, dtype=torch.int32) << 15
    expo = torch.randint(exp_lo, exp_hi + 1, shape, generator=gen, device=device, dtype=torch.int32) << 7
    if mant is None:
        m = torch.randint(0, 128, shape, generator=gen, device=device, dtype=torch.int32)
    else:
        table = torch.tensor(mant, dtype=torch.int32, device=device)
        m = table[torch.randint(0, len(mant), shape, generator=gen, device=device)]
    raw = (sign | expo | m).to(torch.int16)
    return raw.view(torch.bfloat16)


def make_input(shape, kind: str, gen: torch.Generator, device, scale: float = 1.0) -> torch.Tensor:
    """bf16 test data. random: N(0, scale^2); wide: exponents 2^-40..2^40; tiny: subnormals and values
    below 2^-107 (squares underflow); large: 2^40..2^63 (squares overflow fp32 sums); ties: few mantissa
    bits (products land on rounding ties); exp-edge: |x| in [64, 128) (expf over/underflows to subnormals)."""
    if kind == "random":
        x = (torch.randn(shape, generator=gen, device=device) * scale).bfloat16()
    elif kind == "wide":
        x = _bits(shape, gen, device, 127 - 40, 127 + 40)
    elif kind == "tiny":
        x = _bits(shape, gen, device, 0, 20)
    elif kind == "large":
        x = _bits(shape, gen, device, 127 + 40, 127 + 63)
    elif kind == "ties":
        x = _bits(shape, gen, device, 127 - 3, 127 + 3, (0, 1, 3, 64, 65, 96, 127))
    elif kind == "exp-edge":
        x = _bits(shape, gen, device, 127 + 6, 127 + 6)
    else:
        raise ValueError(kind)
    zeros = torch.rand(shape, generator=gen, device=device) < 0.02
    signed_zero = torch.where(torch.rand(shape, generator=gen, device=device) < 0.5, 0.0, -0.0)
    return torch.where(zeros, signed_zero.bfloat16(), x)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, int]:
    """(torch.equal, number of elements whose bit patterns differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, -1
    ia = a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)
    diff = int((ia != ib).sum().item())
    return torch.equal(a, b) and diff == 0, diff


@dataclass
class Case:
    kernel: str
    model: str
    rows: int
    kind: str
    eager: Callable[[], tuple[torch.Tensor, ...]]
    exact: Callable[[], tuple[torch.Tensor, ...]]
    uses_kernel: bool  # the exact path really launches Triton (no eager fallback)


def _weight(n, kind, gen, device):
    if kind == "ties":
        vals = torch.tensor(TIE_VALUES, device=device)
        w = vals[torch.randint(0, len(TIE_VALUES), (n,), generator=gen, device=device)]
        w = w * torch.where(torch.rand(n, generator=gen, device=device) < 0.5, -1.0, 1.0)
        return w.bfloat16()
    return (1.0 + 0.5 * torch.randn(n, generator=gen, device=device)).bfloat16()


def rmsnorm_case(spec: ModelSpec, rows, kind, gen, device, form="auto", qk=False) -> Case:
    """form: 'auto' (one kernel where replayable) | 'three' | 'one:desc' | 'one:asc' (forced mean order).
    qk: OLMo's q_norm input, a strided [rows, H*D] slice of the fused Wqkv output."""
    # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
    from looptrace.engine.kernels import rmsnorm

    n = spec.num_heads * spec.head_dim if qk else spec.hidden_size
    if qk:
        buf = make_input((rows, 3 * n), kind, gen, device, scale=2.0)
        x = buf[:, :n]
    else:
        x = make_input((rows, n), kind, gen, device, scale=3.0)
    norm = RMSNorm(n, spec.rms_norm_eps).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_weight(n, kind, gen, device))
    w = norm.weight.detach()

    def eager():
        with torch.no_grad():
            return (norm(x),)

    def exact():
        if form == "three":
            return (rmsnorm.rms_norm_three(x, w, norm.eps),)
        if form.startswith("one:"):
            return (rmsnorm.rms_norm_fused(x, w, norm.eps, order=form[4:]),)
        return (rmsnorm.rms_norm(x, w, norm.eps),)

    name = "rmsnorm_qk" if qk else "rmsnorm"
    return Case(f"{name}[{form}]", spec.name, rows, kind, eager, exact, rmsnorm.supported(x, w))


def rope_case(spec: ModelSpec, rows, kind, gen, device) -> Case:
    # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
    from looptrace.engine.kernels import rope

    h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    positions = torch.randint(0, spec.max_position, (rows,), generator=gen, device=device)
    # q and k as the attention modules produce them: views of one fused projection (raven) or own GEMMs
    qkv = make_input((rows, (h + 2 * kvh) * d), kind, gen, device, scale=2.0)
    q, k, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = q.reshape(-1, h, d), k.reshape(-1, kvh, d)
    if spec.rope_style == "half":
        mod = RotaryHalf(d, spec.rope_theta).to(device)
        cos, sin = mod.tables(positions, torch.bfloat16)

        def eager():
            return mod(q, k, cos, sin)

        def exact():
            return rope.rope_half(q, k, cos, sin)

        uses = rope.supported_half(q, k, cos, sin)
    else:
        mod = RotaryInterleaved(d, spec.rope_theta, spec.max_position).to(device)
        cos, sin = mod.tables(positions, torch.bfloat16)
        bias = make_input((2, 1, h, d), kind if kind != "exp-edge" else "random", gen, device, scale=0.5)
        bias = bias if spec.qk_bias else None

        def eager():
            qq, kk = (q + bias[0], k + bias[1]) if bias is not None else (q, k)
            return mod(qq, kk, cos, sin)

        def exact():
            return rope.rope_interleaved(q, k, cos, sin, bias)

        uses = rope.supported_interleaved(q, k, cos, sin, bias)
    return Case("rope", spec.name, rows, kind, eager, exact, uses)


def residual_norm_case(spec: ModelSpec, rows, kind, gen, device) -> Case:
    """Ouro's post-norm + residual add + next pre-norm: `h = res + post(y); (h, nxt(h))` eagerly, against
    `rmsnorm.residual_rms_norm` (one launch)."""
    # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
    from looptrace.engine.kernels import rmsnorm

    n = spec.hidden_size
    y = make_input((rows, n), kind, gen, device, scale=3.0)
    residual = make_input((rows, n), "random" if kind == "exp-edge" else kind, gen, device, scale=2.0)
    post, nxt = (RMSNorm(n, spec.rms_norm_eps).to(device=device, dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        post.weight.copy_(_weight(n, kind, gen, device))
        nxt.weight.copy_(_weight(n, kind, gen, device))

    def eager():
        with torch.no_grad():
            h = residual + post(y)
            return h, nxt(h)

    def exact():
        w1, w2 = post.weight.detach(), nxt.weight.detach()
        return rmsnorm.residual_rms_norm(y, w1, post.eps, residual, w2, nxt.eps)

    uses = rmsnorm.residual_supported(y, residual, post.weight, nxt.weight)
    return Case("residual_norm", spec.name, rows, kind, eager, exact, uses)


def rope_write_case(spec: ModelSpec, rows, kind, gen, device) -> Case:
    """Rotate-half RoPE then the Triton K/V write (the base path) against `rope.rope_half_write_kv`: the
    rotated q and both caches (each side writes its own zeroed pool; the last row is a padding row with
    write_entry -1 when rows > 1, which must write nothing)."""
    # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
    from looptrace.engine.kernels import paged_attention as pa
    from looptrace.engine.kernels import rope

    h, kvh, d, layers, page = spec.num_heads, spec.num_kv_heads, spec.head_dim, 3, 16
    positions = torch.randint(0, spec.max_position, (rows,), generator=gen, device=device)
    qkv = make_input((rows, (h + 2 * kvh) * d), kind, gen, device, scale=2.0)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.reshape(-1, h, d), k.reshape(-1, kvh, d), v.reshape(-1, kvh, d)
    mod = RotaryHalf(d, spec.rope_theta).to(device)
    cos, sin = mod.tables(positions, torch.bfloat16)
    entries = (rows + 1) * layers
    # distinct (entry base, slot) per row: block b = row, slot = a random offset
    write_entry = torch.arange(rows, device=device, dtype=torch.int64) * layers
    write_offset = torch.randint(0, page, (rows,), generator=gen, device=device)
    if rows > 1:
        write_entry[-1] = -1
    pools = [torch.zeros(entries, page, kvh, d, dtype=torch.bfloat16, device=device) for _ in range(4)]
    layer_id = 1

    def eager():
        kc, vc = pools[0].zero_(), pools[1].zero_()
        qr, kr = mod(q, k, cos, sin)
        pa.write_kv(kr, v, kc, vc, write_entry, write_offset, layer_id)
        return qr, kc, vc

    def exact():
        kc, vc = pools[2], pools[3]
        qr = rope.rope_half_write_kv(q, k, v, cos, sin, kc, vc, write_entry, write_offset, layer_id)
        return qr, kc, vc

    return Case("rope_kv_write", spec.name, rows, kind, eager, exact, rope.supported_half(q, k, cos, sin))


def silu_case(spec: ModelSpec, rows, kind, gen, device, options: dict | None = None, label="") -> Case:
    # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
    import looptrace.engine.kernels.silu_mul as silu

    n = spec.intermediate_size
    if spec.family == "ouro":  # gate_proj / up_proj: two contiguous outputs
        gate = make_input((rows, n), kind, gen, device, scale=3.0)
        up = make_input((rows, n), "random" if kind == "exp-edge" else kind, gen, device, scale=2.0)
    else:  # raven fc: [gate | up] = fc(x).chunk(2)
        fc = make_input((rows, 2 * n), kind, gen, device, scale=3.0)
        gate, up = fc.chunk(2, dim=-1)

    def eager():
        return (F.silu(gate) * up,)

    def exact():
        return (silu.silu_mul(gate, up, options),)

    return Case(f"silu_mul{label}", spec.name, rows, kind, eager, exact, silu.supported(gate, up))


def _capture(fn: Callable[[], object], calls: int = 1):
    """Warm `fn` up on a side stream, then capture `calls` calls of it in one CUDA graph; returns (graph,
    the last call's outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            out = fn()
    return g, out


def in_graph(fn: Callable[[], tuple[torch.Tensor, ...]]):
    """Capture `fn` in a CUDA graph (after a warm-up), replay once; returns (outputs, graph)."""
    g, out = _capture(fn)
    g.replay()
    torch.cuda.synchronize()
    return out, g


def graph_time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Median µs per call of `fn`, replayed from one CUDA graph of `reps` calls (host launch cost left
    out), measured with `triton.testing.do_bench`."""
    # deferred: Triton is optional (CUDA only)
    from triton.testing import do_bench

    g, _ = _capture(fn, reps)
    return do_bench(g.replay, warmup=10, rep=80, return_mode="median") * 1000 / reps


def compare(case: Case, mode: str) -> tuple[bool, int]:
    """mode 'eager': exact() called directly; 'graph': exact() captured and replayed. Reference: eager()."""
    ref = case.eager()
    if mode == "graph":
        out, _g = in_graph(case.exact)
    else:
        out = case.exact()
    torch.cuda.synchronize()
    ok, diff = True, 0
    for a, b in zip(out, ref):
        o, d = same_bits(a, b)
        ok = ok and o
        diff = -1 if (d < 0 or diff < 0) else diff + d
    return ok, diff


def spec(name: str) -> ModelSpec:
    return PRESETS[name]
