"""The engine plan: every effective choice of an engine, resolved once from (config, model spec, device,
kernel availability) before anything is built, and read by everyone else (assemble, engine, runner,
snapshot). This is the only module of the engine that reads `EngineConfig`'s kernel settings.

A recipe asks; the plan says what runs. A setting may be asked for and still be off (loop fusion needs
fixed-depth rows; async decode needs whole-token decode; Triton needs CUDA): the plan holds the effective
value and, in `inactive_settings`, why the asked-for one has no effect. The kernel settings are resolved
from their declared requirements (`kernels/registry.py`) into a `KernelPlan` (which variants
`engine/assemble.py` installs) and a `LaunchPlan` (how every step launches its Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from looptrace.engine.config import EngineConfig
from looptrace.engine.exit_policy import FixedDepth, GateExit, make_exit_policy
from looptrace.engine.kernels import registry
from looptrace.engine.kernels.launch_mode import LaunchPlan
from looptrace.engine.kv_cache import LAYOUTS, KVLayout
from looptrace.engine.model_config import ModelSpec
from looptrace.engine.request import EngineInputError, Stage

# How a RECURRENT batch runs (one class per mode: decode_modes.DECODE_MODES).
ASYNC_WHOLE_TOKEN = "async_whole_token"  # whole-token steps submitted before the last one's tokens are read
WHOLE_TOKEN = "whole_token"  # prelude, every loop and the coda in one step
FUSED_LOOPS = "fused_loops"  # every loop of a row in one step; prelude and coda apart
ASYNC_GATE = "async_gate"  # one loop a step, its exit gate read one step late
RECURRENT = "recurrent"  # one loop a step, its exit gate read at once

# The fused tail kernels a recipe may ask for (kernels.<name>), in report order.
FUSED_TAILS = ("kernels.residual_norm", "kernels.rope_kv_write")


@dataclass(frozen=True)
class KernelPlan:
    """The `kernels.*` settings that act on this engine (registry names, in registry order): the variants
    `assemble` installs. Asked-for settings that do not act are in `EnginePlan.inactive_settings`."""

    active: tuple[str, ...] = ()

    def __contains__(self, setting: str) -> bool:
        return setting in self.active


# The order inactive settings are reported in (the order the engine used to find them in).
REPORT_ORDER = ("kernels.exact", "kernels.attention", *FUSED_TAILS, "cuda_graphs", "scheduler.async_decode")


@dataclass(frozen=True)
class EnginePlan:
    max_loops: int  # S: exit.max_loops, else the model's default depth
    exit_policy: FixedDepth | GateExit = field(compare=False, repr=False)
    layout: KVLayout = field(compare=False, repr=False)
    # Kernels
    kernels: KernelPlan  # the active kernel settings (the variants assemble installs)
    launch: LaunchPlan  # how every step launches the Triton kernels (entered once per step)
    exact_kernels: bool  # kernels.exact on CUDA with Triton
    triton_attention: bool  # kernels.attention=triton on CUDA with Triton (the runner builds no mask)
    fused_tails: tuple[str, ...]  # the fused tail kernels active on this model
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


def resolve_plan(
    cfg: EngineConfig, spec: ModelSpec, device: torch.device, kernels_on: bool, pdl_on: bool = False
) -> EnginePlan:
    """The plan of an engine for `spec` on `device`; `kernels_on`: Triton kernels can run here; `pdl_on`:
    so can programmatic dependent launches (compute capability 9+)."""
    cuda = device.type == "cuda"
    max_loops = cfg.exit.max_loops or spec.default_loops
    exit_policy = make_exit_policy(cfg.exit, max_loops, has_gate=spec.family == "ouro")
    layout = LAYOUTS[cfg.kv.layout](spec, max_loops)
    devices = {
        registry.CUDA_TRITON: cuda and kernels_on,
        registry.PDL: cuda and kernels_on and pdl_on,
        registry.NO_PERTURB: not cfg.debug.perturb,
    }
    kernel_plan, kernel_reasons = resolve_kernels(cfg, spec.family, devices)
    exact, triton = "kernels.exact" in kernel_plan, "kernels.attention" in kernel_plan
    fuse = cfg.scheduler.loop_fusion and not exit_policy.can_exit_early
    # Not on the shared layout: a speculative loop overwrites the token's one KV slot, which a rollback
    # cannot restore (depth planes keep the exit loop's slot and copy it deeper).
    async_gate = cfg.scheduler.async_gate and exit_policy.needs_gate and not fuse and layout.num_planes > 1
    whole_token = fuse and cfg.scheduler.whole_token
    async_decode = whole_token and cfg.scheduler.async_decode
    inactive = in_report_order({**kernel_reasons, **_inactive_settings(cfg, cuda, async_decode)})
    return EnginePlan(
        max_loops=max_loops,
        exit_policy=exit_policy,
        layout=layout,
        kernels=kernel_plan,
        launch=LaunchPlan(
            dependent="kernels.pdl" in kernel_plan,
            weight_preload="kernels.gemv_preload" in kernel_plan,
            kv_prefetch="kernels.attn_prefetch" in kernel_plan,
        ),
        exact_kernels=exact,
        triton_attention=triton,
        fused_tails=tuple(n for n in FUSED_TAILS if n in kernel_plan),
        fused_projections="kernels.fused_projections" in kernel_plan,
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


def resolve_kernels(cfg: EngineConfig, family: str, devices: dict[str, bool]) -> tuple[KernelPlan, dict]:
    """The kernel settings that act, and why each other asked-for one does not (the first requirement of
    its registry entry not met). Entries come in registry order, so a required setting is resolved before
    the settings that require it."""
    runs_here: set[str] = set()  # asked for, every requirement met but the family one
    active: list[str] = []
    reasons: dict[str, str] = {}
    for entry in registry.ENTRIES:
        if getattr(cfg.kernels, entry.setting.removeprefix("kernels.")) != entry.value:
            continue
        unmet = [r for r in entry.requires if not _met(r, family, entry, devices, runs_here)]
        if not any(r.name != registry.FAMILY for r in unmet):
            runs_here.add(entry.setting)
        if unmet:
            reasons[entry.setting] = unmet[0].reason.format(family=family)
        else:
            active.append(entry.setting)
    return KernelPlan(tuple(active)), reasons


def _met(req: registry.Requirement, family: str, entry, devices: dict[str, bool], runs_here: set) -> bool:
    if req.name == registry.FAMILY:
        return family in entry.families
    if req.name in devices:
        return devices[req.name]
    return req.name in runs_here


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


def _inactive_settings(cfg: EngineConfig, cuda: bool, async_decode: bool) -> dict:
    """Why each setting outside `kernels` asked for has no effect here."""
    out: dict[str, str] = {}
    if not cuda:
        out["cuda_graphs"] = "CUDA graphs run only on CUDA"
    if cfg.scheduler.async_decode and not async_decode:
        out["scheduler.async_decode"] = "needs whole-token decode at a fixed depth"
    if cfg.debug.perturb_ulps != 1 and not cfg.debug.perturb:
        out["debug.perturb_ulps"] = "needs debug.perturb (the place it sizes)"
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
