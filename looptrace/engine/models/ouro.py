"""Ouro (ByteDance): every layer is looped; 4-norm sandwich block; the final norm closes every loop and
its output feeds the next loop; a learned exit gate after each loop. Tensor names = the public checkpoint.

The plain classes are the eager reference. The kernel variants below them (fused projections, exact
SiLU·mul, the fused tails and the GEMV's fused forms) are subclasses that `engine/assemble.py` swaps in
where the engine plan turns their setting on; each overrides one step of the forward and falls back to
it where its kernel does not apply (row count, shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from looptrace.engine.layers import (
    AttnContext,
    Embedding,
    ExitGate,
    LMHead,
    PagedAttention,
    PendingNorm,
    ResidualRMSNorm,
    ResidualTail,
    RMSNorm,
    RotaryHalf,
    exact_kernels_on,
    finish,
    materialized,
    project,
)
from looptrace.engine.model_config import ModelSpec
from looptrace.engine.models.base import LoopedModel


class OuroAttention(nn.Module):
    op_kind = "attention"

    def __init__(self, spec: ModelSpec, layer_id: int, rope: RotaryHalf) -> None:
        super().__init__()
        h, nh, kvh, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(h, nh * d, bias=False)
        self.k_proj = nn.Linear(h, kvh * d, bias=False)
        self.v_proj = nn.Linear(h, kvh * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        self.rope = [rope]  # shared module, kept out of this layer's state dict
        self.paged = PagedAttention(layer_id, nh, kvh, d)
        self.shape = (nh, kvh, d)
        self.qkv: torch.Tensor | None = None  # set by fuse_projections()

    def fuse_projections(self) -> None:
        """q/k/v as one GEMM: the three weights become views of one concatenated tensor (no extra memory,
        checkpoint names unchanged). `assemble` then swaps in `FusedQKVOuroAttention`, which reads it."""
        self.qkv = _fuse([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor | PendingNorm, ctx: AttnContext, tail: ResidualTail | None = None):
        """o_proj of the attention output; with a tail, the tail's (h', x') after it (`finish`)."""
        nh, kvh, d = self.shape
        q, k, v = self.project_qkv(x)
        q, k, v = q.reshape(-1, nh, d), k.reshape(-1, kvh, d), v.reshape(-1, kvh, d)
        return finish(self.o_proj, self.attend(q, k, v, ctx), tail)

    def project_qkv(self, x: torch.Tensor | PendingNorm):
        x = materialized(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def attend(self, q, k, v, ctx: AttnContext) -> torch.Tensor:
        q, k = self.rope[0](q, k, ctx.cos, ctx.sin)
        return self.paged(q, k, v, ctx)


class FusedQKVOuroAttention(OuroAttention):
    """`kernels.fused_projections`: one GEMM for q/k/v, the three outputs are slices of it."""

    fused_linear = staticmethod(F.linear)  # the fused GEMM (`GemvFusedLinear`: the Triton GEMV)

    def project_qkv(self, x: torch.Tensor | PendingNorm):
        nh, kvh, d = self.shape
        return project(x, self.qkv, self.fused_linear).split([nh * d, kvh * d, kvh * d], dim=-1)


class GemvFusedLinear:
    """`kernels.gemv` on a fused projection (mixed into FusedQKVOuroAttention / FusedGateUpOuroMLP): the
    concatenated weight's GEMM through the Triton GEMV where it applies (`GemvLinear` for plain ones)."""

    gemv_batch = False  # one row through the GEMV (`GemvBatchFusedLinear`: up to 8, `kernels.gemv_batch`)

    @staticmethod
    def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels.gemv import forms as gemv_forms  # imports Triton

        return gemv_forms.linear(x, weight, bias)


class GemvBatchFusedLinear(GemvFusedLinear):
    """`kernels.gemv_batch` on a fused projection: `GemvFusedLinear` routing up to `tiles.MAX_ROWS` rows
    (the output forms installed over it read `gemv_batch` and follow)."""

    gemv_batch = True

    @staticmethod
    def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels.gemv import forms as gemv_forms  # imports Triton

        return gemv_forms.linear(x, weight, bias, route_rows=gemv_forms.route_rows(batch=True))


class RopeWriteOuroAttention(OuroAttention):
    """`kernels.rope_kv_write` (exact, Triton attention): RoPE of q and k and the K/V cache write as one
    exact kernel, then the paged kernel on the written cache; the separate ops below the exact scope."""

    def attend(self, q, k, v, ctx: AttnContext) -> torch.Tensor:
        if not exact_kernels_on(q.shape[0]):
            return super().attend(q, k, v, ctx)
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels import rope  # imports Triton: only where a kernel runs

        q = rope.rope_half_write_kv(
            q, k, v, ctx.cos, ctx.sin, ctx.k_cache, ctx.v_cache, ctx.write_entry, ctx.write_offset,
            self.paged.layer_id,
        )  # fmt: skip
        return self.paged.attend_written(q, ctx)


class GemvRopeOuroAttention(RopeWriteOuroAttention):
    """`kernels.gemv_rope_out` (with `rope_kv_write`, fused q/k/v and the GEMV): the one-row q/k/v GEMV
    rotates q and k itself and writes the K/V cache, the same bits as the GEMV + `rope_half_write_kv`;
    under `kernels.gemv_batch` (`gemv_batch` from `GemvBatchFusedLinear`) so do its 2-8 row launches."""

    def forward(self, x: torch.Tensor | PendingNorm, ctx: AttnContext, tail: ResidualTail | None = None):
        if exact_kernels_on(1):  # where rope_kv_write runs for the form's rows (at most 8: under capture)
            # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
            from looptrace.engine.kernels import gemv_rope  # imports Triton: only where a kernel runs
            from looptrace.engine.kernels.gemv.forms import route_rows

            x = materialized(x)
            rows = route_rows(getattr(self, "gemv_batch", False))
            if gemv_rope.qkv_rope_fusable(
                x, self.qkv, ctx.cos, ctx.sin, ctx.k_cache, ctx.v_cache, self.shape, rows
            ):
                q = gemv_rope.qkv_rope_write(
                    x, self.qkv, ctx.cos, ctx.sin, ctx.k_cache, ctx.v_cache, ctx.write_entry,
                    ctx.write_offset, self.paged.layer_id, self.shape,
                )  # fmt: skip
                return finish(self.o_proj, self.paged.attend_written(q, ctx), tail)
        return super().forward(x, ctx, tail)


class OuroMLP(nn.Module):
    op_kind = "mlp"

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

        self.gate_up: torch.Tensor | None = None  # set by fuse_projections()

    def fuse_projections(self) -> None:
        """gate/up as one GEMM (`FusedGateUpOuroMLP` reads it)."""
        self.gate_up = _fuse([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor | PendingNorm, tail: ResidualTail | None = None):
        """down_proj of SiLU(gate)·up; with a tail, the tail's (h', x') after it (`finish`)."""
        gate, up = self.project_gate_up(x)
        return self.down(gate, up, tail)

    def project_gate_up(self, x: torch.Tensor | PendingNorm):
        x = materialized(x)
        return self.gate_proj(x), self.up_proj(x)

    def down(self, gate: torch.Tensor, up: torch.Tensor, tail: ResidualTail | None):
        return finish(self.down_proj, self.activation(gate, up), tail)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class FusedGateUpOuroMLP(OuroMLP):
    """`kernels.fused_projections`: one GEMM for gate/up, the two halves are slices of it."""

    fused_linear = staticmethod(F.linear)  # the fused GEMM (`GemvFusedLinear`: the Triton GEMV)

    def project_gate_up(self, x: torch.Tensor | PendingNorm):
        return project(x, self.gate_up, self.fused_linear).chunk(2, dim=-1)


class ExactOuroMLP(OuroMLP):
    """`kernels.exact`: SiLU·mul as one fenced Triton kernel where it pays, the same bits."""

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if exact_kernels_on(gate.shape[0]):
            # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
            from looptrace.engine.kernels import silu_mul  # imports Triton: only where a kernel runs

            return silu_mul.silu_mul(gate, up)
        return super().activation(gate, up)


class GemvSiluOuroMLP(OuroMLP):
    """`kernels.gemv_silu`: the one-row down projection computes SiLU·mul of its input itself (no tail:
    the residual norm's own forms need the projection's output)."""

    def down(self, gate: torch.Tensor, up: torch.Tensor, tail: ResidualTail | None):
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels.gemv import forms as gemv_forms  # imports Triton

        if tail is None and gemv_forms.silu_mul_fusable(gate, up, self.down_proj.weight):
            # the same bits as the two launches
            return gemv_forms.silu_mul_linear(gate, up, self.down_proj.weight)
        return super().down(gate, up, tail)


class GemvSiluOutOuroMLP(OuroMLP):
    """`kernels.gemv_silu_out` (fused gate/up): the one-row gate/up GEMV stores SiLU·mul itself; under
    `kernels.gemv_batch` (`gemv_batch` from `GemvBatchFusedLinear`) so do its 2-8 row launches."""

    def forward(self, x: torch.Tensor | PendingNorm, tail: ResidualTail | None = None):
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels.gemv import forms as gemv_forms  # imports Triton

        x = materialized(x)
        rows = gemv_forms.route_rows(getattr(self, "gemv_batch", False))
        if gemv_forms.gate_up_silu_fusable(x, self.gate_up, rows):  # the same bits as the GEMV + silu_and_mul
            return finish(self.down_proj, gemv_forms.gate_up_silu(x, self.gate_up), tail)
        return super().forward(x, tail)


def _fuse(linears: list[nn.Linear]) -> torch.Tensor:
    fused = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


class OuroLayer(nn.Module):
    """Sandwich: post-norms applied before the residual add, plus the usual pre-norms.

    Fused form (`kernels.residual_norm`, `forward(h, ctx, x, next_norm)`): the caller passes the residual
    stream h and its pre-normed x = input_layernorm(h); each post-norm + residual add + following pre-norm
    is one `ResidualRMSNorm` launch, the last one with the next layer's input norm (or the loop's final
    norm), so the layer returns (h, next_norm(h)). Same ops, same order, same bits as the plain form.
    With `defer` (`kernels.gemv_norm`, one row) each of those launches is left to the projection that
    reads its x: the layer takes and returns (None, PendingNorm) in place of (h, x). With
    `gemv_norm_out` (one row) each runs inside the o / down GEMV launch before it (`ResidualTail`)."""

    op_kind = "layer"

    def __init__(self, spec: ModelSpec, layer_id: int, rope: RotaryHalf) -> None:
        super().__init__()
        self.layer_role, self.layer_index = "core", layer_id
        eps = spec.rms_norm_eps
        self.self_attn = OuroAttention(spec, layer_id, rope)
        self.mlp = OuroMLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(spec.hidden_size, eps)
        self.residual_attn, self.residual_mlp = ResidualRMSNorm(), ResidualRMSNorm()

    def forward(self, h, ctx: AttnContext, x=None, next_norm: RMSNorm | None = None, defer: bool = False):
        if next_norm is not None:
            norms = (self.input_layernorm_2, self.post_attention_layernorm)
            h, x = self._block(
                self.self_attn, (x, ctx), ResidualTail(self.residual_attn, h, x, *norms, defer)
            )
            norms = (self.post_attention_layernorm_2, next_norm)
            return self._block(self.mlp, (x,), ResidualTail(self.residual_mlp, h, x, *norms, defer))
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h), ctx))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))

    def _block(self, block: nn.Module, args: tuple, tail: ResidualTail):
        """(h', x') of the fused chain after `block(*args)` (attention or MLP): the tail runs after the
        block returns, so the residual norm stays an op of its own beside it, as profiles and probes
        expect."""
        return tail.after(block(*args))


class GemvNormOutOuroLayer(OuroLayer):
    """`kernels.gemv_norm_out` (with `residual_norm`): the block hands its output projection to the tail,
    whose one-row o / down GEMV applies the residual norm itself (`ResidualTail.finish`)."""

    def _block(self, block: nn.Module, args: tuple, tail: ResidualTail):
        tail.in_gemv = True
        return block(*args, tail)


class OuroModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.rotary = RotaryHalf(spec.head_dim, spec.rope_theta)
        self.layers = nn.ModuleList(OuroLayer(spec, i, self.rotary) for i in range(spec.n_core))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.early_exit_gate = ExitGate(spec.hidden_size, 1, bias=True)


class OuroForCausalLM(LoopedModel):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = OuroModel(spec)
        self.lm_head = LMHead(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_embeddings:  # no public Ouro ties; a config that says so gets one shared matrix
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def rope(self) -> nn.Module:
        return self.model.rotary

    def prelude(self, tokens, ctx):
        return self.model.embed_tokens(tokens), None

    def first_state(self, embedded):
        return embedded  # the first loop reads the embedding; later loops read the normed loop output

    def core(self, state, inject, ctx):
        state = self.loop(state, ctx)
        return state, self.model.early_exit_gate(state).squeeze(-1)

    def loop(self, state, ctx):
        """One pass over every layer, then the final norm (the new state)."""
        for layer in self.model.layers:
            state = layer(state, ctx)
        return self.model.norm(state)

    def head(self, hidden):
        return self.lm_head(hidden)


class ChainedOuroForCausalLM(OuroForCausalLM):
    """`kernels.residual_norm` (exact): the loop with every layer in its fused form, where the exact
    kernels run. Each layer's last launch also computes the next layer's input norm; the last layer's
    computes the loop's final norm, which is the new state."""

    def loop(self, state, ctx):
        if not exact_kernels_on(state.shape[0]):
            return super().loop(state, ctx)
        layers = self.model.layers
        defer = self.defers(state.shape[0])
        h, x = state, layers[0].input_layernorm(state)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, x = layer(h, ctx, x, next_norm, defer)
        return materialized(x)  # the loop's final norm is the state: launched on its own

    def defers(self, rows: int) -> bool:
        """Whether each residual norm is left to the projection that reads it (`DeferredNorm...`)."""
        return False


class PersistentLoop(nn.Module):
    """`kernels.persistent_loop`'s op: one loop of Ouro (every core layer, then the final norm) as one
    persistent launch over the core weights stacked by layer (`projections.stack_loop_weights`). An op
    module of its own, so probes put a range around the launch and the profile's roofline prices it."""

    op_kind = "persistent_loop"
    # Decode rows the engine sends through the launch. The kernel takes up to 8 (and its own checks pass
    # there), but on an H100 the engine's `fast` at 8 concurrent requests hit an illegal memory access
    # with the launch on, cause not yet found, while one row ran clean through every call; so more rows
    # take the layer-by-layer path until a GPU run finds it.
    max_rows = 1

    def __init__(self, weights) -> None:
        super().__init__()
        self.weights = weights  # LoopWeights: views of the model's parameters, no state of its own
        # Decode rows -> how the last loop of that many rows ran: in one launch (which form) or layer by
        # layer and why (`route`). Set where the model runs a loop (eager steps and graph captures: a
        # graph replays what its capture chose); the engine's snapshot copies it for observers.
        self.routes: dict[int, str] = {}

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor one launch streams (the roofline's floor bytes)."""
        w = self.weights
        return w.qkv, w.o, w.gate_up, w.down, w.norms, w.final_norm

    def route(self, state: torch.Tensor, ctx: AttnContext) -> tuple[bool, str]:
        """Whether this op takes the loop, and how or why not, in words."""
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels import persistent_loop as pl  # imports Triton: only where it runs

        if state.shape[0] > self.max_rows:
            return False, f"{state.shape[0]} rows: the engine sends the register form up to {self.max_rows}"
        if not pl.loop_fusable(state, self.weights, ctx.cos, ctx.sin, ctx.k_cache, ctx.v_cache, ctx.tables):
            return False, "shapes or layouts the persistent loop does not take"
        return True, "one launch per loop (register form)"

    def fits(self, state: torch.Tensor, ctx: AttnContext) -> bool:
        if ctx.packed is not None:  # prefill: always layer by layer
            return False
        taken, how = self.route(state, ctx)
        self.routes[state.shape[0]] = how if taken else f"layer by layer ({how})"
        return taken

    def forward(self, state: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels import persistent_loop as pl  # imports Triton: only where it runs

        return pl.loop_persistent(
            state, self.weights, ctx.cos, ctx.sin, ctx.k_cache, ctx.v_cache, ctx.write_entry,
            ctx.write_offset, ctx.tables, ctx.ctx_lens, ctx.block_size,
        )  # fmt: skip


class StreamedPersistentLoop(PersistentLoop):
    """`kernels.persistent_loop_tma` over `kernels.persistent_loop`'s op (this class swapped in): one-row
    loops as one Gluon launch streaming the weights through a TMA ring in shared memory
    (`kernels/stream_loop.py`) where that form runs (a Hopper GPU, shapes it takes); the other loops the op
    takes go through the register form."""

    # The stages of one layer inside the launch, in order: each ends where every program has finished it.
    stages = ("qkv", "attention", "o", "gate_up", "down")
    # An observer's clock (probes/ring_clock.py sets it around eager runs; None for the engine's own runs
    # and every graph capture): int64 [programs, stamps_per_program()] that each ring launch fills with
    # every program's GPU clock (ns) at its start, at its arrival at and departure from each stage's end
    # (stamps 1 + 10 l + 2 k and 2 + 10 l + 2 k for stage k of layer l), and at its end.
    stage_clock: torch.Tensor | None = None
    RING = "one launch per loop (TMA ring)"  # the route of a loop the ring takes (`route`, `routes`)

    def stamps_per_program(self) -> int:
        return 2 + 2 * len(self.stages) * self.weights.qkv.shape[0]

    def ring_refusal(self, state: torch.Tensor, ctx: AttnContext) -> str | None:
        """Why the ring does not take this loop (None: it does)."""
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels import stream_loop as sl  # imports Triton: only where it runs

        if ctx.packed is not None:
            return "prefill"
        w = self.weights
        return sl.ring_refusal(state, w, ctx.cos, ctx.sin, ctx.k_cache, ctx.v_cache, ctx.tables)

    def ring_takes(self, state: torch.Tensor, ctx: AttnContext) -> bool:
        return self.ring_refusal(state, ctx) is None

    def route(self, state: torch.Tensor, ctx: AttnContext) -> tuple[bool, str]:
        refused = self.ring_refusal(state, ctx)
        if refused is None:
            return True, self.RING
        taken, how = super().route(state, ctx)
        return taken, how if taken else f"{refused}; {how}"

    def forward(self, state: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels import stream_loop as sl  # imports Triton: only where it runs

        if self.ring_takes(state, ctx):
            w = self.weights
            clock = None if torch.cuda.is_current_stream_capturing() else self.stage_clock
            return sl.loop_streamed(
                state, w, ctx.cos, ctx.sin, ctx.k_cache, ctx.v_cache, ctx.write_entry, ctx.write_offset,
                ctx.tables, ctx.ctx_lens, ctx.block_size, times=clock,
            )  # fmt: skip
        return super().forward(state, ctx)


class RingOnlyLoop(StreamedPersistentLoop):
    """`kernels.persistent_loop_tma` alone (as `fast` has it; `assemble` attaches it): only the loops the
    ring takes; the rest go back to the chained path, not to the register form (on an H100 a one-row loop
    through the register form is slower than the chain: 1.51 against about 1.26 ms)."""

    def route(self, state: torch.Tensor, ctx: AttnContext) -> tuple[bool, str]:
        refused = self.ring_refusal(state, ctx)
        return refused is None, self.RING if refused is None else refused


class PersistentOuroForCausalLM(ChainedOuroForCausalLM):
    """`kernels.persistent_loop` or `kernels.persistent_loop_tma` (with `residual_norm`): a loop the op
    `assemble` attaches (`persistent`) fits goes through it; other loops (prefill, more rows, shapes the
    kernels refuse) take the chained layer-by-layer path."""

    def loop(self, state, ctx):
        op = getattr(self, "persistent", None)
        if op is not None and op.fits(state, ctx):
            return op(state, ctx)
        return super().loop(state, ctx)


class DeferredNormOuroForCausalLM(ChainedOuroForCausalLM):
    """`kernels.gemv_norm` (with `residual_norm`): a one-row chain leaves each residual-norm launch to the
    GEMV of the projection that reads its output (`layers.PendingNorm`)."""

    def defers(self, rows: int) -> bool:
        return rows == 1  # the GEMV's input form takes one row
