"""Every `kernels.*` setting as data: the kernel module behind it, the model families it has a variant
for, what it requires to act, and the module variant it installs. The plan (`engine/plan.py`) resolves the
settings from these entries, and `engine/assemble.py` installs the variants the plan leaves active; no
other file restates a requirement.

A requirement is a name with the reason reported when it is not met (`looptrace run` headers, `diff`):
- `device:cuda_triton`: a CUDA device and an importable Triton;
- `device:pdl`: the above on compute capability 9.0+ (programmatic dependent launch);
- `debug:no_perturb`: `debug.perturb` unset (its hooks act on the layer ops, which a whole-loop kernel skips);
- `kernels.<x>`: that setting asked for and every requirement of its own met except its `family` one
  (it can run here: whether this entry has a form for the family is this entry's own `family` check);
- `family`: the model family is one of the entry's `families`.
The first requirement not met is the one reported, so the order of `requires` is the order of the checks.

A leaf module: plain data, no torch, no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

CUDA_TRITON = "device:cuda_triton"
PDL = "device:pdl"
NO_PERTURB = (
    "debug:no_perturb"  # debug.perturb unset: its hooks perturb layer ops a fused kernel does not run
)
FAMILY = "family"
ALL_FAMILIES = ("ouro", "huginn", "olmo")


@dataclass(frozen=True)
class Requirement:
    name: str  # CUDA_TRITON, PDL, FAMILY or a setting ("kernels.exact")
    reason: str  # why the setting is inactive when this is not met ({family}: the model family)


@dataclass(frozen=True)
class KernelEntry:
    setting: str  # "kernels.<field>" of EngineConfig
    module: str  # the kernel module under engine/kernels/ (documentation: where the kernel lives)
    requires: tuple[Requirement, ...]
    installs: str  # the module variant(s) `assemble` swaps in (see engine/assemble.py: VARIANTS)
    families: tuple[str, ...] = ALL_FAMILIES
    value: object = True  # the value that asks for it (kernels.attention: "triton")


_CUDA = "CUDA with Triton"
_NEEDS_EXACT = Requirement("kernels.exact", f"needs kernels.exact active ({_CUDA})")
_NEEDS_GEMV = Requirement("kernels.gemv", f"needs kernels.gemv active ({_CUDA})")
_NO_TAIL = Requirement(FAMILY, "no fused kernel for the {family} family")
_NO_FORM = Requirement(FAMILY, "no fused GEMV form for the {family} family")
_OURO = ("ouro",)

# In the order inactive settings are reported after plan.REPORT_ORDER's (the order the engine applied them).
ENTRIES: tuple[KernelEntry, ...] = (
    KernelEntry(
        "kernels.exact",
        "rmsnorm, rope, silu_mul",
        (Requirement(CUDA_TRITON, f"exact Triton kernels run only on {_CUDA}"),),
        "ExactRMSNorm, ExactRotaryHalf, ExactOuroMLP, ExactRavenMLP, ExactRavenAttention (interleaved RoPE)",
    ),
    KernelEntry(
        "kernels.attention",
        "paged_attention, packed_attention",
        (Requirement(CUDA_TRITON, "the Triton attention kernel runs only on CUDA"),),
        "TritonPagedAttention (and the runner's metadata without the torch path's mask)",
        value="triton",
    ),
    KernelEntry(
        "kernels.residual_norm",
        "rmsnorm (residual_rms_norm)",
        (_NEEDS_EXACT, _NO_TAIL),
        "ChainedOuroForCausalLM",
        families=_OURO,
    ),
    KernelEntry(
        "kernels.rope_kv_write",
        "rope (rope_half_write_kv)",
        (
            _NEEDS_EXACT,
            Requirement("kernels.attention", "needs the Triton attention path (kernels.attention=triton)"),
            _NO_TAIL,
        ),
        "RopeWriteOuroAttention",
        families=_OURO,
    ),
    KernelEntry("kernels.fused_projections", "(torch GEMM)", (), "fuse_projections() on attention and MLP"),
    KernelEntry(
        "kernels.gemv",
        "gemv",
        (Requirement(CUDA_TRITON, f"the Triton GEMV runs only on {_CUDA}"),),
        "GemvLinear on every bias-free nn.Linear; GemvFusedLinear on Ouro's attention and MLP",
    ),
    KernelEntry(
        "kernels.gemv_batch",
        "gemv",
        (_NEEDS_GEMV,),
        "GemvBatchLinear and GemvBatchFusedLinear over the GEMV's projections (2-8 rows routed too)",
    ),
    KernelEntry("kernels.gemv_silu", "gemv", (_NEEDS_GEMV, _NO_FORM), "GemvSiluOuroMLP", families=_OURO),
    KernelEntry(
        "kernels.gemv_norm",
        "gemv",
        (_NEEDS_GEMV, Requirement("kernels.residual_norm", "needs kernels.residual_norm active"), _NO_FORM),
        "DeferredNormOuroForCausalLM",
        families=_OURO,
    ),
    KernelEntry(
        "kernels.gemv_silu_out", "gemv", (_NEEDS_GEMV, _NO_FORM), "GemvSiluOutOuroMLP", families=_OURO
    ),
    KernelEntry(
        "kernels.gemv_norm_out",
        "gemv",
        (_NEEDS_GEMV, Requirement("kernels.residual_norm", "needs kernels.residual_norm active"), _NO_FORM),
        "GemvNormOutOuroLayer",
        families=_OURO,
    ),
    KernelEntry(
        "kernels.gemv_rope_out",
        "gemv_rope",
        (_NEEDS_GEMV, Requirement("kernels.rope_kv_write", "needs kernels.rope_kv_write active"), _NO_FORM),
        "GemvRopeOuroAttention",
        families=_OURO,
    ),
    KernelEntry(
        "kernels.l2_prefetch",
        "l2_prefetch",
        (Requirement(CUDA_TRITON, f"the L2 prefetch runs only on {_CUDA}"),),
        "a weight-prefetching forward wrapped around every bias-free projection",
    ),
    KernelEntry(
        "kernels.pdl",
        "launch_mode",
        (Requirement(PDL, "programmatic dependent launch needs a CUDA GPU of compute capability 9+"),),
        "LaunchPlan.dependent (entered once per step)",
    ),
    KernelEntry(
        "kernels.gemv_preload",
        "gemv",
        (
            Requirement("kernels.gemv", "needs kernels.gemv and kernels.pdl active (CUDA sm_90+)"),
            Requirement("kernels.pdl", "needs kernels.gemv and kernels.pdl active (CUDA sm_90+)"),
        ),
        "LaunchPlan.weight_preload",
    ),
    KernelEntry(
        "kernels.attn_prefetch",
        "paged_attention",
        (
            Requirement("kernels.pdl", "needs kernels.pdl active (CUDA sm_90+) and Triton attention"),
            Requirement("kernels.attention", "needs kernels.pdl active (CUDA sm_90+) and Triton attention"),
        ),
        "LaunchPlan.kv_prefetch",
    ),
    KernelEntry(
        "kernels.attn_slots",
        "paged_attention",
        (Requirement("kernels.attention", "needs the Triton attention (kernels.attention=triton, CUDA)"),),
        "KeySlotPagedAttention",
    ),
    KernelEntry(
        "kernels.persistent_loop",
        "persistent_loop",
        (
            Requirement(
                CUDA_TRITON,
                "the persistent loop runs only on CUDA with Triton (its programs wait for "
                "each other, so all of them must be resident on one GPU)",
            ),
            Requirement(
                "kernels.residual_norm", "needs kernels.residual_norm active (the chained loop it replaces)"
            ),
            Requirement(NO_PERTURB, "debug.perturb hooks layer ops, which the persistent loop does not run"),
            Requirement(FAMILY, "no persistent loop kernel for the {family} family"),
        ),
        "PersistentOuroForCausalLM (the loop's weights stacked by layer: stack_loop_weights)",
        families=_OURO,
    ),
    KernelEntry(
        "kernels.persistent_loop_tma",
        "stream_loop",
        (
            Requirement(PDL, "the TMA ring needs a CUDA GPU of compute capability 9+ (TMA and mbarriers)"),
            Requirement(
                "kernels.residual_norm", "needs kernels.residual_norm active (the chained loop it replaces)"
            ),
            Requirement(NO_PERTURB, "debug.perturb hooks layer ops, which the TMA-ring loop does not run"),
            Requirement(FAMILY, "no TMA-ring loop kernel for the {family} family"),
        ),
        "PersistentOuroForCausalLM with a RingOnlyLoop op (one-row loops through stream_loop.loop_streamed), "
        "or StreamedPersistentLoop over kernels.persistent_loop's op where that is on too",
        families=_OURO,
    ),
)

BY_SETTING = {entry.setting: entry for entry in ENTRIES}


def entry(setting: str) -> KernelEntry:
    return BY_SETTING[setting]


__all__ = [
    "ALL_FAMILIES",
    "BY_SETTING",
    "CUDA_TRITON",
    "ENTRIES",
    "FAMILY",
    "NO_PERTURB",
    "PDL",
    "KernelEntry",
    "Requirement",
    "entry",
]
