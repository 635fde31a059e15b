"""Blocks shared by the raven-style families (Huginn-0125 and the OLMo-2 retrofit): fused Wqkv attention,
fused gate/up MLP (`fc` rows [gate | up]), and the `transformer.*` module tree of their checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from looptrace.engine.layers import (
    Adapter,
    AttnContext,
    Embedding,
    LMHead,
    PagedAttention,
    RMSNorm,
    RotaryHalf,
    RotaryInterleaved,
    exact_kernels_on,
)
from looptrace.engine.model_config import ModelSpec
from looptrace.engine.models.base import LoopedModel


class RavenMLP(nn.Module):
    op_kind = "mlp"

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(self.activation(gate, up))

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class ExactRavenMLP(RavenMLP):
    """`kernels.exact`: SiLU·mul as one fenced Triton kernel where it pays, the same bits."""

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if exact_kernels_on(gate.shape[0]):
            # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
            from looptrace.engine.kernels import silu_mul  # imports Triton: only where a kernel runs

            return silu_mul.silu_mul(gate, up)
        return super().activation(gate, up)


class RavenAttention(nn.Module):
    """Wqkv split [q|k|v]; Huginn adds qk_bias before RoPE, OLMo-2 norms q and k over the full width."""

    op_kind = "attention"

    def __init__(self, spec: ModelSpec, layer_id: int, rope: nn.Module) -> None:
        super().__init__()
        h, nh, kvh, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.Wqkv = nn.Linear(h, (nh + 2 * kvh) * d, bias=False)
        self.proj = nn.Linear(nh * d, h, bias=False)
        if spec.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, nh, d))
        if spec.qk_norm:
            self.q_norm = RMSNorm(nh * d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(kvh * d, spec.rms_norm_eps)
        self.has_qk_bias, self.has_qk_norm = spec.qk_bias, spec.qk_norm
        self.rope_style = spec.rope_style
        self.rope = [rope]
        self.paged = PagedAttention(layer_id, nh, kvh, d)
        self.shape = (nh, kvh, d)

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        nh, kvh, d = self.shape
        q, k, v = self.Wqkv(x).split([nh * d, kvh * d, kvh * d], dim=-1)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.reshape(-1, nh, d), k.reshape(-1, kvh, d), v.reshape(-1, kvh, d)
        q, k = self.rotate(q, k, ctx)
        return self.proj(self.paged(q, k, v, ctx))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, ctx: AttnContext):
        """q and k with the checkpoint's bias (Huginn) added, then rotated."""
        if self.has_qk_bias:
            q = q + self.qk_bias[0]
            k = k + self.qk_bias[1]
        return self.rope[0](q, k, ctx.cos, ctx.sin)


class ExactRavenAttention(RavenAttention):
    """`kernels.exact` on interleaved RoPE (Huginn): bias + RoPE of q and k as one exact kernel where it
    pays, the same bits (`assemble` installs it only where `rope_style` is interleaved)."""

    def rotate(self, q: torch.Tensor, k: torch.Tensor, ctx: AttnContext):
        if not exact_kernels_on(q.shape[0]):
            return super().rotate(q, k, ctx)
        bias = self.qk_bias if self.has_qk_bias else None  # the kernel adds it with the same rounding
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels import rope  # imports Triton: only where a kernel runs

        return rope.rope_interleaved(q, k, ctx.cos, ctx.sin, bias)


class SandwichBlock(nn.Module):
    """Huginn: norm applied after the residual add, plus pre-norms (4 norms)."""

    op_kind = "layer"

    def __init__(self, spec: ModelSpec, layer_id: int, role: str, index: int, rope: nn.Module) -> None:
        super().__init__()
        self.layer_role, self.layer_index = role, index
        eps = spec.rms_norm_eps
        self.norm_1, self.norm_2 = RMSNorm(spec.hidden_size, eps), RMSNorm(spec.hidden_size, eps)
        self.norm_3, self.norm_4 = RMSNorm(spec.hidden_size, eps), RMSNorm(spec.hidden_size, eps)
        self.attn = RavenAttention(spec, layer_id, rope)
        self.mlp = RavenMLP(spec)

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), ctx) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class PostNormBlock(nn.Module):
    """OLMo-2: no pre-norms; the output of attention / MLP is normed before the residual add."""

    op_kind = "layer"

    def __init__(self, spec: ModelSpec, layer_id: int, role: str, index: int, rope: nn.Module) -> None:
        super().__init__()
        self.layer_role, self.layer_index = role, index
        self.norm_1 = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.norm_2 = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = RavenAttention(spec, layer_id, rope)
        self.mlp = RavenMLP(spec)

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        x = x + self.norm_1(self.attn(x, ctx))
        return x + self.norm_2(self.mlp(x))


class RavenLoopedModel(LoopedModel):
    """`transformer.{wte, prelude, adapter, core_block, coda, ln_f}` + `lm_head`.

    Physical layer ids (the KV pool's layer dimension): prelude 0..P-1, core P..P+C-1, coda after that.
    """

    block_cls: type[nn.Module]
    rope_cls: str

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        if spec.rope_style == "interleaved":
            rope: nn.Module = RotaryInterleaved(spec.head_dim, spec.rope_theta, spec.max_position)
        else:
            rope = RotaryHalf(spec.head_dim, spec.rope_theta)
        self.rotary = rope
        h, p, c = spec.hidden_size, spec.n_prelude, spec.n_core

        def blocks(role: str, first: int, count: int) -> nn.ModuleList:
            return nn.ModuleList(self.block_cls(spec, first + i, role, i, rope) for i in range(count))

        self.transformer = nn.ModuleDict(
            dict(
                wte=Embedding(spec.vocab_size, h),
                prelude=blocks("prelude", 0, p),
                adapter=Adapter(2 * h, h, bias=False),
                core_block=blocks("core", p, c),
                coda=blocks("coda", p + c, spec.n_coda),
                ln_f=RMSNorm(h, spec.rms_norm_eps),
            )
        )
        self.lm_head = LMHead(h, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    @property
    def rope(self) -> nn.Module:
        return self.rotary

    def prelude(self, tokens, ctx):
        e = self.transformer.wte(tokens)
        if self.spec.embed_scale != 1.0:
            e = e * self.spec.embed_scale
        for block in self.transformer.prelude:
            e = block(e, ctx)
        return e, e

    def core(self, state, inject, ctx):
        x = self.transformer.adapter(torch.cat([state, inject], dim=-1))
        for block in self.transformer.core_block:
            x = block(x, ctx)
        return x, None

    def coda_input(self, state: torch.Tensor) -> torch.Tensor:
        """What the coda's first block reads: Huginn normalises the last state with ln_f (OLMo overrides)."""
        return self.transformer.ln_f(state)

    def coda_hidden(self, state, ctx):
        x = self.coda_input(state)
        for block in self.transformer.coda:
            x = block(x, ctx)
        return self.transformer.ln_f(x)

    def head(self, hidden):
        return self.lm_head(hidden)
