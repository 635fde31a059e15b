"""How the engine's Triton kernels are launched: as programmatic dependents or not (`kernels.pdl`).

Why: at decode batch 1 a token is a chain of ~900 short dependent kernels. Each one normally starts only
after the one before it has completed and flushed, so every launch pays the ramp-up of its first loads and
the drain of the one before (0.40-0.50 ms of idle GPU per Ouro token inside the whole-token graph, plus the
ramp inside each GEMV). With programmatic dependent launch (Hopper, sm_90+) a kernel launched with Triton's
`launch_pdl=True` may start as soon as every program of the kernel before it has executed
`griddepcontrol.launch_dependents`; it then blocks in `griddepcontrol.wait` until that kernel has
completed and its writes are visible. Only work that reads nothing an earlier kernel writes may run
before the wait: weights, which no kernel writes (the GEMV's first weight tile under `kernels.gemv_preload`,
`weight_preload`; its L2 prefetch of the whole slice, `gemv.PREFETCH_UNDER_PDL`, off: measured slower), and
hints that move no values (the attention's L2 prefetch of its K/V rows under `kernels.attn_prefetch`,
`kv_prefetch`).

Values never change (R0): every program of every kernel waits before it reads or writes anything another
kernel touches (`device_helpers.await_inputs` is the first statement of each kernel body). The wait covers the
kernel directly before; the chain is transitive because a kernel cannot complete before its own wait
returned. Kernels launched without the attribute (cuBLAS, ATen) wait for full completion as always.

The mode is one frozen `LaunchPlan` (resolved by the engine plan from `kernels.pdl`,
`kernels.gemv_preload` and `kernels.attn_prefetch`) entered once per engine step (`entered`); the kernels
read it at launch (`current`). CUDA graphs record it at capture, so a replay keeps the plan it was captured
with. A leaf module: imports nothing of Triton, so the engine can enter the scope without loading it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # the interpreter runs no inline PTX


@dataclass(frozen=True)
class LaunchPlan:
    """How the Triton kernels of one step are launched."""

    dependent: bool = False  # kernels.pdl: as programmatic dependents
    weight_preload: bool = False  # kernels.gemv_preload: the one-row GEMV's first tile before its wait
    kv_prefetch: bool = False  # kernels.attn_prefetch: the attention prefetches its K/V before its wait

    def effective(self) -> LaunchPlan:
        """The plan as it can run here: the preloads exist only under PDL, and the interpreter has none."""
        dependent = self.dependent and not _INTERPRETED
        return LaunchPlan(dependent, dependent and self.weight_preload, dependent and self.kv_prefetch)


# The plan in force: a context variable, entered and restored by `entered` (no module flag to reset).
_OFF = LaunchPlan()
_current: ContextVar[LaunchPlan] = ContextVar("launch_plan")


def supported(device: torch.device | str) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 or later (`griddepcontrol` is sm_90+ PTX)."""
    device = torch.device(device)
    return (
        device.type == "cuda"
        and not _INTERPRETED
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@contextmanager
def entered(plan: LaunchPlan) -> Iterator[None]:
    """Launch the Triton kernels under `plan` while the scope is open."""
    token = _current.set(plan.effective())
    try:
        yield
    finally:
        _current.reset(token)


def dependent_launches(enabled: bool, weight_preload: bool = False, kv_prefetch: bool = False):
    """`entered(LaunchPlan(enabled, weight_preload, kv_prefetch))`: for kernel tests and bench scripts
    that pick the launch mode by hand."""
    return entered(LaunchPlan(bool(enabled), bool(weight_preload), bool(kv_prefetch)))


def current() -> LaunchPlan:
    return _current.get(_OFF)


def active() -> bool:
    return _current.get(_OFF).dependent


def weight_preload() -> bool:
    """Under PDL with `kernels.gemv_preload`: the GEMV's first weight tile is loaded before the wait."""
    return _current.get(_OFF).weight_preload


def kv_prefetch() -> bool:
    """Under PDL with `kernels.attn_prefetch`: the paged attention prefetches its K/V before the wait."""
    return _current.get(_OFF).kv_prefetch


def pdl_args() -> dict:
    """Keyword arguments for a kernel launch under the current plan: the kernel's `PDL` constexpr (its
    `await_inputs` preamble) and Triton's `launch_pdl` launch option, which always go together."""
    return {"PDL": True, "launch_pdl": True} if _current.get(_OFF).dependent else {"PDL": False}


__all__ = [
    "LaunchPlan",
    "active",
    "current",
    "dependent_launches",
    "entered",
    "kv_prefetch",
    "pdl_args",
    "supported",
    "weight_preload",
]
