"""Engine configuration: every knob and toggle a recipe can set, validated where it is built.

Plain dataclasses with their rules in field metadata, checked by pydantic (the same schema the YAML recipes
are read with): constructing a section validates it, `validate_config` re-checks a whole (possibly mutated)
config, and both raise `ConfigError` with one line naming the key, the value and what was expected.
Numeric bounds are `ge`/`gt`/`le` metadata; cross-field rules live in each section's `check()`.

Toggles are data: each string-valued choice selects one implementation from a small table in the file that
owns that role (kv_cache.LAYOUTS, scheduler.POLICIES, exit_policy.EXIT_POLICIES, noise.NOISE).

Every setting declares its exactness **rung** (metadata `rung`): what changing it away from the base may do
to the generated tokens. R0: bitwise identical under the same batches; R1: per-row arithmetic unchanged, but
batch composition (and so GEMM shapes) may change; R2: same distribution, different random numbers; R3:
changed arithmetic that needs an accuracy check. A choice may grade each value (`{"packed": "R0", ...}`).
`toggle_rung` reads them; `looptrace diff` grades its evidence against them.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

_STRICT = {"extra": "forbid"}  # read by pydantic: unknown keys are errors
RUNGS = ("R0", "R1", "R2", "R3")


class ConfigError(ValueError):
    """An invalid engine setting; the message is one line naming the key, the value and what was expected."""


def _meta(rung: str | dict[str, str], **bounds: Any) -> dict[str, Any]:
    return {"rung": rung, **bounds}


# Upper bounds, so a typo'd huge number is a one-line error naming the key (not a native crash or a
# MemoryError): counts index int32 tensors (block tables, slot ids); depths size per-plane Python tables.
# What the accepted values cost in memory is checked before allocating (looptrace/engine/budget.py).
COUNT_MAX = 2**31 - 1
LOOPS_MAX = 1024
_FINITE = {"allow_inf_nan": False}


@dataclass
class KVConfig:
    __pydantic_config__ = _STRICT
    # `planes`: one KV plane per recurrence depth (LAST_EXITED); `shared`: one plane, every loop of a core
    # layer overwrites the same slot; `packed`: planes with dead slots removed (prelude/coda layers only in
    # plane 0), the same values at other addresses.
    layout: Literal["planes", "shared", "packed"] = field(
        default="planes", metadata=_meta({"planes": "R0", "packed": "R0", "shared": "R3"})
    )
    block_size: int = field(default=16, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    # Pool size in blocks. None: CPU gets `cpu_pool_tokens` tokens; CUDA sizes the pool from free memory.
    num_blocks: int | None = field(default=None, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    cpu_pool_tokens: int = field(default=8192, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    gpu_memory_utilization: float = field(default=0.90, metadata=_meta("R1", gt=0, le=1))
    # Blocks kept free at admission (headroom against fragmentation).
    watermark_blocks: int = field(default=0, metadata=_meta("R1", ge=0, le=COUNT_MAX))
    # Prefix cache over full blocks (chained SHA-256 keys).
    prefix_caching: bool = field(default=True, metadata=_meta("R1"))
    # When a cached page is published: `all_planes` (base) only once every plane and layer covers it (Huginn
    # never publishes); `per_plane` once each plane covers the layers it holds. A hit skips prefill rows,
    # which changes batch composition (R1); with sequential noise it also shifts the draws (see noise).
    prefix_publication: Literal["all_planes", "per_plane"] = field(
        default="all_planes", metadata=_meta({"all_planes": "R0", "per_plane": "R1"})
    )
    # Debug/test aid: fill freed blocks with a large finite value so stale history would show up.
    poison_freed_blocks: bool = field(default=False, metadata=_meta("R0"))

    def __post_init__(self) -> None:
        _validate_on_build(self)

    def check(self) -> None:
        pass


@dataclass
class SchedulerConfig:
    __pydantic_config__ = _STRICT
    # `refill`: stage choice per step (base engine default); `norefill`: cohort fill -> core -> coda.
    policy: Literal["refill", "norefill"] = field(default="refill", metadata=_meta("R1"))
    # Requests admitted and not finished at once (the carried-state slots); also the rows of one batch.
    max_num_seqs: int = field(default=8, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    max_num_batched_tokens: int = field(default=128, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    prefill_chunk_size: int = field(default=128, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    max_prefill_batches_before_decode: int = field(default=1, metadata=_meta("R1", ge=0, le=COUNT_MAX))
    min_coda_batch_size: int = field(default=1, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    admission: Literal["fcfs", "priority"] = field(default="fcfs", metadata=_meta("R1"))
    admission_scan_limit: int = field(default=64, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    max_admission_bypasses: int = field(default=8, metadata=_meta("R1", ge=0, le=COUNT_MAX))
    # Longest prompt + output (tokens). None: the model's max positions (capped by the pool).
    max_model_len: int | None = field(default=None, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    # ExactLoop: a fixed-depth decode row runs all its loops in one submission (one graph for L loops).
    loop_fusion: bool = field(default=False, metadata=_meta("R1"))
    # ExactLoop: after an L-loop fused step, admit up to L prefill batches before the next decode step.
    prefill_share: bool = field(default=False, metadata=_meta("R1"))
    # Beyond ExactLoop: a fused decode row runs its whole token (prelude, every loop, coda, head, greedy
    # sampling) in one submission, one CUDA graph per row count, for batches of at most
    # `whole_token_max_rows` rows (larger batches run the three phases in one step). Same per-row
    # arithmetic; rows that would have shared a prelude/coda batch with others now share one step (R1).
    whole_token: bool = field(default=False, metadata=_meta("R1"))
    # Async gate readback (the base engine's `_step_async` for Ouro): submit a row's next loop before its
    # last gate logit is read; the read happens after the next submission (no blocking sync per loop), and
    # a token that turns out to have exited is rolled back to its exit loop (state restored, its KV slot
    # copied deeper as for any early exit). Same per-row arithmetic; steps may hold other rows (R1). Off
    # on the shared layout (a speculative loop would overwrite the token's only KV slot).
    async_gate: bool = field(default=True, metadata=_meta("R1"))
    whole_token_max_rows: int = field(default=8, metadata=_meta("R1", ge=1, le=COUNT_MAX))
    # Beyond ExactLoop: whole-token decode without a blocking read per step. The next whole-token step is
    # submitted before the last one's tokens reach the host: a row's input token comes from a device
    # buffer the previous step wrote, and the host reads the tokens (EOS, stop, max_tokens) one step
    # later, while the GPU runs the next step. A row that stopped on EOS ran one extra token, dropped; its
    # presence in that step changes the batch of the others (R1). Batches over `whole_token_max_rows`
    # read their tokens first and run synchronously.
    async_decode: bool = field(default=False, metadata=_meta("R1"))

    def __post_init__(self) -> None:
        _validate_on_build(self)

    def check(self) -> None:
        if self.prefill_share and not self.loop_fusion:
            raise ConfigError("scheduler.prefill_share=true needs scheduler.loop_fusion=true")
        if self.whole_token and not self.loop_fusion:
            raise ConfigError("scheduler.whole_token=true needs scheduler.loop_fusion=true")
        if self.async_decode and not self.whole_token:
            raise ConfigError("scheduler.async_decode=true needs scheduler.whole_token=true")


@dataclass
class ExitConfig:
    __pydantic_config__ = _STRICT
    # `gate` (base engine): the model's exit gate, evaluated after every loop with a readback of its logit
    # (Ouro: cumulative exit probability, exit once 1 - remaining >= threshold after min_loops); a model
    # without a gate runs max_loops. `fixed`: every token runs max_loops and nothing is read back. At
    # threshold 1.0 the two give the same tokens (R0); a threshold below 1 changes depth (R3).
    policy: Literal["gate", "fixed"] = field(default="gate", metadata=_meta("R0"))
    threshold: float = field(default=1.0, metadata=_meta("R3", gt=0, le=1))
    min_loops: int = field(default=2, metadata=_meta("R3", ge=1, le=LOOPS_MAX))
    # None: the model's default depth (Ouro 4, Huginn 32).
    max_loops: int | None = field(default=None, metadata=_meta("R3", ge=1, le=LOOPS_MAX))

    def __post_init__(self) -> None:
        _validate_on_build(self)

    def check(self) -> None:
        # min_loops only gates an early exit (policy gate, threshold < 1): elsewhere it is unused, so
        # exit.max_loops=1 alone is valid.
        gated = self.policy == "gate" and self.threshold < 1.0
        if gated and self.max_loops is not None and self.min_loops > self.max_loops:
            raise ConfigError(
                f"exit.min_loops={self.min_loops} exceeds exit.max_loops={self.max_loops}: expected <="
            )


@dataclass
class GraphConfig:
    __pydantic_config__ = _STRICT
    enabled: bool = field(default=True, metadata=_meta("R0"))  # only on CUDA
    max_graphs: int = field(default=16, metadata=_meta("R0", ge=0, le=COUNT_MAX))
    max_batch_size: int = field(default=128, metadata=_meta("R0", ge=1, le=COUNT_MAX))
    # `none`: the first `max_graphs` keys stay forever (base engine); `lru`: evict the least recently used.
    eviction: Literal["none", "lru"] = field(default="none", metadata=_meta("R0"))
    # None: capture lazily on first use. A list: capture only these row counts, others run eager
    # (fallback reason `unseen_size`).
    capture_sizes: list[int] | None = field(default=None, metadata=_meta("R0"))
    # Also capture the coda (Huginn coda layers + head; Ouro head) per row count.
    coda: bool = field(default=True, metadata=_meta("R0"))
    # Capture prefill chunks too (prelude + every loop, depth-major, one graph per row count): an eager
    # prefill batch is thousands of host-bound launches. Same kernels as the eager chunk, with the exact
    # kernels where they are on (R0). Chunks it cannot hold run eager: split depth, packed prefill on the
    # torch attention path (the Triton path's packed query blocks are a graph input), hidden-state
    # observers.
    prefill: bool = field(default=False, metadata=_meta("R0"))

    def __post_init__(self) -> None:
        _validate_on_build(self)

    def check(self) -> None:
        if self.eviction == "lru" and self.max_graphs < 1:
            raise ConfigError("cuda_graphs.eviction=lru needs cuda_graphs.max_graphs >= 1 (got 0)")
        bad = [s for s in self.capture_sizes or [] if not 1 <= s <= self.max_batch_size]
        if bad:
            raise ConfigError(
                f"cuda_graphs.capture_sizes: {bad[0]} is outside 1..max_batch_size ({self.max_batch_size})"
            )


@dataclass
class KernelConfig:
    __pydantic_config__ = _STRICT
    # ExactLoop exact fused kernels (RMSNorm, RoPE, SiLU·mul with rounding fences), CUDA only: bitwise equal
    # to the eager ops, used under graph capture and for eager calls over 256 rows.
    exact: bool = field(default=False, metadata=_meta("R0"))
    # q/k/v and gate/up as one GEMM each: R0 only where a startup check finds them bitwise equal on the
    # device in use (`rung_check: device`), otherwise R3.
    fused_projections: bool = field(default=False, metadata=_meta("R0", rung_check="device"))
    # Beyond the paper, with `exact` on: a sandwich block's post-norm, residual add and next pre-norm as one
    # exact kernel (Ouro: 4 norms + 2 adds per layer-loop become 2 launches), and RoPE of q and k with the
    # K/V cache write as one (Ouro, Triton attention). The same fenced arithmetic as the single kernels.
    residual_norm: bool = field(default=False, metadata=_meta("R0"))
    rope_kv_write: bool = field(default=False, metadata=_meta("R0"))
    # Paged attention: `torch` (index_put K/V, gather the pages, SDPA: 8 kernels per layer-loop) or `triton`
    # (one K/V write kernel + one paged Triton kernel reading the row's own plane, online softmax in fp32,
    # as vLLM's Triton backend in the base engine, hence the default; CUDA only, the torch path elsewhere).
    # Another reduction order (R3); the Triton kernel is batch invariant, so recipes that share it compare
    # bit for bit.
    attention: Literal["torch", "triton"] = field(default="triton", metadata=_meta("R3"))
    # Beyond the paper, with Triton attention: the paged kernel keeps its online-softmax state per key slot
    # (no reduction over keys per tile; `kernels/paged_attention.py`) at head sizes whose default split is
    # the plain form (Ouro's 128; Huginn's 96 always uses it). Faster for one row, slower for 8-64 rows on
    # the H200. Another reduction order (R3); still batch invariant. CUDA only.
    attn_slots: bool = field(default=False, metadata=_meta("R3"))
    # Beyond the paper: projections of at most 8 rows (decode) through a bandwidth-bound split-K Triton GEMV
    # (`kernels/gemv.py`) instead of cuBLAS; another reduction order (R3), CUDA only.
    gemv: bool = field(default=False, metadata=_meta("R3"))
    # Beyond the paper, with `gemv`: projections of 2-8 rows (batched decode, and prefill chunks of at most 8
    # tokens) through the GEMV too, where `gemv` alone routes one row and leaves cuBLAS the rest. Another
    # reduction order than cuBLAS (R3); a row's bits then depend on whether it decodes alone (one-row and
    # many-row tiles differ). CUDA only.
    gemv_batch: bool = field(default=False, metadata=_meta("R3"))
    # Beyond the paper, with `gemv`: fused input forms of the one-row GEMV (`kernels/gemv.py`, X_FORM).
    # gemv_silu: the down projection computes SiLU·mul of its input slice itself (one launch fewer per
    # layer-loop); gemv_norm (with `residual_norm`): the projection after a sandwich block's residual norm
    # (Ouro's gate/up and the next layer's q/k/v) computes that norm itself. Each holds the fenced
    # arithmetic of the exact kernel it replaces, so the GEMV sees the same input bits (R0); CUDA only.
    gemv_silu: bool = field(default=False, metadata=_meta("R0"))
    gemv_norm: bool = field(default=False, metadata=_meta("R0"))
    # Beyond the paper, with `gemv`: fused output forms of the one-row GEMV (`kernels/gemv.py`, Y_FORM).
    # gemv_silu_out: the gate/up GEMV computes each block's gate and up columns in one program and stores
    # SiLU(gate)·up (no SiLU·mul launch); gemv_norm_out (with `residual_norm`): the o / down GEMV's program
    # that completes the row runs the sandwich block's residual norm over it (no residual-norm launch).
    # Each runs the fenced arithmetic of the exact kernel it replaces on the same GEMV outputs (R0); Ouro
    # only (the models with those kernels), CUDA only.
    gemv_silu_out: bool = field(default=False, metadata=_meta("R0"))
    gemv_norm_out: bool = field(default=False, metadata=_meta("R0"))
    # gemv_rope_out (with `rope_kv_write`): the q/k/v GEMV holds both members of its rotate-half pairs in
    # one program, rotates q and k with `rope_kv_write`'s fenced arithmetic and stores q, and k and v into
    # the paged cache (`kernels/gemv_rope.py`: no RoPE + K/V-write launch). R0; Ouro only, CUDA only.
    gemv_rope_out: bool = field(default=False, metadata=_meta("R0"))
    # Beyond the paper, with `gemv` and `pdl`: the one-row GEMV loads its first weight tile before its
    # `griddepcontrol.wait` (no kernel writes weights), so those loads overlap the kernel before. Moves
    # loads, not values (R0); CUDA sm_90+ only.
    gemv_preload: bool = field(default=False, metadata=_meta("R0"))
    # Beyond the paper, with `pdl`: before its `griddepcontrol.wait` the paged attention reads its row's
    # context length and page entries through L2 and prefetches its segment's K/V rows into L2 (hints:
    # they move bytes, not values, whatever the kernel before is writing). R0; CUDA sm_90+ only.
    attn_prefetch: bool = field(default=False, metadata=_meta("R0"))
    # Beyond the paper: inside CUDA graphs, each projection first prefetches the next projection's weight
    # into L2 on a side stream (`kernels/l2_prefetch.py`, Hopper bulk prefetch), so it streams while the
    # latency-bound kernels between GEMMs run. Moves bytes, not values (R0); CUDA only.
    l2_prefetch: bool = field(default=False, metadata=_meta("R0"))
    # Beyond the paper: the engine's Triton kernels launched as programmatic dependents (Hopper PDL,
    # `kernels/launch_mode.py`): a kernel starts while the one before finishes and waits for its results
    # before touching any data. Changes when kernels start, not what they compute (R0); CUDA sm_90+ only.
    pdl: bool = field(default=False, metadata=_meta("R0"))
    # Beyond the paper: a decode loop of Ouro (every layer, then the final norm) at one row as one
    # persistent Triton launch (`kernels/persistent_loop.py`): one program per SM streams every stage's
    # weights and waits for the others at stage boundaries through a device counter, not a launch. Its own
    # arithmetic (fp32 sums per 8-row unit, bf16 where the eager model rounds): R3; a row's bits do not
    # depend on the other rows. Ouro only, CUDA only; more rows, prefill and other shapes take the
    # layer-by-layer path.
    persistent_loop: bool = field(default=False, metadata=_meta("R3"))
    # Beyond the paper, with `persistent_loop`: its one-row loops as one persistent Gluon launch whose
    # weights stream through a ring of shared-memory tiles that TMA fills (`kernels/stream_loop.py`): the
    # ring runs ahead across stage and layer boundaries, where register tiles could not stay in flight.
    # Its own arithmetic (fp32 sums per 16-row item, bf16 where the eager model rounds): R3. Hopper only;
    # other rows and devices keep the register form or the layer-by-layer path.
    persistent_loop_tma: bool = field(default=False, metadata=_meta("R3"))

    def __post_init__(self) -> None:
        _validate_on_build(self)

    def check(self) -> None:
        pass


@dataclass
class PrefillConfig:
    __pydantic_config__ = _STRICT
    # ExactLoop: variable-length packed prefill across requests in one forward instead of per-row; the
    # attention reduction order changes (R3). Torch path: one SDPA block per request chunk; Triton path:
    # `kernels/packed_attention.py`, one program per block of up to 64 consecutive rows of a request.
    packed: bool = field(default=False, metadata=_meta("R3"))

    def __post_init__(self) -> None:
        _validate_on_build(self)

    def check(self) -> None:
        pass


@dataclass
class DebugConfig:
    __pydantic_config__ = _STRICT
    # Test aid for `looptrace diff --localize`: add one ulp to the output of one op, named
    # "stage:loop:layer:op" (e.g. "prefill:1:0:mlp"). Changes arithmetic on purpose (R3).
    perturb: str | None = field(default=None, metadata=_meta("R3"))
    # The size of that change in ulps of each element: 1 moves logprobs by ~1e-7 and no token; a large
    # value (e.g. 65536, about 0.4 % of each value in float32) plants a fault that changes tokens.
    perturb_ulps: int = field(default=1, metadata=_meta("R3", ge=1, le=1 << 22))

    def __post_init__(self) -> None:
        _validate_on_build(self)

    def check(self) -> None:
        pass


@dataclass
class DepthConfig:
    __pydantic_config__ = _STRICT
    # LoopDuet split depth (S, P), S = exit.max_loops: prompt positions that are not a chunk endpoint run
    # `prefill_loops` (P) core loops; every chunk endpoint and every decode row keeps S (the endpoints run
    # the remaining S - P loops as one compact batch). Needs kv.layout=shared (a skipped loop leaves the
    # position's last computed loop in the plane). None: P = S (uniform depth; bitwise the base).
    prefill_loops: int | None = field(default=None, metadata=_meta("R3", ge=1, le=LOOPS_MAX))
    # `queue_age`: before each step P = round(P_max - z (P_max - P_min)), z = clip((q - q_low) /
    # (q_high - q_low), 0, 1), q = age of the oldest admitted request still waiting for its first token.
    controller: Literal["fixed", "queue_age"] = field(
        default="fixed", metadata=_meta({"fixed": "R0", "queue_age": "R3"})
    )
    # None: prefill_loops, else S
    p_max: int | None = field(default=None, metadata=_meta("R3", ge=1, le=LOOPS_MAX))
    p_min: int = field(default=1, metadata=_meta("R3", ge=1, le=LOOPS_MAX))
    q_low: float = field(default=0.25, metadata=_meta("R3", ge=0, **_FINITE))
    q_high: float = field(default=1.0, metadata=_meta("R3", gt=0, **_FINITE))

    def __post_init__(self) -> None:
        _validate_on_build(self)

    def check(self) -> None:
        if self.q_high <= self.q_low:
            raise ConfigError(f"depth.q_high={self.q_high} must exceed depth.q_low={self.q_low}")
        if self.p_max is not None and self.p_min > self.p_max:
            raise ConfigError(f"depth.p_min={self.p_min} exceeds depth.p_max={self.p_max}")

    @property
    def active(self) -> bool:
        return self.prefill_loops is not None or self.controller != "fixed"


@dataclass
class EngineConfig:
    __pydantic_config__ = _STRICT
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    exit: ExitConfig = field(default_factory=ExitConfig)
    cuda_graphs: GraphConfig = field(default_factory=GraphConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    # Huginn/OLMo initial recurrent state: `sequential` = per-request generator, trunc-normal draws in
    # processing order (base engine; batch-mates and chunk splits shift the draws); `position_keyed` =
    # f(seed, position, channel), independent of order (R2); `zeros` = deterministic zero state (R3).
    noise: Literal["sequential", "position_keyed", "zeros"] = field(
        default="sequential", metadata=_meta({"sequential": "R0", "position_keyed": "R2", "zeros": "R3"})
    )
    debug: DebugConfig = field(default_factory=DebugConfig)
    depth: DepthConfig = field(default_factory=DepthConfig)  # LoopDuet split depth

    def __post_init__(self) -> None:
        _validate_on_build(self)

    def check(self) -> None:
        for f in fields(self):
            section = getattr(self, f.name)
            if is_dataclass(section):
                section.check()
        if self.depth.active and self.kv.layout != "shared":
            raise ConfigError(f"depth.* (split prefill depth) needs kv.layout=shared, got {self.kv.layout}")
        if self.scheduler.loop_fusion and self.exit.policy == "gate" and self.exit.threshold < 1.0:
            raise ConfigError(
                "scheduler.loop_fusion=true needs fixed-depth decode rows: exit.threshold="
                f"{self.exit.threshold} lets tokens exit early (use exit.threshold=1.0 or exit.policy=fixed)"
            )


# Validation ---------------------------------------------------------------------------------------------
_inside_pydantic = contextvars.ContextVar("inside_pydantic", default=False)


def _validate_on_build(section: Any) -> None:
    """Run the section's schema and cross-field rules once, when user code builds it (pydantic itself
    builds sections while validating; those calls are skipped)."""
    if _inside_pydantic.get():
        return
    _schema_check(type(section), config_to_dict(section), "")
    section.check()


def _schema_check(cls: type, data: dict, prefix: str) -> None:
    token = _inside_pydantic.set(True)
    try:
        _reject_bools(cls, data, prefix)
        _adapter(cls).validate_python(data, strict=False)
    except ValidationError as exc:
        raise ConfigError(format_error(exc, prefix)) from None
    finally:
        _inside_pydantic.reset(token)


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def validate_config(cfg: EngineConfig) -> EngineConfig:
    """Re-check a whole config (sections may have been mutated after they were built)."""
    _schema_check(EngineConfig, config_to_dict(cfg), "")
    cfg.check()
    return cfg


def build_config(data: dict[str, Any]) -> EngineConfig:
    """An EngineConfig from nested plain data (a recipe's mapping); raises ConfigError."""
    _schema_check(EngineConfig, data, "")
    token = _inside_pydantic.set(True)
    try:
        cfg = _adapter(EngineConfig).validate_python(data, strict=False)
    finally:
        _inside_pydantic.reset(token)
    cfg.check()
    return cfg


def format_error(exc: ValidationError, prefix: str = "") -> str:
    err = exc.errors()[0]
    path = prefix + ".".join(str(p) for p in err["loc"])
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        section = section_class(err["loc"][:-1])
        expected = ", ".join(f.name for f in fields(section)) if section else ""
        msg = f"unknown key '{path}' (expected one of: {expected})"
    else:
        msg = f"{path}: {err['msg']} (got {err.get('input')!r})"
    more = len(exc.errors()) - 1
    return msg + (f" [+{more} more]" if more else "")


def _reject_bools(cls: type, data: Any, path: str) -> None:
    """pydantic's lax mode reads `true` as 1 for an int field; a bool is only accepted for bool fields."""
    if not isinstance(data, dict):
        return
    by_name = {f.name: f for f in fields(cls)}
    for key, value in data.items():
        f = by_name.get(key)
        if f is None:
            continue
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(sub, type) and is_dataclass(sub):
            _reject_bools(sub, value, f"{path}{key}.")
        elif isinstance(value, bool) and "bool" not in str(f.type):
            raise ConfigError(f"{path}{key}: expected {f.type}, got a boolean ({value!r})")


def section_class(loc: Any) -> type | None:
    """The config dataclass at a key path (() is EngineConfig), or None if the path is not a section."""
    cls: type = EngineConfig
    for part in loc:
        f = {f.name: f for f in fields(cls)}.get(str(part))
        sub = f.default_factory if f is not None else None
        if not (isinstance(sub, type) and is_dataclass(sub)):
            return None
        cls = sub
    return cls


# Rungs --------------------------------------------------------------------------------------------------
def setting_paths(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Flat {"section.key": value} of every setting."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            out.update(setting_paths(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def _field_at(path: str) -> dataclasses.Field:
    *sections, key = path.split(".")
    cls = section_class(sections)
    by_name = {f.name: f for f in fields(cls)} if cls else {}
    if key not in by_name:
        raise ConfigError(f"unknown setting '{path}'")
    return by_name[key]


def toggle_rung(path: str, a: Any, b: Any) -> str:
    """The declared rung of changing setting `path` from value `a` to `b` (R0 when they are equal)."""
    if a == b:
        return "R0"
    rung = _field_at(path).metadata.get("rung", "R3")
    if isinstance(rung, dict):
        return max(rung.get(str(a), "R3"), rung.get(str(b), "R3"), key=RUNGS.index)
    return rung


def rung_check(path: str) -> str | None:
    """'device' when the declared rung holds only where a startup check on the device confirms it."""
    return _field_at(path).metadata.get("rung_check")


def config_differences(a: EngineConfig, b: EngineConfig) -> dict[str, tuple[Any, Any]]:
    pa, pb = setting_paths(a), setting_paths(b)
    return {k: (pa[k], pb[k]) for k in pa if pa[k] != pb[k]}


def config_to_dict(obj: Any) -> Any:
    """Nested dataclass -> plain dict (for JSON metadata)."""
    if is_dataclass(obj):
        return {f.name: config_to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, list):
        return [config_to_dict(x) for x in obj]
    return obj
