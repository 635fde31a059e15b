"""Memory budget: the bytes a command's settings imply, checked against what the device has *before*
anything is allocated, so a huge value is a one-line error naming the setting instead of a MemoryError,
an allocator abort or a machine swapping itself to death.

The estimates are lower bounds of the large allocations only (weights, KV pool, carried-state slots, block
tables, one step's activations, a workload's prompts); a configuration that passes can still run out of
memory, but one that fails certainly would. Callers pass element sizes (bytes), not dtypes.

`check_memory(needs, device)` is the reusable entry point: any command that can size a large allocation
from user input lists its `Need`s (bytes, and the option or setting that controls them) and calls it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HOST_BYTES_PER_BLOCK = 128  # BlockManager: free-list entry, ref count, hash-table share (Python objects)
_HOST_BYTES_PER_SLOT = 64  # carried-state slot bookkeeping on the host
_BYTES_PER_PROMPT_TOKEN = 36  # a prompt token as a Python int in a list (8-byte pointer + 28-byte int)
_BYTES_PER_REQUEST = 2048  # request object, its sampling state and metrics record


class BudgetError(ValueError):
    """The settings need more memory than the device has (exit code 2, one line naming the setting)."""


@dataclass(frozen=True)
class Need:
    what: str  # what the bytes are for, e.g. "KV pool"
    nbytes: int
    setting: str  # the option or setting that controls it, e.g. "kv.num_blocks" or "--s-ref"
    host: bool = False  # host memory even when the device is a GPU


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    """Room left under a container's memory limit (cgroup v2, then v1); None without a limit."""
    pairs = (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    )
    for limit_file, usage_file in pairs:
        try:
            limit = Path(limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # v1 writes a huge number for "no limit"
                return None
            return max(0, int(limit) - int(Path(usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def host_available() -> int | None:
    """Host memory a new allocation can get: MemAvailable, capped by a cgroup limit; None if unknown."""
    known = [n for n in (_meminfo_available(), _cgroup_available()) if n is not None]
    return min(known) if known else None


def _kind(device: Any) -> str:
    return getattr(device, "type", str(device).split(":")[0])


def device_available(device: Any) -> int | None:
    """Free memory of `device` (a torch.device or a string): the host for CPU, mem_get_info for CUDA."""
    if _kind(device) != "cuda":
        return host_available()
    # deferred: torch: the budget is checked from option parsing, before torch loads
    import torch

    try:
        return int(torch.cuda.mem_get_info(device)[0])
    except (RuntimeError, AssertionError):  # no usable CUDA (torch raises either): unknown, not a refusal
        return None


def check_memory(needs: Iterable[Need], device: Any = "cpu", *, context: str = "") -> None:
    """BudgetError when the needs exceed the available memory (device and host checked separately).

    The message names the largest need's setting: lowering it is the change most likely to fit."""
    needs = list(needs)
    if _kind(device) == "cuda":
        pools = [
            ([n for n in needs if n.host], "the host", host_available),
            ([n for n in needs if not n.host], str(device), lambda: device_available(device)),
        ]
    else:
        pools = [(needs, "cpu", host_available)]
    for items, where, available in pools:
        total = sum(n.nbytes for n in items)
        have = available() if total else None
        if have is None or total <= have:
            continue
        items = sorted(items, key=lambda n: n.nbytes, reverse=True)
        parts = ", ".join(f"{n.what} {format_bytes(n.nbytes)} ({n.setting})" for n in items[:3] if n.nbytes)
        prefix = f"{context}: " if context else ""
        raise BudgetError(
            f"{prefix}needs about {format_bytes(total)} of memory ({parts}) but {where} has "
            f"{format_bytes(have)} available; lower {items[0].setting}"
        )


# Weights -----------------------------------------------------------------------------------------------
def weight_bytes(spec: Any, elt: int) -> int:
    """Parameters of the model shape (attention, MLP, embeddings, Huginn's adapter; norms ignored)."""
    h, heads, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * spec.intermediate_size
    params = spec.num_layers * per_layer + spec.vocab_size * h * (1 if spec.tie_embeddings else 2)
    if spec.has_injection:
        params += 2 * h * h
    return params * elt


# The KV pool ---------------------------------------------------------------------------------------------
GIB = 1 << 30
RESERVE_BYTES = GIB  # what an engine leaves beside its pool on CUDA (graphs, activations)


@dataclass(frozen=True)
class PoolGeometry:
    """What a config's KV pool is made of: the cost of one block and the blocks one page takes."""

    block_size: int  # positions per block
    block_bytes: int  # K and V of `block_size` positions in every layer
    blocks_per_page: int  # blocks one page of one request takes (all planes of the layout)
    num_tables: int  # block tables per request (decode tables are this wide)

    def blocks_for_bytes(self, nbytes: float) -> int:
        """Blocks of the whole pages that fit in `nbytes` (0 when none does)."""
        return max(0, int(nbytes // self.block_bytes)) // self.blocks_per_page * self.blocks_per_page

    def blocks_for_tokens(self, tokens: int, requests: int = 1) -> int:
        """Blocks that hold `requests` requests of `tokens` positions each."""
        return requests * math.ceil(tokens / self.block_size) * self.blocks_per_page


def pool_geometry(spec: Any, cfg: Any, elt: int) -> PoolGeometry:
    """The pool geometry of `cfg`'s layout for `spec` in a dtype of `elt` bytes (no memory allocated)."""
    # deferred: loads torch
    from looptrace.engine.kv_cache import LAYOUTS

    kv = cfg.kv
    layout = LAYOUTS[kv.layout](spec, cfg.exit.max_loops or spec.default_loops)
    block_bytes = 2 * spec.num_layers * kv.block_size * spec.num_kv_heads * spec.head_dim * elt
    return PoolGeometry(kv.block_size, block_bytes, layout.blocks_per_page, layout.num_tables)


def cuda_kv_budget(free: int, total: int, utilization: float, reserve: int = RESERVE_BYTES) -> float:
    """KV bytes the engine's rule allows on a GPU: free memory less (1 - utilization) x total and
    `reserve`."""
    return free - (1 - utilization) * total - reserve


@dataclass(frozen=True)
class PoolNeed:
    """KV positions a run needs at once: `window` requests of `longest` tokens (the batches must be the
    same in both arms of a diff, so every request of a window must fit)."""

    window: int
    longest: int


def cuda_pool_blocks(
    spec: Any, cfg: Any, elt: int, device: Any, need: PoolNeed | None, cap_tokens: int
) -> int:
    """The engine's rule measured on what is alive now, capped at `cap_tokens` positions; a `need` that
    does not fit is a BudgetError naming the settings to change."""
    # deferred: torch: the budget is checked from option parsing, before torch loads
    import torch

    kv = cfg.kv
    geo = pool_geometry(spec, cfg, elt)
    free, total = torch.cuda.mem_get_info(device)
    budget = cuda_kv_budget(free, total, kv.gpu_memory_utilization)
    fits = geo.blocks_for_bytes(budget)
    if need is not None:
        needed = geo.blocks_for_tokens(need.longest, need.window) + kv.watermark_blocks
        if fits < needed:
            raise BudgetError(
                f"the KV pool ({kv.layout} layout) needs {needed * geo.block_bytes / GIB:.2f} GiB for "
                f"{need.window} request(s) of {need.longest} tokens, but kv.gpu_memory_utilization="
                f"{kv.gpu_memory_utilization:g} leaves {max(0.0, budget) / GIB:.2f} GiB "
                f"({free / GIB:.1f} of {total / GIB:.1f} GiB free): raise kv.gpu_memory_utilization "
                "(--a-set/--b-set) or lower -c, --prompt-len or --max-tokens"
            )
    return max(geo.blocks_per_page, min(geo.blocks_for_tokens(cap_tokens), fits))


# What an engine allocates ------------------------------------------------------------------------------
def engine_needs(spec: Any, cfg: Any, elt: int, device: Any, *, weights: bool = True) -> list[Need]:
    """The large allocations of `LLMEngine(spec, cfg)` in a dtype of `elt` bytes on `device`."""
    kind = _kind(device)
    kvc, sch = cfg.kv, cfg.scheduler
    geo = pool_geometry(spec, cfg, elt)
    needs: list[Need] = []
    if weights:
        needs.append(Need("weights", weight_bytes(spec, elt), "--model / --dtype"))
    if kvc.num_blocks is not None:
        blocks, setting = kvc.num_blocks, "kv.num_blocks"
    elif kind != "cuda":
        blocks, setting = geo.blocks_for_tokens(kvc.cpu_pool_tokens), "kv.cpu_pool_tokens"
    else:
        blocks, setting = 0, ""  # CUDA sizes the pool from free memory itself
    if blocks:
        needs.append(Need("KV pool", blocks * geo.block_bytes, setting))
        needs.append(Need("KV block tables", blocks * _HOST_BYTES_PER_BLOCK, setting, host=True))
    slots = sch.max_num_seqs
    state = slots * (spec.hidden_size * elt * (3 if spec.has_injection else 2) + 8)
    needs.append(Need("carried-state slots", state, "scheduler.max_num_seqs"))
    needs.append(Need("slot bookkeeping", slots * _HOST_BYTES_PER_SLOT, "scheduler.max_num_seqs", host=True))
    if kind == "cuda":  # fixed-width decode tables (graph inputs) exist only there
        max_len = min(sch.max_model_len or spec.max_position, spec.max_position)
        tables = slots * geo.num_tables * math.ceil(max_len / kvc.block_size) * 8
        needs.append(Need("decode block tables", tables, "scheduler.max_num_seqs"))
    rows = sch.max_num_batched_tokens
    act = rows * (8 * spec.hidden_size + 3 * spec.intermediate_size) * elt
    needs.append(Need("one step's activations", act, "scheduler.max_num_batched_tokens"))
    needs.append(Need("decode logits", slots * spec.vocab_size * 4, "scheduler.max_num_seqs"))
    return needs


def workload_needs(requests: int, tokens_per_request: int, setting: str) -> list[Need]:
    """A workload's prompts and request records on the host."""
    per_request = _BYTES_PER_REQUEST + tokens_per_request * _BYTES_PER_PROMPT_TOKEN
    return [Need("workload prompts", requests * per_request, setting, host=True)]
