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
kernel touches (`_pdl.await_inputs` is the first statement of each kernel body). The wait covers the
kernel directly before; the chain is transitive because a kernel cannot complete before its own wait
returned. Kernels launched without the attribute (cuBLAS, ATen) wait for full completion as always.

The mode is process-wide state set for the duration of an engine step (`dependent_launches`); CUDA graphs
record it at capture, so a replay keeps the mode it was captured with. A leaf module: imports nothing of
Triton, so the engine can enter the scope without loading it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # the interpreter runs no inline PTX
_dependent = False
_preload = False
_kv_prefetch = False


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
def dependent_launches(
    enabled: bool, weight_preload: bool = False, kv_prefetch: bool = False
) -> Iterator[None]:
    """Launch the Triton kernels as programmatic dependents while the scope is open (when `enabled`);
    `weight_preload`: the one-row GEMV then loads its first weight tile before its wait; `kv_prefetch`:
    the paged attention asks L2 for its segment's K/V rows before its wait."""
    global _dependent, _preload, _kv_prefetch
    previous = _dependent, _preload, _kv_prefetch
    _dependent = bool(enabled) and not _INTERPRETED
    _preload = _dependent and bool(weight_preload)
    _kv_prefetch = _dependent and bool(kv_prefetch)
    try:
        yield
    finally:
        _dependent, _preload, _kv_prefetch = previous


def active() -> bool:
    return _dependent


def weight_preload() -> bool:
    """Under PDL with `kernels.gemv_preload`: the GEMV's first weight tile is loaded before the wait."""
    return _preload


def kv_prefetch() -> bool:
    """Under PDL with `kernels.attn_prefetch`: the paged attention prefetches its K/V before the wait."""
    return _kv_prefetch


def pdl_args() -> dict:
    """Keyword arguments for a kernel launch under the current mode: the kernel's `PDL` constexpr (its
    `await_inputs` preamble) and Triton's `launch_pdl` launch option, which always go together."""
    return {"PDL": True, "launch_pdl": True} if _dependent else {"PDL": False}


__all__ = ["active", "dependent_launches", "kv_prefetch", "pdl_args", "supported", "weight_preload"]
