"""Op categories of kernels in traces without looptrace's ranges, and the layer a module path names.

A kernel's category comes from the CPU ops that launched it (its ancestry on the launching thread, inner
→ outer), else from its own name:

1. the innermost ancestor that names a *composite* op (communication, MoE, MoE routing, attention, KV
   write, RMSNorm, LayerNorm, other norms, RoPE, convolution, interpolation, activation, sampling): a fused
   op's kernels belong to it, whatever they are (a GEMM inside `vllm::moe_forward` is MoE);
2. else the innermost ancestor that names a *generic* op (GEMM, copy/cast, reduce, elementwise);
3. else the kernel name (the same two tiers), else `other`.

These are TraceLens's categories where it has them (GEMM, attention, RMSNorm, RoPE, KV write, MoE,
elementwise, reduce, other), finer where it lumps: activation, copy/cast and MoE routing are their own
rows here (TraceLens counts the first two as elementwise and routing as other), and on an eager
Hugging Face trace SDPA is attention and `aten::cat` copy/cast (TraceLens: other). Collectives (NCCL,
RCCL, gloo, c10d; names in `collectives`) are `communication`, never a compute reduce or copy. Vision ops
are named for what they are: LayerNorm (not RMSNorm), convolution, interpolation (an upsample is not
sampling).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from looptrace.probes.classify import is_copy_kernel_name
from looptrace.probes.collectives import is_comm_name

GEMM = "GEMM"
ATTENTION = "attention"
KV_WRITE = "KV write"
RMSNORM = "RMSNorm"
LAYERNORM = "LayerNorm"
NORM = "normalization"  # batch, group and instance norm
CONV = "convolution"
INTERPOLATION = "interpolation"
COMM = "communication"
# Device operations that are not kernels: their own rows, so that kernel rows add up to the kernel count
# (a cuBLAS workspace memset under aten::mm is not a GEMM kernel).
MEMCPY = "memcpy"
MEMSET = "memset"
MEMORY = (MEMCPY, MEMSET)
ROPE = "RoPE"
ACTIVATION = "activation"
MOE = "MoE"
MOE_ROUTING = "MoE routing"
SAMPLING = "sampling"
COPY = "copy/cast"
ELEMENTWISE = "elementwise"
REDUCE = "reduce"
OTHER = "other"
CATEGORIES = (
    GEMM, ATTENTION, KV_WRITE, RMSNORM, LAYERNORM, NORM, ROPE, ACTIVATION, MOE, MOE_ROUTING, SAMPLING, CONV,
    INTERPOLATION, COMM, COPY, ELEMENTWISE, REDUCE, OTHER, MEMCPY, MEMSET,
)  # fmt: skip

# Composite ops: (category, pattern on the op name, lower-cased). Order matters: first match wins.
_COMPOSITE: tuple[tuple[str, re.Pattern[str]], ...] = (
    (KV_WRITE, re.compile(r"reshape_and_cache|kv_cache_update|store_kvcache|store_cache|set_kv_buffer")),
    (MOE_ROUTING, re.compile(r"^topk$|sorttokens|moe_align|topk_softmax|grouped_topk|routing")),
    (MOE, re.compile(r"moe_forward|fused_moe|fused_experts|\bmoe\b|::moe_|_moe$|experts")),
    (ATTENTION, re.compile(r"attention|attn|flash_|fmha|mha_|paged_attention|sdpa|scaled_dot_product")),
    (RMSNORM, re.compile(r"rms_?norm|_norm_fwd")),
    (LAYERNORM, re.compile(r"layer_?norm")),
    (NORM, re.compile(r"batch_?norm|group_?norm|instance_?norm")),
    (ROPE, re.compile(r"rotary|rope")),
    # aten::conv1d/2d/3d, _conv_depthwise2d, convolution, cudnn_/mkldnn_/miopen_convolution, conv_transpose
    (CONV, re.compile(r"^aten::_?conv\w*$|convolution|conv_transpose")),
    # before sampling: `upsample_bilinear2d` resamples an image, it does not sample a token
    (INTERPOLATION, re.compile(r"upsample|interpolat|grid_sampler|affine_grid")),
    (ACTIVATION, re.compile(r"silu|gelu|swiglu|act_and_mul|relu|sigmoid|tanh|softplus")),
    (SAMPLING, re.compile(r"sampl|argmax|multinomial|top_p|top_k_|logsoftmax|log_softmax")),
)
# Generic ops, by name (aten and similar).
_GEMM_OPS = re.compile(
    r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmv|mv|dot|einsum)$|gemm|_scaled_mm|matmul"
)
_COPY_OPS = re.compile(
    r"^aten::(copy_|_to_copy|to|cat|clone|contiguous|index_select|gather|index|embedding|constant_pad_nd"
    r"|pad|fill_|zero_|zeros|ones|full|new_zeros|stack|index_put_|scatter_?|_unsafe_index|item"
    r"|_local_scalar_dense)$"
)
_REDUCE_OPS = re.compile(
    r"^aten::(sum|mean|max|min|amax|amin|all|any|prod|norm|var|std|cumsum|argmin|softmax|_softmax|topk)$"
)
_ELEMENTWISE_OPS = re.compile(r"^aten::\w+_?$")  # any other ATen op that reached a kernel

# Kernel names (lower-cased), when no ancestor says.
_KERNEL_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # looptrace's own Triton kernels (engine/kernels/) are named here too: inside a whole-token graph
    # replay without a matching eager body, the kernel name is all there is.
    (KV_WRITE, re.compile(r"reshape_and_cache|store_kvcache|concat_and_cache|^_write_kv_kernel$")),
    (ATTENTION, re.compile(r"attention|fmha|flash_fwd|flash_bwd|mha_fwd|paged_attention|^_attn_kernel$")),
    (RMSNORM, re.compile(r"rmsnorm|rms_norm|^_residual_norm_kernel$")),
    (LAYERNORM, re.compile(r"layer_?norm")),
    (NORM, re.compile(r"batch_?norm|group_?norm|instance_?norm|\bbn_fw")),
    (ROPE, re.compile(r"rotary|^_rope_\w*kernel$")),
    (MOE, re.compile(r"moe|matmul_ogs")),
    # before GEMM: cuDNN/CUTLASS convolutions are implicit GEMMs (`sm90_xmma_fprop_implicit_gemm_…`)
    (CONV, re.compile(r"conv(?!ert)|fprop|dgrad|wgrad|winograd|implicit_gemm|igemm")),
    (INTERPOLATION, re.compile(r"upsample|interpolat|grid_sampler")),
    (GEMM, re.compile(r"gemm|^cijk_|cutlass|xmma|cublas|hipblaslt|_mm_|splitk|nvjet|wgmma")),
    (ACTIVATION, re.compile(r"silu|gelu|act_and_mul")),
    (COPY, re.compile(r"copy_kernel|catarraybatchedcopy|^memcpy |^memset |gather|index_select")),
    (REDUCE, re.compile(r"reduce_kernel|softmax|cumsum|scan")),
    (ELEMENTWISE, re.compile(r"elementwise_kernel|triton_poi_|triton_per_|triton_red_")),
)

_LAYER_MODULE_RE = re.compile(r"^nn\.Module: \w*?(?:DecoderLayer|Layer|Block)_(\d+)$")
_LAYER_PATH_RE = re.compile(r"(?:^|[./])(?:layers|h|blocks|layer)\.(\d+)\.")


@functools.lru_cache(maxsize=1 << 16)  # pure in the name; names repeat across events
def composite_category(op: str) -> str | None:
    if is_comm_name(op):
        return COMM
    name = op.lower()
    return next((cat for cat, pattern in _COMPOSITE if pattern.search(name)), None)


@functools.lru_cache(maxsize=1 << 16)  # pure in the name; names repeat across events
def generic_category(op: str) -> str | None:
    if op.startswith("triton_"):  # Inductor records each Triton kernel launch as a CPU op of its name
        return kernel_category(op)
    name = op.lower()
    if _GEMM_OPS.search(name):
        return GEMM
    if _COPY_OPS.match(name):
        return COPY
    if _REDUCE_OPS.match(name):
        return REDUCE
    if _ELEMENTWISE_OPS.match(name):
        return ELEMENTWISE
    return None


@functools.lru_cache(maxsize=1 << 16)  # pure in the name; names repeat across events
def kernel_category(kernel: str) -> str:
    if is_comm_name(kernel):  # before copy: an NCCL all-gather kernel is not a copy/cast
        return COMM
    if is_copy_kernel_name(kernel):
        return COPY
    name = kernel.lower()
    return next((cat for cat, pattern in _KERNEL_RULES if pattern.search(name)), OTHER)


def categorize(ancestry: Sequence[str], kernel: str) -> tuple[str, int | None]:
    """(category, index into `ancestry` of the op that decided it, None when the kernel name did).
    `ancestry` holds the launching CPU ops' names, outer → inner."""
    for tier in (composite_category, generic_category):
        for i in range(len(ancestry) - 1, -1, -1):
            cat = tier(ancestry[i])
            if cat is not None:
                return cat, i
    return kernel_category(kernel), None


def layer_index(names: Sequence[str]) -> int | None:
    """Layer of the innermost module that names one: `nn.Module: Qwen2DecoderLayer_3` (Kineto's module
    events number a class's instances in call order) or a path such as `model.layers.3.mlp`."""
    for name in reversed(names):
        m = _LAYER_MODULE_RE.match(name) or _LAYER_PATH_RE.search(name)
        if m:
            return int(m.group(1))
    return None


LT_OP_CATEGORIES = {
    "norm": RMSNORM,
    "rope": ROPE,
    "attention": ATTENTION,
    "paged_attention": ATTENTION,
    "kv_copy": KV_WRITE,
    "sample": SAMPLING,
    "head": GEMM,
    "gate": GEMM,
    "embed": COPY,
}


def lt_category(op: str | None, kernel: str) -> str:
    """Category of a kernel in looptrace's own trace: from its lt.op range where that names one kind,
    else (mlp, adapter, graph, ...) from the kernel name."""
    by_name = kernel_category(kernel)
    if by_name == GEMM:  # a projection inside lt.op/attention is a GEMM, as in other engines' traces
        return GEMM
    if op in LT_OP_CATEGORIES:
        return LT_OP_CATEGORIES[op]
    return by_name
