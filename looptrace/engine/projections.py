"""Fused projections (ExactLoop): q/k/v and gate/up as one GEMM each, and the startup check that grades it.

One GEMM over the concatenated weights computes the same dot products as the separate GEMMs, but the
library may pick another algorithm for the wider output, so bits can differ. The toggle is R0 only where
`fused_gemm_is_exact` finds every tested row count bitwise equal on the device in use; otherwise R3.
The slices of the fused output are strided views, and the check covers their consumer too: on a CPU
with AVX-512, `silu` of a strided tensor takes PyTorch's scalar loop while a contiguous one takes the
vectorised loop, whose `exp` differs in the last bit (measured: ouro-tiny's states all differed, its
tokens did not), so there the toggle is R3 although the GEMMs agree bit for bit.
Huginn and OLMo checkpoints already store fused `Wqkv` / `fc` weights: only Ouro changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from looptrace.engine.model_config import ModelSpec

CHECK_ROWS = (1, 2, 3, 8, 17, 64, 257)  # row buckets: decode batches, graph sizes, eager prefill


def fuse_model_projections(model: nn.Module) -> int:
    """Fuse every module that supports it; returns how many were fused."""
    fused = 0
    for module in model.modules():
        if module is not model and hasattr(module, "fuse_projections"):
            module.fuse_projections()
            fused += 1
    return fused


def fused_gemm_is_exact(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0) -> bool:
    """Do `linear(x, cat(W1, W2, ...))` slices equal `linear(x, Wi)` bit for bit for the model's shapes?"""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h, nh, kvh, d, inter = (
        spec.hidden_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.intermediate_size,
    )
    for widths in ((nh * d, kvh * d, kvh * d), (inter, inter)):
        weights = [(torch.randn(w, h, generator=gen) * h**-0.5).to(device, dtype) for w in widths]
        fused = torch.cat(weights)
        for rows in CHECK_ROWS:
            x = torch.randn(rows, h, generator=gen).to(device, dtype)
            parts = F.linear(x, fused).split(list(widths), dim=-1)
            alone = [F.linear(x, w) for w in weights]
            if not all(torch.equal(p, a) for p, a in zip(parts, alone)):
                return False
            if len(widths) == 2 and not torch.equal(F.silu(parts[0]) * parts[1], F.silu(alone[0]) * alone[1]):
                return False  # the MLP's consumer of the strided gate/up slices
    return True


def stack_loop_weights(model: nn.Module):
    """Ouro's core weights stacked by layer for `kernels.persistent_loop` (one pointer per weight kind, the
    layer an offset): returns a `LoopWeights` and re-points every layer's parameters (and the fused q/k/v
    and gate/up tensors, where `fuse_projections` made them) at views of the stacks, so the model holds
    each weight once and its checkpoint names do not change."""
    # deferred: the kernel module imports Triton (CUDA only); the plan checked it runs here
    from looptrace.engine.kernels.persistent_loop import LoopWeights

    layers = list(model.model.layers)
    parts = {
        "qkv": [[lay.self_attn.q_proj, lay.self_attn.k_proj, lay.self_attn.v_proj] for lay in layers],
        "o": [[lay.self_attn.o_proj] for lay in layers],
        "gate_up": [[lay.mlp.gate_proj, lay.mlp.up_proj] for lay in layers],
        "down": [[lay.mlp.down_proj] for lay in layers],
        "norms": [
            [
                lay.input_layernorm,
                lay.input_layernorm_2,
                lay.post_attention_layernorm,
                lay.post_attention_layernorm_2,
            ]
            for lay in layers
        ],  # fmt: skip
    }
    stacks = {name: _stack(modules) for name, modules in parts.items()}
    for lay, qkv, gate_up in zip(layers, stacks["qkv"], stacks["gate_up"]):
        if lay.self_attn.qkv is not None:
            lay.self_attn.qkv = qkv
        if lay.mlp.gate_up is not None:
            lay.mlp.gate_up = gate_up
    spec = model.spec
    return LoopWeights(
        qkv=stacks["qkv"],
        o=stacks["o"],
        gate_up=stacks["gate_up"],
        down=stacks["down"],
        norms=stacks["norms"].view(len(layers), 4, spec.hidden_size),
        final_norm=model.model.norm.weight.detach(),
        eps=spec.rms_norm_eps,
        heads=(spec.num_heads, spec.num_kv_heads, spec.head_dim),
    )


def _stack(modules_per_layer: list[list[nn.Module]]) -> torch.Tensor:
    """`[L, rows, cols]` of each layer's weights concatenated by rows (norm weights count as one row each);
    each module's weight becomes a view of its rows."""
    stacked = torch.stack(
        [torch.cat([_as_rows(m.weight.detach()) for m in mods]) for mods in modules_per_layer]
    )
    for layer, mods in enumerate(modules_per_layer):
        start = 0
        for m in mods:
            rows = _as_rows(m.weight).shape[0]
            view = stacked[layer, start : start + rows]
            m.weight = nn.Parameter(view.view(m.weight.shape), requires_grad=False)
            start += rows
    return stacked


def _as_rows(weight: torch.Tensor) -> torch.Tensor:
    return weight if weight.dim() == 2 else weight.view(1, -1)
