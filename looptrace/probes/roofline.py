"""Roofline model of one op: bytes and FLOPs from recorded shapes, device peaks, and how far from its floor.

`op_cost` reads the arguments Kineto records with `record_shapes=True` ("Input Dims", "Input type",
"Concrete Inputs") for one CPU-op call and returns the bytes it must move through HBM and the FLOPs it must
do, counting each tensor argument once (read or written) and outputs from the op's semantics. It returns
None when the op is unknown or its shapes do not determine the work (a paged-attention call whose KV lengths
are not among its arguments, a MoE layer whose expert weights are not). The floor of a call is
max(bytes / peak bandwidth, FLOPs / peak FLOP rate); `achieved` says what share of that floor the measured
time reaches (100 % = on the roofline).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Element sizes of the "Input type" strings Kineto records (c10 scalar type names as the C++ sees them).
DTYPE_BYTES: dict[str, int] = {
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "float": 4,
    "double": 8,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
    "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2fnuz": 1,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
    "c10::complex<c10::Half>": 4,
    "long int": 8,
    "long long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "unsigned short": 2,
    "unsigned int": 4,
    "unsigned long": 8,
}

# Peak-table dtype of a type string (None: integer or bool, no tensor-core peak applies).
DTYPE_CLASS: dict[str, str] = {
    "c10::BFloat16": "bf16",
    "c10::Half": "fp16",
    "float": "fp32",
    "double": "fp32",
    "c10::Float8_e4m3fn": "fp8",
    "c10::Float8_e5m2": "fp8",
    "c10::Float8_e4m3fnuz": "fp8",
    "c10::Float8_e5m2fnuz": "fp8",
}

# c10::ScalarType codes (the `dtype=` integer in "Concrete Inputs") -> element bytes.
SCALAR_TYPE_BYTES: dict[int, int] = {
    0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 4, 7: 8, 8: 4, 9: 8, 10: 16, 11: 1, 15: 2,
    23: 1, 24: 1, 25: 1, 26: 1,
}  # fmt: skip


@dataclass(frozen=True)
class OpCost:
    """HBM bytes and FLOPs one call must move and do (an ideal kernel: each tensor touched once)."""

    flops: float
    bytes: float


@dataclass(frozen=True)
class _Arg:
    dims: tuple[int, ...] | None  # None: not a tensor (Scalar, ScalarList, TensorList, None)
    size: int  # element bytes; 0 when unknown
    concrete: str

    @property
    def numel(self) -> int:
        return math.prod(self.dims) if self.dims is not None else 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.size


def _args(input_dims: list, input_types: list, concrete: list | None) -> list[_Arg]:
    out = []
    for i, dims in enumerate(input_dims):
        kind = input_types[i] if i < len(input_types) else ""
        size = DTYPE_BYTES.get(kind, 0)
        is_tensor = size > 0 and isinstance(dims, list) and all(isinstance(d, int) for d in dims)
        # A 0-dim "Input Dims" [] with a tensor dtype is a 0-dim tensor (numel 1), not a scalar.
        value = str(concrete[i]) if concrete is not None and i < len(concrete) else ""
        out.append(_Arg(tuple(dims) if is_tensor else None, size, value))
    return out


def _tensors(args: Sequence[_Arg]) -> list[_Arg]:
    return [a for a in args if a.dims is not None]


def _flag(args: Sequence[_Arg], i: int, default: bool = False) -> bool:
    if i >= len(args) or args[i].concrete == "":
        return default
    return args[i].concrete.strip().lower() in ("true", "1")


def _int(args: Sequence[_Arg], i: int) -> int | None:
    if i >= len(args):
        return None
    try:
        return int(args[i].concrete)
    except ValueError:
        return None


def _broadcast(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        out.append(max(dims) if 0 not in dims else 0)
    return tuple(out)


# --- GEMMs -------------------------------------------------------------------------------------------


def _gemm(m: int, n: int, k: int, batch: int, in_bytes: float, out_size: int) -> OpCost:
    return OpCost(flops=2.0 * batch * m * n * k, bytes=in_bytes + batch * m * n * out_size)


def _mm(args: list[_Arg]) -> OpCost | None:  # mm(a[M,K], b[K,N])
    a, b = args[0], args[1]
    if a.dims is None or b.dims is None or len(a.dims) != 2 or len(b.dims) != 2:
        return None
    (m, k), n = a.dims, b.dims[1]
    return _gemm(m, n, k, 1, a.nbytes + b.nbytes, a.size)


def _addmm(args: list[_Arg]) -> OpCost | None:  # addmm(bias, a[M,K], b[K,N], beta, alpha)
    base = _mm(args[1:])
    bias = args[0]
    if base is None or bias.dims is None:
        return None
    return OpCost(base.flops, base.bytes + bias.nbytes)


def _bmm(args: list[_Arg]) -> OpCost | None:  # bmm(a[B,M,K], b[B,K,N])
    a, b = args[0], args[1]
    if a.dims is None or b.dims is None or len(a.dims) != 3 or len(b.dims) != 3:
        return None
    (bt, m, k), n = a.dims, b.dims[2]
    return _gemm(m, n, k, bt, a.nbytes + b.nbytes, a.size)


def _baddbmm(args: list[_Arg]) -> OpCost | None:  # baddbmm(self, b1, b2, beta, alpha)
    base = _bmm(args[1:])
    if base is None or args[0].dims is None:
        return None
    return OpCost(base.flops, base.bytes + args[0].nbytes)


def _matmul(args: list[_Arg]) -> OpCost | None:  # matmul with numpy broadcasting of the batch dims
    a, b = args[0], args[1]
    if a.dims is None or b.dims is None or not a.dims or not b.dims:
        return None
    ad = a.dims if len(a.dims) > 1 else (1, a.dims[0])
    bd = b.dims if len(b.dims) > 1 else (b.dims[0], 1)
    m, k, n = ad[-2], ad[-1], bd[-1]
    batch = math.prod(_broadcast([ad[:-2], bd[:-2]]))
    return _gemm(m, n, k, batch, a.nbytes + b.nbytes, a.size)


def _linear(args: list[_Arg]) -> OpCost | None:  # linear(x[...,K], w[N,K], bias[N]?)
    x, w = args[0], args[1]
    if x.dims is None or w.dims is None or len(w.dims) != 2 or not x.dims:
        return None
    m, (n, k) = math.prod(x.dims[:-1]), w.dims
    bias = args[2].nbytes if len(args) > 2 else 0
    return _gemm(m, n, k, 1, x.nbytes + w.nbytes + bias, x.size)


def _scaled_mm(args: list[_Arg]) -> OpCost | None:
    # _scaled_mm(a[M,K] fp8, b[K,N] fp8, scale_a, scale_b, bias?, scale_result?, out_dtype?, use_fast_accum)
    a, b = args[0], args[1]
    if a.dims is None or b.dims is None or len(a.dims) != 2 or len(b.dims) != 2:
        return None
    code = _int(args, 6)
    out_size = SCALAR_TYPE_BYTES.get(code, 0) if code is not None else 0
    out_size = out_size or 2  # out_dtype not recorded: bf16, the usual choice
    rest = sum(t.nbytes for t in _tensors(args[2:]))
    return _gemm(a.dims[0], b.dims[1], a.dims[1], 1, a.nbytes + b.nbytes + rest, out_size)


def _out_first_gemm(args: list[_Arg]) -> OpCost | None:
    # vLLM cutlass_scaled_mm(out[M,N], a[M,K], b[K,N], a_scales, b_scales, bias?): every tensor once
    out, a, b = args[0], args[1], args[2]
    if out.dims is None or a.dims is None or b.dims is None or len(a.dims) != 2:
        return None
    m, k = a.dims
    n = out.dims[-1]
    return OpCost(2.0 * m * n * k, sum(t.nbytes for t in _tensors(args)))


# --- attention ---------------------------------------------------------------------------------------


def _pairs(sq: float, sk: float, causal: bool, bottom_right: bool) -> float:
    """Query-key pairs scored per (batch, head): sq*sk, or the causal triangle.

    PyTorch SDPA aligns the causal mask top-left (query i sees keys 0..i); FlashAttention aligns it
    bottom-right (query i sees keys 0..i+sk-sq), which is what a decode step against a KV cache needs."""
    if not causal:
        return sq * sk
    offset = sk - sq if bottom_right else 0.0
    # sum over queries i of clamp(i + 1 + offset, 0, sk), closed form over the three pieces
    total = 0.0
    lo = max(0.0, -offset)  # first query that sees at least one key
    full = max(lo, min(sq, sk - offset))  # queries from here on see all sk keys
    n_part = full - lo
    if n_part > 0:
        first, last = lo + 1 + offset, full + offset
        total += n_part * (first + last) / 2
    total += max(0.0, sq - full) * sk
    return total


def _attn(
    b: float, h: int, hk: int, sq: float, sk: float, d: int, dv: int, size: int, causal: bool, br: bool
) -> OpCost:
    pairs = _pairs(sq, sk, causal, br)
    flops = 2.0 * b * h * pairs * (d + dv)  # QK^T then PV
    nbytes = size * b * (h * sq * d + hk * sk * (d + dv) + h * sq * dv)  # Q, K, V read once; O written
    return OpCost(flops, nbytes)


def _sdpa(causal_at: int) -> Callable[[list[_Arg]], OpCost | None]:
    def cost(args: list[_Arg]) -> OpCost | None:  # q[B,H,Sq,D], k[B,Hk,Sk,D], v[B,Hk,Sk,Dv]
        q, k, v = args[0], args[1], args[2]
        if any(t.dims is None or len(t.dims) != 4 for t in (q, k, v)):
            return None
        (bt, h, sq, d), (_, hk, sk, _), dv = q.dims, k.dims, v.dims[3]
        c = _attn(bt, h, hk, sq, sk, d, dv, q.size, _flag(args, causal_at), br=False)
        mask = sum(t.nbytes for t in _tensors(args[3:]))  # an explicit attn_mask / bias is read too
        return OpCost(c.flops, c.bytes + mask)

    return cost


def _flash_bshd(causal_at: int, varlen: bool) -> Callable[[list[_Arg]], OpCost | None]:
    """flash_attn-style q[B,Sq,H,D] (or varlen q[T,H,D] with cu_seqlens at args 3 and 4)."""

    def cost(args: list[_Arg]) -> OpCost | None:
        q, k, v = args[0], args[1], args[2]
        causal = _flag(args, causal_at)
        if varlen or (q.dims is not None and len(q.dims) == 3):
            cu = args[3] if len(args) > 3 else None
            if q.dims is None or k.dims is None or v.dims is None or cu is None or cu.dims is None:
                return None
            if len(q.dims) != 3 or len(k.dims) != 3 or cu.dims[0] < 2:
                return None
            nseq = cu.dims[0] - 1  # equal lengths assumed: the averages give the exact total when they are
            (tq, h, d), (tk, hk, _), dv = q.dims, k.dims, v.dims[-1]
            return _attn(nseq, h, hk, tq / nseq, tk / nseq, d, dv, q.size, causal, br=True)
        if any(t.dims is None or len(t.dims) != 4 for t in (q, k, v)):
            return None
        (bt, sq, h, d), (_, sk, hk, _), dv = q.dims, k.dims, v.dims[3]
        return _attn(bt, h, hk, sq, sk, d, dv, q.size, causal, br=True)

    return cost


def _efficient_attention(args: list[_Arg]) -> OpCost | None:
    # _efficient_attention_forward(q[B,S,H,D], k, v, bias?, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q,
    #   max_seqlen_k, dropout_p, custom_mask_type, ...): mask type 1 = causal top-left, 2 = bottom-right
    q, k, v = args[0], args[1], args[2]
    if any(t.dims is None or len(t.dims) != 4 for t in (q, k, v)):
        return None
    mask = _int(args, 9) or 0
    (bt, sq, h, d), (_, sk, hk, _), dv = q.dims, k.dims, v.dims[3]
    cu = args[4] if len(args) > 4 else None
    if cu is not None and cu.dims and cu.dims[0] >= 2:  # varlen: B == 1, sequences packed along S
        bt, sq, sk = cu.dims[0] - 1, sq / (cu.dims[0] - 1), sk / (cu.dims[0] - 1)
    c = _attn(bt, h, hk, sq, sk, d, dv, q.size, causal=mask in (1, 2), br=mask == 2)
    bias = args[3].nbytes if len(args) > 3 else 0
    return OpCost(c.flops, c.bytes + bias)


def _aiter_batch_prefill(args: list[_Arg]) -> OpCost | None:
    # aiter mha_batch_prefill(q[T,H,D], k_cache, v_cache, cu_seqlens_q[n+1], kv_indptr, kv_page_indices,
    #   max_seqlen_q, max_seqlen_k, dropout_p, scale, softcap, zero_tensors, is_causal, ...): the caches are
    # the whole pool, so keys per sequence come from max_seqlen_k (the same cached prefix in every sequence)
    q, kc, cu = args[0], args[1], args[3] if len(args) > 3 else None
    max_q, max_k = _int(args, 6), _int(args, 7)
    if q.dims is None or kc.dims is None or cu is None or cu.dims is None or max_q is None or max_k is None:
        return None
    if len(q.dims) != 3 or cu.dims[0] < 2:
        return None
    nseq = cu.dims[0] - 1
    (t, h, d), hk, dv = q.dims, kc.dims[-2], args[2].dims[-1] if args[2].dims else kc.dims[-1]
    sq = t / nseq
    return _attn(nseq, h, hk, sq, sq + max_k - max_q, d, dv, q.size, _flag(args, 12), br=True)


# --- norms, elementwise, copies ----------------------------------------------------------------------


def _all_tensors(flops_per_elem: float = 0.0, of: int = 0) -> Callable[[list[_Arg]], OpCost | None]:
    """Out-parameter style ops (vLLM/aiter kernels, copy_): each tensor argument is read or written once.
    FLOPs: flops_per_elem per element of tensor argument number `of`."""

    def cost(args: list[_Arg]) -> OpCost | None:
        ts = _tensors(args)
        if not ts:
            return None
        return OpCost(flops_per_elem * ts[min(of, len(ts) - 1)].numel, sum(t.nbytes for t in ts))

    return cost


def _like_first(flops_per_elem: float) -> Callable[[list[_Arg]], OpCost | None]:
    """Functional ops whose output has the first tensor's shape and dtype (silu, rms_norm, softmax, clone)."""

    def cost(args: list[_Arg]) -> OpCost | None:
        ts = _tensors(args)
        if not ts:
            return None
        return OpCost(flops_per_elem * ts[0].numel, sum(t.nbytes for t in ts) + ts[0].nbytes)

    return cost


def _pointwise(args: list[_Arg]) -> OpCost | None:
    """Broadcasting binary/ternary ops (add, mul, where): output = broadcast shape, widest input dtype."""
    ts = _tensors(args)
    if not ts:
        return None
    numel = math.prod(_broadcast([t.dims for t in ts if t.dims is not None]))
    # a 0-dim operand is a wrapped Python number ("double"): it does not widen the output dtype
    sized = [t.size for t in ts if t.dims] or [t.size for t in ts]
    return OpCost(float(numel), sum(t.nbytes for t in ts) + numel * max(sized))


def _pointwise_(args: list[_Arg]) -> OpCost | None:
    """In-place variants (add_, mul_): the first tensor is read and written back."""
    ts = _tensors(args)
    if not ts:
        return None
    return OpCost(float(ts[0].numel), sum(t.nbytes for t in ts) + ts[0].nbytes)


def _write_only(args: list[_Arg]) -> OpCost | None:  # fill_, zero_: the tensor is written once
    ts = _tensors(args)
    return OpCost(0.0, float(ts[0].nbytes)) if ts else None


def _reduce(args: list[_Arg]) -> OpCost | None:
    # sum/mean/amax over some dims: the input read dominates (the output is at most input / reduced size)
    ts = _tensors(args)
    return OpCost(float(ts[0].numel), float(ts[0].nbytes)) if ts else None


def _to_copy(dtype_at: Sequence[int]) -> Callable[[list[_Arg]], OpCost | None]:
    """aten::to / _to_copy: read the input, write it in the target dtype (a ScalarType code argument)."""

    def cost(args: list[_Arg]) -> OpCost | None:
        src = args[0] if args else None
        if src is None or src.dims is None:
            return None
        out_size = src.size
        for i in dtype_at:
            code = _int(args, i)
            if code is not None and code in SCALAR_TYPE_BYTES:
                out_size = SCALAR_TYPE_BYTES[code]
                break
        return OpCost(0.0, float(src.numel * (src.size + out_size)))

    return cost


def _free(args: list[_Arg]) -> OpCost | None:  # metadata-only ops (views, allocations): no HBM traffic
    return OpCost(0.0, 0.0)


def _gather_rows(args: list[_Arg]) -> OpCost | None:
    # embedding(weight[V,D], indices[...]): read the indices and the selected rows, write the rows
    w, idx = args[0], args[1]
    if w.dims is None or idx.dims is None or len(w.dims) != 2:
        return None
    rows = idx.numel * w.dims[1] * w.size
    return OpCost(0.0, float(idx.nbytes + 2 * rows))


def _index_select(args: list[_Arg]) -> OpCost | None:  # index_select(self[V,D], dim, index[N])
    return _gather_rows([args[0], args[2]]) if len(args) > 2 else None


def _rotary(args: list[_Arg]) -> OpCost | None:
    # rotary_embedding(positions[T], query[T,...], key[T,...], head_size, cos_sin_cache[P,R], is_neox):
    # q and k rotated in place (read + write), one cache row read per position
    pos, q, k, cache = args[0], args[1], args[2], args[4] if len(args) > 4 else None
    if pos.dims is None or q.dims is None or cache is None or cache.dims is None:
        return None
    kb = k.nbytes if k.dims is not None else 0
    rows = pos.numel * cache.dims[-1] * cache.size
    elems = q.numel + (k.numel if k.dims is not None else 0)
    return OpCost(3.0 * elems, float(pos.nbytes + 2 * (q.nbytes + kb) + rows))


def _kv_write(args: list[_Arg]) -> OpCost | None:
    # reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, ...) and SGLang store_cache:
    # the new keys/values are read and written into their slots; the caches themselves are not swept
    k, v = args[0], args[1]
    if k.dims is None or v.dims is None:
        return None
    slots = args[4].nbytes if len(args) > 4 and args[4].dims is not None else 0
    return OpCost(0.0, float(2 * (k.nbytes + v.nbytes) + slots))


def _fused_add_norm(args: list[_Arg]) -> OpCost | None:
    # fused_add_rms_norm(input!, residual!, weight, eps) / rmsnorm2d_fwd_with_add(x, residual, weight, eps):
    # x and residual read, normed x and the new residual written, weight read
    x, r, w = args[0], args[1], args[2]
    if x.dims is None or r.dims is None or w.dims is None:
        return None
    return OpCost(5.0 * x.numel, float(2 * (x.nbytes + r.nbytes) + w.nbytes))


_VIEWS = (
    "view", "_unsafe_view", "as_strided", "slice", "select", "transpose", "t", "expand", "unsqueeze",
    "squeeze", "permute", "alias", "unbind", "split", "split_with_sizes", "chunk", "narrow", "detach",
    "detach_", "lift_fresh", "empty", "empty_like", "empty_strided", "resize_", "numpy_T", "_reshape_alias",
)  # fmt: skip

# Ops that only cost anything when a kernel was attributed to them (then they copied): read + write once.
_COPY_IF_LAUNCHED = ("clone", "contiguous", "reshape", "flatten")

_UNARY = {
    "silu": 4.0, "gelu": 8.0, "relu": 1.0, "sigmoid": 4.0, "tanh": 4.0, "exp": 1.0, "log": 1.0, "neg": 1.0,
    "rsqrt": 1.0, "sqrt": 1.0, "abs": 1.0, "cos": 1.0, "sin": 1.0, "pow": 1.0, "reciprocal": 1.0,
    "softmax": 5.0, "_softmax": 5.0, "log_softmax": 5.0, "_log_softmax": 5.0, "rms_norm": 4.0,
    "_fused_rms_norm": 4.0, "gelu_tanh": 8.0, "tril": 0.0, "triu": 0.0,
}  # fmt: skip

_BINARY = (
    "add", "sub", "mul", "div", "where", "maximum", "minimum", "eq", "ne", "lt", "gt", "le", "ge",
    "masked_fill", "addcmul", "lerp", "bitwise_and", "bitwise_or", "logical_and", "logical_not",
)  # fmt: skip

_REDUCE = ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "norm", "linalg_vector_norm",
           "cumsum", "var", "std", "all", "any")  # fmt: skip


def _layer_norm(args: list[_Arg]) -> OpCost | None:  # layer_norm(x, normalized_shape, weight?, bias?, eps)
    ts = _tensors(args)
    if not ts:
        return None
    return OpCost(5.0 * ts[0].numel, float(sum(t.nbytes for t in ts) + ts[0].nbytes))


def _build_table() -> dict[str, Callable[[list[_Arg]], OpCost | None]]:
    table: dict[str, Callable[[list[_Arg]], OpCost | None]] = {
        "aten::mm": _mm,
        "aten::addmm": _addmm,
        "aten::bmm": _bmm,
        "aten::baddbmm": _baddbmm,
        "aten::matmul": _matmul,
        "aten::linear": _linear,
        "aten::_scaled_mm": _scaled_mm,
        "_C::cutlass_scaled_mm": _out_first_gemm,
        "vllm::rocm_unquantized_gemm": _linear,
        "aiter::gemm_a16w16": _linear,
        # attention, PyTorch SDPA family: [B, H, S, D]; the causal flag's argument index per schema
        "aten::scaled_dot_product_attention": _sdpa(5),
        "aten::_scaled_dot_product_flash_attention": _sdpa(4),
        "aten::_scaled_dot_product_flash_attention_for_cpu": _sdpa(4),
        "aten::_scaled_dot_product_efficient_attention": _sdpa(6),
        "aten::_scaled_dot_product_cudnn_attention": _sdpa(6),
        "aten::_scaled_dot_product_attention_math": _sdpa(5),
        # FlashAttention family: [B, S, H, D] or varlen [T, H, D]
        "aten::_flash_attention_forward": _flash_bshd(8, varlen=False),
        "aten::_efficient_attention_forward": _efficient_attention,
        "flash_attn::_flash_attn_forward": _flash_bshd(5, varlen=False),
        "flash_attn::_flash_attn_varlen_forward": _flash_bshd(9, varlen=True),
        "aiter::mha_batch_prefill": _aiter_batch_prefill,
        # norms
        "aten::layer_norm": _layer_norm,
        "aten::native_layer_norm": _layer_norm,
        "aten::group_norm": _layer_norm,
        "_C::rms_norm": _all_tensors(4.0, of=1),
        "_C::fused_add_rms_norm": _fused_add_norm,
        "vllm::rocm_aiter_rms_norm": _like_first(4.0),
        "vllm::rocm_aiter_rmsnorm2d_fwd_with_add": _fused_add_norm,
        "aiter::rms_norm": _like_first(4.0),
        "aiter::rmsnorm": _all_tensors(4.0, of=1),
        "aiter::add_rmsnorm": _all_tensors(5.0, of=1),
        "aiter::rmsnorm2d_fwd": _all_tensors(4.0, of=1),
        "aiter::rmsnorm2d_fwd_with_add": _all_tensors(5.0, of=1),
        "aiter::rmsnorm2d_fwd_with_add_ck": _all_tensors(5.0, of=1),
        "sgl_kernel::rmsnorm": _all_tensors(4.0, of=1),
        "sgl_kernel::fused_add_rmsnorm": _fused_add_norm,
        # activations with an output argument: silu_and_mul(out[T,d], x[T,2d])
        "_C::silu_and_mul": _all_tensors(5.0, of=0),
        "_C::gelu_and_mul": _all_tensors(9.0, of=0),
        "_C::gelu_tanh_and_mul": _all_tensors(9.0, of=0),
        "sgl_kernel::silu_and_mul": _all_tensors(5.0, of=0),
        "sgl_kernel::gelu_and_mul": _all_tensors(9.0, of=0),
        # RoPE and KV-cache writes
        "_C::rotary_embedding": _rotary,
        "sgl_kernel::rotary_embedding": _rotary,
        "_C_cache_ops::reshape_and_cache_flash": _kv_write,
        "_C_cache_ops::reshape_and_cache": _kv_write,
        "sglang::store_cache": _kv_write,
        "vllm::unified_kv_cache_update": _kv_write,
        # copies and casts
        "aten::copy_": _all_tensors(),
        "aten::to": _to_copy((1, 2)),
        "aten::_to_copy": _to_copy((1,)),
        "aten::fill_": _write_only,
        "aten::zero_": _write_only,
        "aten::embedding": _gather_rows,
        "aten::index_select": _index_select,
    }
    for name in _VIEWS:
        table[f"aten::{name}"] = _free
    for name in _COPY_IF_LAUNCHED:
        table[f"aten::{name}"] = _like_first(0.0)
    for name, per_elem in _UNARY.items():
        table[f"aten::{name}"] = _like_first(per_elem)
        table[f"aten::{name}_"] = _pointwise_
    for name in _BINARY:
        table[f"aten::{name}"] = _pointwise
        table[f"aten::{name}_"] = _pointwise_
    for name in _REDUCE:
        table[f"aten::{name}"] = _reduce
    return table


_COSTS = _build_table()


def op_cost(
    op_name: str, input_dims: list, input_types: list, concrete_inputs: list | None = None
) -> OpCost | None:
    """Bytes and FLOPs of one CPU-op call from its Kineto record_shapes arguments; None when unknown.

    `input_dims`, `input_types` and `concrete_inputs` are the event's "Input Dims", "Input type" and
    "Concrete Inputs" lists. Tensors of a dtype the table does not know count as non-tensors."""
    fn = _COSTS.get(op_name)
    if fn is None or not isinstance(input_dims, list) or not isinstance(input_types, list):
        return None
    args = _args(input_dims, input_types, concrete_inputs)
    if not args:
        return None
    try:
        return fn(args)
    except (IndexError, TypeError, ValueError, ZeroDivisionError):
        return None  # a schema other than the one the rule expects: unknown rather than wrong


# GEMM ops whose (M, N, K) the shape label gives: name -> (index of A[M,K], index of B, B is [N,K]?)
_GEMM_OPERANDS = {
    "aten::mm": (0, 1, False), "aten::addmm": (1, 2, False), "aten::_scaled_mm": (0, 1, False),
    "aten::linear": (0, 1, True), "aten::bmm": (0, 1, False), "aten::baddbmm": (1, 2, False),
}  # fmt: skip
_BATCHED = ("aten::bmm", "aten::baddbmm")


def shape_label(op_name: str, input_dims: Any) -> str | None:
    """A call's shape, to split an op's rows by shape: `M×N×K` for a GEMM (`B×M×N×K` batched), else the
    first two tensor inputs' dims (attention's q and k: `32×64×64, 32×8×64`); None without shapes."""
    if not isinstance(input_dims, list):
        return None
    tensors = [d for d in input_dims if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    where = _GEMM_OPERANDS.get(op_name)
    if where is not None and len(input_dims) > max(where[:2]):
        a, b = input_dims[where[0]], input_dims[where[1]]
        if isinstance(a, list) and isinstance(b, list) and len(a) >= 2 and len(b) >= 2:
            batched = op_name in _BATCHED and len(a) == 3
            m, k = a[1] if batched else math.prod(a[:-1]), a[-1]
            n = b[-2] if where[2] else b[-1]
            batch = f"{a[0]}×" if batched else ""
            return f"{batch}{m}×{n}×{k}"
    return ", ".join("×".join(map(str, d)) for d in tensors[:2]) or None  # attention: q and k


def paged_attention_cost(input_dims: Any, input_types: Any, keys: int, pairs: int | None) -> OpCost | None:
    """Cost of one paged-attention call (`vllm::unified_attention_with_output(q[T,Hq,D], k[T,Hkv,D],
    v, out, …)`) whose K/V length the engine's step annotation gives: `keys` = KV positions the step's
    rows read (sum of their context lengths: the annotation's `sk`), `pairs` = (query, key) pairs
    (`sqsk`; a decode row's one query meets each of its keys once). Bytes: each key's K and V once per KV
    head, plus q read and out written; FLOPs: 2·D per pair per query head for QKᵀ and as many for PV.
    An upper bound on traffic for sliding-window layers, which read fewer keys than the annotation."""
    if not isinstance(input_dims, list) or not isinstance(input_types, list) or len(input_dims) < 4:
        return None
    q, k = input_dims[0], input_dims[1]
    size = DTYPE_BYTES.get(input_types[1] if len(input_types) > 1 else "", 0)
    if size == 0 or not (isinstance(q, list) and isinstance(k, list) and len(q) == 3 and len(k) == 3):
        return None
    (_, hq, d), (_, hkv, _) = q, k
    nbytes = keys * hkv * d * 2 * size + 2 * math.prod(q) * size
    flops = 4.0 * hq * d * (pairs if pairs is not None else 0)
    return OpCost(flops=flops, bytes=float(nbytes))


def op_dtype(input_types: Sequence[str]) -> str | None:
    """The peak-table dtype ("bf16", "fp16", "fp32", "fp8") of an op's first floating tensor, else None."""
    for t in input_types:
        if t in DTYPE_CLASS:
            return DTYPE_CLASS[t]
    return None


# --- devices -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DevicePeak:
    """Peak HBM bandwidth and dense tensor-core FLOP rates of one device, with where they come from."""

    name: str
    peak_tbps: float
    peak_tflops: dict[str, float]  # by dtype: bf16 / fp16 / fp32 / fp8 / tf32 (dense, no 2:4 sparsity)
    source: str

    def tflops_for(self, dtype: str | None) -> float:
        """Peak TFLOP/s for an op of this dtype: the dtype's entry, else bf16's (the common serving dtype).
        fp32 means the non-tensor FP32 rate (PyTorch does not use TF32 for matmuls by default)."""
        if dtype is not None and dtype in self.peak_tflops:
            return self.peak_tflops[dtype]
        return self.peak_tflops.get("bf16", max(self.peak_tflops.values()))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "peak_tbps": self.peak_tbps, "peak_tflops": dict(self.peak_tflops),
                "source": self.source}  # fmt: skip


def _tf(bf16: float, fp8: float | None, fp32: float, tf32: float) -> dict[str, float]:
    out = {"bf16": bf16, "fp16": bf16, "fp32": fp32, "tf32": tf32}
    if fp8 is not None:
        out["fp8"] = fp8
    return out


_NV_H = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100); dense = half the sparse"
DEVICES: dict[str, DevicePeak] = {
    "h100-sxm": DevicePeak("NVIDIA H100 SXM", 3.35, _tf(989.4, 1978.9, 66.9, 494.7), _NV_H),
    "h100-pcie": DevicePeak("NVIDIA H100 PCIe", 2.0, _tf(756.0, 1513.0, 51.2, 378.0), _NV_H),
    "h100-nvl": DevicePeak("NVIDIA H100 NVL", 3.9, _tf(835.0, 1670.0, 60.0, 417.5), _NV_H),
    "h200": DevicePeak(
        "NVIDIA H200 SXM", 4.8, _tf(989.4, 1978.9, 66.9, 494.7),
        "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 SXM column; dense = "
        "half the sparse figure",
    ),
    "h200-nvl": DevicePeak(
        "NVIDIA H200 NVL", 4.8, _tf(835.0, 1670.0, 60.0, 417.5),
        "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column; dense = half the sparse figure",
    ),
    "h200-measured": DevicePeak(
        "NVIDIA H200 SXM (measured copy bandwidth)", 4.28, _tf(989.4, 1978.9, 66.9, 494.7),
        "bandwidth: 4.28 TB/s device copy measured on this project's H200 (README, 'Where the time goes', "
        "commit 7028a2a); FLOP rates: NVIDIA H200 datasheet",
    ),
    "gh200": DevicePeak(
        "NVIDIA GH200 (96 GB HBM3)", 4.0, _tf(989.4, 1978.9, 66.9, 494.7),
        "NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3: 4 TB/s); dense = half the sparse figure",
    ),
    "gh200-144g": DevicePeak(
        "NVIDIA GH200 (144 GB HBM3e)", 4.9, _tf(989.4, 1978.9, 66.9, 494.7),
        "NVIDIA GH200 Grace Hopper Superchip datasheet (144 GB HBM3e: 4.9 TB/s); dense = half the sparse",
    ),
    "b200": DevicePeak(
        "NVIDIA B200 (HGX)", 8.0, _tf(2250.0, 4500.0, 75.0, 1100.0),
        "NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx): 4.5 PF FP16/BF16, 9 PF FP8, "
        "2.2 PF TF32 with sparsity (dense = half), 75 TF FP32, 8 TB/s (later datasheets: 7.7 TB/s)",
    ),
    "mi300x": DevicePeak(
        "AMD Instinct MI300X", 5.3, _tf(1307.4, 2614.9, 163.4, 653.7),
        "AMD Instinct MI300X data sheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html): "
        "5.3 TB/s HBM3, dense matrix FP16/BF16 1307.4, FP8 2614.9, TF32 653.7, FP32 163.4 TFLOP/s",
    ),
    "a100-sxm": DevicePeak(
        "NVIDIA A100 SXM 80GB", 2.039, _tf(312.0, None, 19.5, 156.0),
        "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (dense)",
    ),
    "a100-pcie": DevicePeak(
        "NVIDIA A100 PCIe 80GB", 1.935, _tf(312.0, None, 19.5, 156.0),
        "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB PCIe column (dense)",
    ),
    "a100-40gb": DevicePeak(
        "NVIDIA A100 40GB", 1.555, _tf(312.0, None, 19.5, 156.0),
        "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB column (dense)",
    ),
}  # fmt: skip

_GIB = 1024**3


def _by_name(name: str, mem: float) -> str | None:
    n = name.lower()
    if "mi300x" in n:
        return "mi300x"
    if "gh200" in n:
        return "gh200-144g" if mem > 120 * _GIB or "144" in n else "gh200"
    if "h200" in n:
        return "h200-nvl" if "nvl" in n else "h200"
    if "h100" in n:
        return "h100-pcie" if "pcie" in n else "h100-nvl" if "nvl" in n else "h100-sxm"
    if "b200" in n:
        return "b200"
    if "a100" in n:
        if 0 < mem < 60 * _GIB or "40gb" in n:
            return "a100-40gb"
        return "a100-pcie" if "pcie" in n else "a100-sxm"
    return None


def _by_shape(props: dict[str, Any]) -> str | None:
    # ROCm builds of Kineto may leave the name empty (vLLM's MI300X traces): 304 CUs, wave64, gfx94x, 192 GB
    sms, warp, mem = props.get("numSms"), props.get("warpSize"), float(props.get("totalGlobalMem") or 0)
    major, minor = props.get("computeMajor"), props.get("computeMinor")
    if warp == 64 and sms == 304 and major == 9 and minor == 4 and 150 * _GIB < mem < 200 * _GIB:
        return "mi300x"
    return None


def _normalize(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def device_names() -> list[str]:
    return list(DEVICES)


def device_for(device_properties: list[dict] | None, override: str | None = None) -> DevicePeak | None:
    """The device of a trace from its top-level `deviceProperties`, or from an explicit override.

    `override` is a table key ("h200", "mi300x", "h200-measured", ...) or a device name that the name rules
    recognise ("NVIDIA H100 PCIe"); an override that matches nothing raises ValueError (a typo should not
    silently drop the peaks). Properties that match no rule give None."""
    if override:
        key = _normalize(override)
        if key in DEVICES:
            return DEVICES[key]
        found = _by_name(override, 0.0)
        if found is None:
            raise ValueError(f"unknown device {override!r}; known: {', '.join(DEVICES)}")
        return DEVICES[found]
    for props in device_properties or []:
        if not isinstance(props, dict):
            continue
        mem = float(props.get("totalGlobalMem") or 0)
        key = _by_name(str(props.get("name") or ""), mem) or _by_shape(props)
        if key is not None:
            return DEVICES[key]
    return None


# --- achieved vs floor -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Achieved:
    """Achieved rates of a call and its distance from the roofline floor (None where no device is known)."""

    achieved_tbps: float | None
    achieved_tflops: float | None
    pct_of_peak: float | None  # floor_us / actual us * 100: 100 = on the roofline
    bound: str | None  # "memory" | "compute": which roof sets the floor
    floor_us: float | None  # max(bytes / peak bandwidth, FLOPs / peak FLOP rate)

    def to_dict(self) -> dict[str, Any]:
        return {"achieved_tbps": self.achieved_tbps, "achieved_tflops": self.achieved_tflops,
                "pct_of_peak": self.pct_of_peak, "bound": self.bound, "floor_us": self.floor_us}  # fmt: skip


def floor_us(cost: OpCost, device: DevicePeak, dtype: str | None) -> tuple[float, str]:
    """Roofline time of a call (µs) and the roof that sets it. 1 TB/s = 1e6 bytes per µs."""
    mem_us = cost.bytes / (device.peak_tbps * 1e6)
    peak = device.tflops_for(dtype)
    flop_us = cost.flops / (peak * 1e6) if peak > 0 else 0.0
    return (mem_us, "memory") if mem_us >= flop_us else (flop_us, "compute")


def achieved(cost: OpCost, gpu_us: float, device: DevicePeak | None, dtype: str | None) -> Achieved:
    """Achieved TB/s and TFLOP/s of `cost` done in `gpu_us`, and the share of the roofline bound reached."""
    if gpu_us <= 0:
        return Achieved(None, None, None, None, None)
    tbps, tflops = cost.bytes / gpu_us / 1e6, cost.flops / gpu_us / 1e6
    if device is None:
        return Achieved(tbps, tflops, None, None, None)
    floor, bound = floor_us(cost, device, dtype)
    return Achieved(tbps, tflops, 100.0 * floor / gpu_us, bound, floor)
