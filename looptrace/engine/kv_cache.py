"""Paged KV with depth planes: layouts, block bookkeeping (written state, prefix cache) and the device pool.

Storage: `k_cache`/`v_cache` `[num_blocks, num_layers, block_size, kv_heads, head_dim]` — a block holds
one page (block_size tokens) of every physical layer. A request owns one block table per *plane*; the
layout decides how many planes exist and which plane a (layer role, loop) writes.

- `planes` (LAST_EXITED): one plane per recurrence depth; core layers at loop t write plane t; prelude and
  coda layers write plane 0 only, so their slots in planes >= 1 are reserved but dead.
- `shared`: one plane; every loop of a core layer overwrites the same slot.

A token that exited at depth e < max_loops has its last plane copied into every deeper plane
(`finalize_exit`), so a later query at depth d reads version min(d, e).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from looptrace.engine.model_config import ModelSpec

ROLES = ("prelude", "core", "coda")


class KVHistoryError(RuntimeError):
    """Attention would read a KV position nothing has written ("uninitialized KV history")."""


# ---------------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------------
class KVLayout:
    name = "base"

    def __init__(self, spec: ModelSpec, max_loops: int) -> None:
        self.spec, self.max_loops = spec, max_loops

    @property
    def num_planes(self) -> int:
        raise NotImplementedError

    def plane(self, role: str, loop: int) -> int:
        """Plane written/read by a layer of `role` during (0-based) loop `loop`."""
        raise NotImplementedError

    def roles_in_plane(self, plane: int) -> tuple[str, ...]:
        """Layer roles whose slots in `plane` are ever written (others are dead)."""
        raise NotImplementedError

    def _role_layers(self, role: str) -> int:
        return {"prelude": self.spec.n_prelude, "core": self.spec.n_core, "coda": self.spec.n_coda}[role]

    @property
    def reserved_slots_per_token(self) -> int:
        return self.spec.num_layers * self.num_planes

    @property
    def live_slots_per_token(self) -> int:
        return sum(self._role_layers(r) for p in range(self.num_planes) for r in self.roles_in_plane(p))


class PlanesLayout(KVLayout):
    name = "planes"

    @property
    def num_planes(self) -> int:
        return self.max_loops

    def plane(self, role: str, loop: int) -> int:
        return loop if role == "core" else 0

    def roles_in_plane(self, plane: int) -> tuple[str, ...]:
        present = tuple(r for r in ROLES if self._role_layers(r) > 0)
        return present if plane == 0 else ("core",)


class SharedLayout(KVLayout):
    name = "shared"

    @property
    def num_planes(self) -> int:
        return 1

    def plane(self, role: str, loop: int) -> int:
        return 0

    def roles_in_plane(self, plane: int) -> tuple[str, ...]:
        return tuple(r for r in ROLES if self._role_layers(r) > 0)


LAYOUTS: dict[str, type[KVLayout]] = {"planes": PlanesLayout, "shared": SharedLayout}


# ---------------------------------------------------------------------------------------------------------
# Written state
# ---------------------------------------------------------------------------------------------------------
@dataclass
class WrittenState:
    """Positions written for one (request, plane, role): a contiguous prefix plus out-of-order extras."""

    prefix: int = 0
    pending: set[int] = field(default_factory=set)

    def mark(self, start: int, stop: int) -> None:
        if start <= self.prefix:
            self.prefix = max(self.prefix, stop)
        else:
            self.pending.update(range(start, stop))
        while self.prefix in self.pending:
            self.pending.discard(self.prefix)
            self.prefix += 1

    def covers(self, stop: int) -> bool:
        return self.prefix >= stop


@dataclass
class SeqKV:
    """One request's KV: block tables per plane and written state per (plane, role)."""

    tables: list[list[int]]
    written: dict[tuple[int, str], WrittenState]
    blocks_needed_total: int  # per plane, for the request's whole life (admission reservation)
    hashes: list[bytes] = field(default_factory=list)  # chained keys of full prompt pages
    published_pages: int = 0


# ---------------------------------------------------------------------------------------------------------
# Block manager (host bookkeeping only)
# ---------------------------------------------------------------------------------------------------------
class BlockManager:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.layout, self.num_blocks, self.block_size = layout, num_blocks, block_size
        self.free: list[int] = list(reversed(range(num_blocks)))  # a stack: pops 0, 1, 2, ...
        self.refcount = np.zeros(num_blocks, dtype=np.int64)
        self.seqs: dict[str, SeqKV] = {}
        # Prefix cache (LAST_EXITED only): key -> one block per plane, oldest first (LRU).
        self.prefix_caching = prefix_caching and layout.name == "planes"
        self.cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self.on_freed = None  # callback(list[int]) for poisoning freed blocks in tests
        self.stats = {"prefix_hit_tokens": 0, "prefix_query_tokens": 0, "evictions": 0}

    # Capacity ------------------------------------------------------------------------------------------
    @property
    def planes(self) -> int:
        return self.layout.num_planes

    def pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def blocks_for(self, tokens: int) -> int:
        return self.pages(tokens) * self.planes

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks // self.planes * self.block_size

    def _cache_only_blocks(self) -> int:
        return sum(1 for blocks in self.cache.values() for b in blocks if self.refcount[b] == 1)

    def available_blocks(self) -> int:
        """Free blocks plus blocks held only by the prefix cache (evictable)."""
        return len(self.free) + self._cache_only_blocks()

    def reserved_growth(self) -> int:
        return sum(s.blocks_needed_total * self.planes - self._owned(s) for s in self.seqs.values())

    def _owned(self, s: SeqKV) -> int:
        return sum(len(t) for t in s.tables)

    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    # Admission ------------------------------------------------------------------------------------------
    def can_admit(self, request_id: str, prompt: list[int], max_kv_tokens: int, watermark: int) -> bool:
        hits = self._lookup(prompt) if self.prefix_caching else []
        need = (self.pages(max_kv_tokens) - len(hits)) * self.planes
        # Hit blocks held only by the cache count as evictable in available_blocks(); taking them for
        # this request makes them unavailable, so do not count them twice.
        taken = sum(1 for key in hits for b in self.cache[key] if self.refcount[b] == 1)
        return self.available_blocks() - taken - self.reserved_growth() - watermark >= need

    def admit(self, request_id: str, prompt: list[int], max_kv_tokens: int) -> int:
        """Registers the request, takes cached prefix pages; returns the number of cached prompt tokens."""
        written = {(p, r): WrittenState() for p in range(self.planes) for r in self.layout.roles_in_plane(p)}
        seq = SeqKV([[] for _ in range(self.planes)], written, self.pages(max_kv_tokens))
        self.seqs[request_id] = seq
        if not self.prefix_caching:
            return 0
        seq.hashes = self._page_hashes(prompt)
        hits = self._lookup(prompt)
        self.stats["prefix_query_tokens"] += len(prompt)
        for key in hits:
            blocks = self.cache[key]
            self.cache.move_to_end(key)  # LRU refresh
            for plane, b in enumerate(blocks):
                seq.tables[plane].append(b)
                self.refcount[b] += 1
        cached = len(hits) * self.block_size
        for ws in written.values():
            ws.mark(0, cached)
        seq.published_pages = len(hits)
        self.stats["prefix_hit_tokens"] += cached
        return cached

    # Allocation -----------------------------------------------------------------------------------------
    def ensure_capacity(self, request_id: str, num_tokens: int) -> bool:
        """Grows every plane's table to hold `num_tokens` positions (claiming from free/evictable)."""
        seq = self.seqs[request_id]
        missing = self.pages(num_tokens) - len(seq.tables[0])
        if missing <= 0:
            return True
        fresh = self._claim(missing * self.planes)
        if fresh is None:
            return False
        for plane in range(self.planes):  # plane d gets fresh[d*missing:(d+1)*missing]
            seq.tables[plane].extend(fresh[plane * missing : (plane + 1) * missing])
        return True

    def _claim(self, n: int) -> list[int] | None:
        if len(self.free) < n and not self._evict_for(n - len(self.free)):
            return None
        out = [self.free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        return out

    def _evict_for(self, shortfall: int) -> bool:
        """Evict oldest cache entries whose blocks only the cache holds, only if that covers the claim."""
        victims, gained = [], 0
        for key, blocks in self.cache.items():
            if gained >= shortfall:
                break
            if all(self.refcount[b] == 1 for b in blocks):
                victims.append(key)
                gained += len(blocks)
        if gained < shortfall:
            return False
        for key in victims:
            self._release(self.cache.pop(key))
            self.stats["evictions"] += 1
        return True

    def _release(self, blocks: list[int]) -> None:
        freed = []
        for b in blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                freed.append(b)
        self.free.extend(reversed(freed))
        if freed and self.on_freed is not None:
            self.on_freed(freed)

    def free_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._release([b for table in seq.tables for b in table])

    # Addresses and written state ------------------------------------------------------------------------
    def table(self, request_id: str, plane: int) -> list[int]:
        return self.seqs[request_id].tables[plane]

    def slot(self, request_id: str, plane: int, pos: int) -> tuple[int, int]:
        table = self.seqs[request_id].tables[plane]
        return table[pos // self.block_size], pos % self.block_size

    def check_history(self, request_id: str, plane: int, role: str, first_pos: int) -> None:
        """Every position before `first_pos` must be written before a query at `first_pos` attends."""
        ws = self.seqs[request_id].written[(plane, role)]
        if not ws.covers(first_pos):
            raise KVHistoryError(
                f"uninitialized KV history: request {request_id} plane {plane} {role} layers written up to "
                f"{ws.prefix}, query at position {first_pos}"
            )

    def mark_written(self, request_id: str, plane: int, role: str, start: int, stop: int) -> None:
        self.seqs[request_id].written[(plane, role)].mark(start, stop)

    # Prefix cache ---------------------------------------------------------------------------------------
    def _page_hashes(self, prompt: list[int]) -> list[bytes]:
        """Chained SHA-256 over full pages of tokens[:-1] (the last prompt token is never cached)."""
        keys, prev = [], b""
        usable = prompt[:-1]
        for i in range(len(usable) // self.block_size):
            page = np.asarray(usable[i * self.block_size : (i + 1) * self.block_size], dtype="<i8")
            prev = hashlib.sha256(prev + page.tobytes()).digest()
            keys.append(prev)
        return keys

    def _lookup(self, prompt: list[int]) -> list[bytes]:
        hits = []
        for key in self._page_hashes(prompt):
            if key not in self.cache:
                break
            hits.append(key)
        return hits

    def publish(self, request_id: str, prefilled: int, prompt_len: int) -> int:
        """Publishes full prompt pages whose every plane and role is written; stops at the first gap."""
        if not self.prefix_caching:
            return 0
        seq = self.seqs[request_id]
        limit = min(prefilled, prompt_len - 1)
        new = 0
        while seq.published_pages < len(seq.hashes):
            page = seq.published_pages
            stop = (page + 1) * self.block_size
            if stop > limit or not all(self._page_covered(seq, p, stop) for p in range(self.planes)):
                break
            key = seq.hashes[page]
            if key not in self.cache:
                blocks = [seq.tables[p][page] for p in range(self.planes)]
                for b in blocks:
                    self.refcount[b] += 1
                self.cache[key] = blocks
                new += 1
            seq.published_pages += 1
        return new

    def _page_covered(self, seq: SeqKV, plane: int, stop: int) -> bool:
        """Base rule: every layer of the plane (dead slots included) must have written the page."""
        roles = [r for r in ROLES if self.layout._role_layers(r) > 0]
        for role in roles:
            ws = seq.written.get((plane, role))
            if ws is None or not ws.covers(stop):
                return False
        return True


# ---------------------------------------------------------------------------------------------------------
# Device pool
# ---------------------------------------------------------------------------------------------------------
class KVPool:
    """The K/V tensors plus the device-side operations on them (plane copies, poisoning)."""

    POISON = 1.0e4  # large but finite: masked keys still get softmax weight 0, never NaN

    def __init__(
        self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_blocks, spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim)
        # Zero-filled: masked-out padding keys must be finite (0 * NaN would poison the softmax output).
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.spec, self.block_size = spec, block_size
        self.core_layers = torch.tensor(list(spec.core_layer_ids), device=device)

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.k_cache[0].numel() * self.k_cache.element_size()

    def copy_slots(self, copies: torch.Tensor) -> None:
        """copies [n, 4] = (src block, src offset, dst block, dst offset): copy one token slot of every core
        layer. One gather and one scatter per K/V, whatever the number of exiting tokens."""
        sb, so, db, do = (copies[:, i, None] for i in range(4))
        layers = self.core_layers[None, :]
        for cache in (self.k_cache, self.v_cache):
            cache[db, layers, do] = cache[sb, layers, so]

    def poison(self, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, device=self.k_cache.device)
        self.k_cache.index_fill_(0, idx, self.POISON)
        self.v_cache.index_fill_(0, idx, self.POISON)


def size_pool_blocks(
    spec: ModelSpec,
    layout: KVLayout,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int | None,
    cpu_pool_tokens: int,
    gpu_memory_utilization: float,
) -> int:
    """Blocks in the pool: explicit, or CPU tokens x planes, or what fits in free CUDA memory."""
    if num_blocks is not None:
        return num_blocks
    if device.type != "cuda":
        return math.ceil(cpu_pool_tokens / block_size) * layout.num_planes
    bytes_per_block = 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim
    bytes_per_block *= torch.empty((), dtype=dtype).element_size()
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1 - gpu_memory_utilization) * total - (1 << 30)  # 1 GiB for graphs and activations
    return max(layout.num_planes, int(budget // bytes_per_block) // layout.num_planes * layout.num_planes)
