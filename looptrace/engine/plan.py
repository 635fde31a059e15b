"""The engine plan: every effective choice of an engine, resolved once from (config, model spec, device,
kernel availability) before anything is built, and read by everyone else (engine, runner, snapshot).

A recipe asks; the plan says what runs. A setting may be asked for and still be off (loop fusion needs
fixed-depth rows; async decode needs whole-token decode; Triton needs CUDA): the plan holds the effective
value and, in `inactive_settings`, why the asked-for one has no effect. Nobody re-reads the raw setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from looptrace.engine.config import EngineConfig
from looptrace.engine.exit_policy import FixedDepth, GateExit, make_exit_policy
from looptrace.engine.kv_cache import LAYOUTS, KVLayout
from looptrace.engine.model_config import ModelSpec
from looptrace.engine.request import EngineInputError, Stage

# How a RECURRENT batch runs (the engine keeps one small strategy per mode: LLMEngine.DECODE_MODES).
ASYNC_WHOLE_TOKEN = "async_whole_token"  # whole-token steps submitted before the last one's tokens are read
WHOLE_TOKEN = "whole_token"  # prelude, every loop and the coda in one step
FUSED_LOOPS = "fused_loops"  # every loop of a row in one step; prelude and coda apart
ASYNC_GATE = "async_gate"  # one loop a step, its exit gate read one step late
RECURRENT = "recurrent"  # one loop a step, its exit gate read at once

# The fused tail kernels a recipe may ask for (kernels.<name>), in report order.
FUSED_TAILS = ("kernels.residual_norm", "kernels.rope_kv_write")
# The order inactive settings are reported in (the order the engine used to find them in).
REPORT_ORDER = ("kernels.exact", "kernels.attention", *FUSED_TAILS, "cuda_graphs", "scheduler.async_decode")


@dataclass(frozen=True)
class EnginePlan:
    max_loops: int  # S: exit.max_loops, else the model's default depth
    exit_policy: FixedDepth | GateExit = field(compare=False, repr=False)
    layout: KVLayout = field(compare=False, repr=False)
    # Kernels
    exact_kernels: bool  # kernels.exact on CUDA with Triton
    triton_attention: bool  # kernels.attention=triton on CUDA with Triton (the runner builds no mask)
    fused_tails: tuple[str, ...]  # fused tail kernels to try on the model (each may lack one for the family)
    fused_projections: bool
    # Decode
    fuse_loops: bool  # a decode row that cannot exit early runs all its loops in one submission
    async_gate: bool
    whole_token: bool
    async_decode: bool
    decode_mode: str  # one of the mode names above
    decode_entry: Stage  # where a token re-enters decode: PRELUDE, or RECURRENT under whole-token decode
    loops_per_decode_step: int  # S under loop fusion, else 1 (the scheduler's prefill share)
    whole_token_max_rows: int  # larger whole-token batches run their three phases one after another
    # Prefill
    packed_prefill: bool
    split_depth: bool  # LoopDuet split depth: P may be below S for non-endpoint prompt rows
    prefill_loops: int | None  # P at start (None: S)
    p_max: int | None  # the queue-age controller's ceiling
    # CUDA graph families the runner captures (names as in LLMEngine.graph_counters)
    graphs: frozenset[str]
    # Settings asked for but without effect on this device, and why (reported in run headers)
    inactive_settings: dict[str, str] = field(default_factory=dict, compare=False)


def resolve_plan(cfg: EngineConfig, spec: ModelSpec, device: torch.device, kernels_on: bool) -> EnginePlan:
    """The plan of an engine for `spec` on `device`; `kernels_on`: Triton kernels can run here."""
    cuda = device.type == "cuda"
    max_loops = cfg.exit.max_loops or spec.default_loops
    exit_policy = make_exit_policy(cfg.exit, max_loops, has_gate=spec.family == "ouro")
    layout = LAYOUTS[cfg.kv.layout](spec, max_loops)
    exact = cfg.kernels.exact and cuda and kernels_on
    triton = cfg.kernels.attention == "triton" and cuda and kernels_on
    fuse = cfg.scheduler.loop_fusion and not exit_policy.can_exit_early
    # Not on the shared layout: a speculative loop overwrites the token's one KV slot, which a rollback
    # cannot restore (depth planes keep the exit loop's slot and copy it deeper).
    async_gate = cfg.scheduler.async_gate and exit_policy.needs_gate and not fuse and layout.num_planes > 1
    whole_token = fuse and cfg.scheduler.whole_token
    async_decode = whole_token and cfg.scheduler.async_decode
    inactive = _inactive_settings(cfg, cuda, exact, triton, async_decode)
    return EnginePlan(
        max_loops=max_loops,
        exit_policy=exit_policy,
        layout=layout,
        exact_kernels=exact,
        triton_attention=triton,
        fused_tails=tuple(n for n in FUSED_TAILS if _wants(cfg, n) and n not in inactive),
        fused_projections=cfg.kernels.fused_projections,
        fuse_loops=fuse,
        async_gate=async_gate,
        whole_token=whole_token,
        async_decode=async_decode,
        decode_mode=_decode_mode(fuse, whole_token, async_decode, async_gate),
        decode_entry=Stage.RECURRENT if whole_token else Stage.PRELUDE,
        loops_per_decode_step=max_loops if fuse else 1,
        whole_token_max_rows=cfg.scheduler.whole_token_max_rows,
        packed_prefill=cfg.prefill.packed,
        graphs=_graph_families(cfg, cuda, fuse, whole_token),
        inactive_settings=inactive,
        **_split_depth(cfg, max_loops),
    )


def _wants(cfg: EngineConfig, name: str) -> bool:
    k = cfg.kernels
    return {"kernels.residual_norm": k.residual_norm, "kernels.rope_kv_write": k.rope_kv_write}[name]


def in_report_order(reasons: dict[str, str]) -> dict[str, str]:
    """Inactive settings in REPORT_ORDER (any other name after them)."""
    rank = {name: i for i, name in enumerate(REPORT_ORDER)}
    return dict(sorted(reasons.items(), key=lambda item: rank.get(item[0], len(rank))))


def _decode_mode(fuse: bool, whole_token: bool, async_decode: bool, async_gate: bool) -> str:
    """The flags nest (async decode needs whole-token decode, which needs loop fusion; the async gate
    needs unfused loops), so exactly one mode holds."""
    if async_decode:
        return ASYNC_WHOLE_TOKEN
    if whole_token:
        return WHOLE_TOKEN
    if fuse:
        return FUSED_LOOPS
    return ASYNC_GATE if async_gate else RECURRENT


def _graph_families(cfg: EngineConfig, cuda: bool, fuse: bool, whole_token: bool) -> frozenset[str]:
    g = cfg.cuda_graphs
    if not (cuda and g.enabled):
        return frozenset()
    wanted = {
        "recurrent": True,
        "recurrent_fused": fuse,
        "coda": g.coda,
        "prefill": g.prefill,
        "whole_token": whole_token,
    }
    return frozenset(name for name, on in wanted.items() if on)


def _inactive_settings(cfg: EngineConfig, cuda: bool, exact: bool, triton: bool, async_decode: bool) -> dict:
    """Why each setting asked for has no effect here, in report order (a fused tail the model family has
    no kernel for is added by the engine, which tries it on the model)."""
    out: dict[str, str] = {}
    if cfg.kernels.exact and not exact:
        out["kernels.exact"] = "exact Triton kernels run only on CUDA with Triton"
    if cfg.kernels.attention == "triton" and not triton:
        out["kernels.attention"] = "the Triton attention kernel runs only on CUDA"
    for name in FUSED_TAILS:
        if not _wants(cfg, name):
            continue
        if not exact:
            out[name] = "needs kernels.exact active (CUDA with Triton)"
        elif name == "kernels.rope_kv_write" and not triton:
            out[name] = "needs the Triton attention path (kernels.attention=triton)"
    if not cuda:
        out["cuda_graphs"] = "CUDA graphs run only on CUDA"
    if cfg.scheduler.async_decode and not async_decode:
        out["scheduler.async_decode"] = "needs whole-token decode at a fixed depth"
    return out


def _split_depth(cfg: EngineConfig, max_loops: int) -> dict:
    """LoopDuet split depth (S, P): P at start and the controller's ceiling, checked against S."""
    d = cfg.depth
    if not d.active:
        return {"split_depth": False, "prefill_loops": None, "p_max": None}
    p = d.prefill_loops if d.prefill_loops is not None else max_loops
    if p > max_loops:
        raise EngineInputError(f"depth.prefill_loops={p} exceeds S = exit.max_loops = {max_loops}")
    p_max = min(d.p_max if d.p_max is not None else p, max_loops)
    if d.controller != "fixed" and d.p_min > p_max:
        raise EngineInputError(f"depth.p_min={d.p_min} exceeds P_max={p_max}")
    return {"split_depth": True, "prefill_loops": p, "p_max": p_max}


@dataclass
class PrefillDepth:
    """P in force: the one choice that moves per step (the engine's queue-age controller sets it before a
    step; the runner's prefill reads it). None: every prompt row runs S loops."""

    loops: int | None = None
