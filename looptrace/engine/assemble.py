"""Assemble: the engine plan applied to the model, in one place, from outside the model (as gpt-fast applies
its optimizations). For each kernel setting the plan leaves active (`plan.kernels`, resolved from
`kernels/registry.py`), the module variants of that setting are swapped in: `module.__class__` becomes the
variant, a subclass of the module's class whose forward runs the kernel and falls back to the plain one
where the kernel does not apply. Weights, buffers, hooks and checkpoint names stay what they are, because
the module object stays the same; only its class changes.

Two variants of one module stack (e.g. Ouro's MLP with fused gate/up, the exact SiLU·mul and the gate/up
GEMV's SiLU·mul form): `install` composes the variant with the module's current class, so each variant
overrides one step of the forward and calls the next with `super()`.

`kernels.l2_prefetch` is the one setting still applied by wrapping: its prefetcher wraps every projection
(`kernels/l2_prefetch.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from looptrace.engine import kernels
from looptrace.engine.layers import (
    ExactRMSNorm,
    ExactRotaryHalf,
    GemvBatchLinear,
    GemvLinear,
    KeySlotPagedAttention,
    PagedAttention,
    RMSNorm,
    RotaryHalf,
    TritonPagedAttention,
)
from looptrace.engine.model_config import ModelSpec
from looptrace.engine.models.ouro import (
    ChainedOuroForCausalLM,
    DeferredNormOuroForCausalLM,
    ExactOuroMLP,
    FusedGateUpOuroMLP,
    FusedQKVOuroAttention,
    GemvBatchFusedLinear,
    GemvFusedLinear,
    GemvNormOutOuroLayer,
    GemvRopeOuroAttention,
    GemvSiluOuroMLP,
    GemvSiluOutOuroMLP,
    OuroAttention,
    OuroForCausalLM,
    OuroLayer,
    OuroMLP,
    PersistentLoop,
    PersistentOuroForCausalLM,
    RingOnlyLoop,
    RopeWriteOuroAttention,
    StreamedPersistentLoop,
)
from looptrace.engine.models.raven_blocks import ExactRavenAttention, ExactRavenMLP, RavenAttention, RavenMLP
from looptrace.engine.plan import EnginePlan
from looptrace.engine.projections import fuse_model_projections, fused_gemm_is_exact, stack_loop_weights


def _interleaved(module: nn.Module) -> bool:
    return module.rope_style == "interleaved"


def _fused(module: nn.Module) -> bool:
    return getattr(module, "qkv", None) is not None or getattr(module, "gate_up", None) is not None


def _bias_free(module: nn.Module) -> bool:
    return module.bias is None


# Setting -> (module class, variant, which modules of that class take it), in the order they are installed
# (a variant that refines another comes after it). The families a setting has variants for are declared
# in the registry; this table says which classes they replace.
VARIANTS: dict[str, tuple[tuple[type, type, Callable[[nn.Module], bool] | None], ...]] = {
    "kernels.exact": (
        (RMSNorm, ExactRMSNorm, None),
        (RotaryHalf, ExactRotaryHalf, None),
        (OuroMLP, ExactOuroMLP, None),
        (RavenMLP, ExactRavenMLP, None),
        (RavenAttention, ExactRavenAttention, _interleaved),
    ),
    "kernels.attention": ((PagedAttention, TritonPagedAttention, None),),
    "kernels.attn_slots": ((TritonPagedAttention, KeySlotPagedAttention, None),),
    "kernels.residual_norm": ((OuroForCausalLM, ChainedOuroForCausalLM, None),),
    "kernels.rope_kv_write": ((OuroAttention, RopeWriteOuroAttention, None),),
    "kernels.fused_projections": (
        (OuroAttention, FusedQKVOuroAttention, _fused),
        (OuroMLP, FusedGateUpOuroMLP, _fused),
    ),
    "kernels.gemv": (
        (nn.Linear, GemvLinear, _bias_free),
        (FusedQKVOuroAttention, GemvFusedLinear, None),
        (FusedGateUpOuroMLP, GemvFusedLinear, None),
    ),
    "kernels.gemv_batch": (
        (GemvLinear, GemvBatchLinear, None),
        (GemvFusedLinear, GemvBatchFusedLinear, None),
    ),
    "kernels.gemv_silu": ((OuroMLP, GemvSiluOuroMLP, None),),
    "kernels.gemv_norm": ((ChainedOuroForCausalLM, DeferredNormOuroForCausalLM, None),),
    "kernels.gemv_silu_out": ((FusedGateUpOuroMLP, GemvSiluOutOuroMLP, None),),
    "kernels.gemv_norm_out": ((OuroLayer, GemvNormOutOuroLayer, None),),
    "kernels.gemv_rope_out": ((FusedQKVOuroAttention, GemvRopeOuroAttention, None),),
    "kernels.persistent_loop": ((ChainedOuroForCausalLM, PersistentOuroForCausalLM, None),),
    # after kernels.persistent_loop (registry order): over its op where it attached one, else its own
    "kernels.persistent_loop_tma": (
        (ChainedOuroForCausalLM, PersistentOuroForCausalLM, None),
        (PersistentLoop, StreamedPersistentLoop, None),
    ),
}


@cache
def _composed(current: type, variant: type) -> type:
    """`variant` over a module whose class is already `current` (another variant, or a subclass such as
    LMHead): a class whose method order runs `variant` first, then `current`'s. Cached: one class per pair."""
    if issubclass(current, variant):
        return current
    if variant.__bases__[0] is current:
        return variant
    name = variant.__name__ if issubclass(variant, nn.Module) else current.__name__  # a mixin keeps the name
    return type(name, (variant, current), {"__module__": variant.__module__})


def install(module: nn.Module, variant: type) -> None:
    """Swap `variant` in as the class of `module` (same object: weights, buffers and hooks stay)."""
    module.__class__ = _composed(type(module), variant)


def install_variants(model: nn.Module, setting: str) -> int:
    """Every variant of `setting` installed on the modules it replaces; returns how many modules."""
    count = 0
    for base, variant, applies in VARIANTS.get(setting, ()):
        for module in list(model.modules()):  # the model itself first
            if isinstance(module, base) and (applies is None or applies(module)):
                install(module, variant)
                count += 1
    return count


def kernel_shapes(spec: ModelSpec) -> dict:
    """The shapes `kernels.warmup` compiles for (every width the model's exact ops see)."""
    return {
        "hidden": spec.hidden_size,
        "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate": spec.intermediate_size,
        "rope": spec.rope_style,
        "qk_bias": spec.qk_bias,
        "qk_norm": spec.qk_norm,
    }


def assemble(model: nn.Module, plan: EnginePlan, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Apply `plan.kernels` to `model` (the exact kernels compiled before any capture); returns the rungs a
    startup check decided on this device (`kernels.fused_projections`)."""
    checked_rungs: dict[str, str] = {}
    for setting in plan.kernels.active:
        # the concatenated weights first: the fused variants read them
        if setting == "kernels.fused_projections" and fuse_model_projections(model):
            exact = fused_gemm_is_exact(model.spec, device, dtype)
            checked_rungs[setting] = "R0" if exact else "R3"
        if setting == "kernels.l2_prefetch":
            # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
            from looptrace.engine.kernels import l2_prefetch  # imports Triton: the plan checked it runs

            l2_prefetch.apply_l2_prefetch(model, device)
        install_variants(model, setting)
        # after fused_projections (registry order): the stacks re-point its fused tensors too
        if setting == "kernels.persistent_loop":
            model.persistent = PersistentLoop(stack_loop_weights(model))
        if setting == "kernels.persistent_loop_tma" and getattr(model, "persistent", None) is None:
            model.persistent = RingOnlyLoop(stack_loop_weights(model))
        if setting == "kernels.exact":
            kernels.warmup(device, specs=[kernel_shapes(model.spec)])
    return checked_rungs


__all__ = ["VARIANTS", "assemble", "install", "install_variants", "kernel_shapes"]
