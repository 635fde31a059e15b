"""Paged KV with depth planes: layouts, block bookkeeping (written state, prefix cache) and the device pool.

Storage: `k_cache`/`v_cache` `[num_blocks, num_layers, block_size, kv_heads, head_dim]`. Addressing is by
*entry*: slot s of block b is entry `b * num_layers + s` of the flattened view `[num_blocks * num_layers,
block_size, kv_heads, head_dim]`. A request owns one block table per *table* of the layout; the layout
decides how many planes exist, which plane a (layer role, loop) writes, and where a plane's layers live:
layer l of plane p on page i is entry `unit * unit_entries + entry_offset(p) + l`, where `unit` is the
page's allocation unit in the plane's table (the metadata carries `unit * unit_entries + entry_offset(p)`,
the attention layer adds its own layer id).

- `planes` (LAST_EXITED): one plane per recurrence depth, one table per plane, a unit is one block holding
  every layer; core layers at loop t write plane t; prelude and coda layers write plane 0 only, so their
  slots in planes >= 1 are reserved but dead.
- `packed` (ExactLoop plane packing): the same planes without the dead slots. A page is one unit, a run of
  `blocks_per_unit` consecutive blocks; plane 0 holds every layer that writes it, each deeper plane only
  the core layers, one after the other (Huginn-0125: ceil((8 + 31 * 4) / 8) = 17 blocks per page, not 32).
  Same values, other addresses (R0).
- `shared`: one plane; every loop of a core layer overwrites the same slot.

A token that exited at depth e < max_loops has its last plane copied into every deeper plane
(`ModelRunner.finalize_exits`), so a later query at depth d reads version min(d, e).

Written state is kept per (request, plane, layer): a read of any position some layer of the plane has not
written raises `KVHistoryError` ("uninitialized KV history"), so a partial write of a layer range is caught.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable
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
    prefix_cache = False  # pages can be shared through the prefix cache (LAST_EXITED layouts)

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

    def role_layer_ids(self, role: str) -> range:
        """Physical layer ids (the pool's layer index) of a role."""
        first = {"prelude": 0, "core": self.spec.n_prelude, "coda": self.spec.n_prelude + self.spec.n_core}
        return range(first[role], first[role] + self._role_layers(role))

    def layers_in_plane(self, plane: int) -> tuple[int, ...]:
        """Physical layers that write `plane` (sorted)."""
        return tuple(sorted(i for r in self.roles_in_plane(plane) for i in self.role_layer_ids(r)))

    # Addressing ----------------------------------------------------------------------------------------
    @property
    def num_tables(self) -> int:
        """Block tables per request (one allocation unit per table per page)."""
        return self.num_planes

    def table_of(self, plane: int) -> int:
        return plane

    @property
    def blocks_per_unit(self) -> int:
        return 1

    @property
    def blocks_per_page(self) -> int:
        """Pool blocks one page of one request takes (all planes)."""
        return self.num_tables * self.blocks_per_unit

    @property
    def unit_entries(self) -> int:
        return self.blocks_per_unit * self.spec.num_layers

    def entry_offset(self, plane: int) -> int:
        """Layer l of `plane` is entry `unit * unit_entries + entry_offset(plane) + l`."""
        return 0

    def plane_width(self, plane: int) -> int:
        """Slots a plane reserves per token."""
        return self.spec.num_layers

    # Slot accounting -----------------------------------------------------------------------------------
    @property
    def reserved_slots_per_token(self) -> int:
        return self.spec.num_layers * self.blocks_per_page

    @property
    def live_slots_per_token(self) -> int:
        return sum(len(self.layers_in_plane(p)) for p in range(self.num_planes))

    @property
    def dead_slots_per_token(self) -> int:
        """Slots a plane reserves for layers that never write it."""
        return sum(self.plane_width(p) for p in range(self.num_planes)) - self.live_slots_per_token

    @property
    def padding_slots_per_token(self) -> int:
        """Unused tail of a page's last block (packed: the planes do not fill whole blocks)."""
        return self.reserved_slots_per_token - sum(self.plane_width(p) for p in range(self.num_planes))


class PlanesLayout(KVLayout):
    name = "planes"
    prefix_cache = True

    @property
    def num_planes(self) -> int:
        return self.max_loops

    def plane(self, role: str, loop: int) -> int:
        return loop if role == "core" else 0

    def roles_in_plane(self, plane: int) -> tuple[str, ...]:
        present = tuple(r for r in ROLES if self._role_layers(r) > 0)
        return present if plane == 0 else ("core",)


class PackedLayout(PlanesLayout):
    """Live-slot plane packing: the planes of `planes`, each reserving only the layers that write it, laid
    one after the other in a run of consecutive blocks (one table, one unit per page). Every plane's layers
    are consecutive physical layers, so one entry offset per plane addresses all of them."""

    name = "packed"

    def __init__(self, spec: ModelSpec, max_loops: int) -> None:
        super().__init__(spec, max_loops)
        self._offsets, start = [], 0
        for p in range(self.num_planes):
            layers = self.layers_in_plane(p)
            assert list(layers) == list(range(layers[0], layers[0] + len(layers))), "non-contiguous plane"
            self._offsets.append(start - layers[0])  # >= 0: plane 0 starts at 0, later planes past it
            start += len(layers)
        self._blocks_per_unit = math.ceil(start / spec.num_layers)

    @property
    def num_tables(self) -> int:
        return 1

    def table_of(self, plane: int) -> int:
        return 0

    @property
    def blocks_per_unit(self) -> int:
        return self._blocks_per_unit

    def entry_offset(self, plane: int) -> int:
        return self._offsets[plane]

    def plane_width(self, plane: int) -> int:
        return len(self.layers_in_plane(plane))


class SharedLayout(KVLayout):
    name = "shared"
    # Every loop overwrites the one plane, so a depth-major chunk would let later rows read earlier rows
    # at intermediate loops: prefill runs one position per request per core traversal instead (the base
    # engine's rule), which makes the result independent of the chunk size.
    prefill_position_by_position = True

    @property
    def num_planes(self) -> int:
        return 1

    def plane(self, role: str, loop: int) -> int:
        return 0

    def roles_in_plane(self, plane: int) -> tuple[str, ...]:
        return tuple(r for r in ROLES if self._role_layers(r) > 0)


LAYOUTS: dict[str, type[KVLayout]] = {"planes": PlanesLayout, "shared": SharedLayout, "packed": PackedLayout}


# ---------------------------------------------------------------------------------------------------------
# Written state
# ---------------------------------------------------------------------------------------------------------
@dataclass
class WrittenState:
    """Positions written for one (request, plane, layer): a contiguous prefix plus out-of-order extras."""

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

    def has(self, pos: int) -> bool:
        return pos < self.prefix or pos in self.pending


@dataclass
class SeqKV:
    """One request's KV: block tables (one per layout table) and written state per (plane, layer)."""

    tables: list[list[int]]
    written: dict[tuple[int, int], WrittenState]
    blocks_needed_total: int  # pages, for the request's whole life (admission reservation)
    hashes: list[bytes] = field(default_factory=list)  # chained keys of full prompt pages
    published_pages: int = 0


Layers = str | Iterable[int]  # a role name or explicit physical layer ids


# ---------------------------------------------------------------------------------------------------------
# Block manager (host bookkeeping only)
# ---------------------------------------------------------------------------------------------------------
class BlockManager:
    """Host bookkeeping over allocation units: a unit is one pool block (`planes`, `shared`) or one run of
    `layout.blocks_per_unit` blocks (`packed`). `num_blocks`, `free`, `refcount` and the tables count units;
    `on_freed` receives pool block ids."""

    PUBLICATIONS = ("all_planes", "per_plane")

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool,
        publication: str = "all_planes",
    ) -> None:
        if publication not in self.PUBLICATIONS:
            raise ValueError(f"prefix publication {publication!r}: expected one of {self.PUBLICATIONS}")
        self.layout, self.block_size, self.publication = layout, block_size, publication
        self.pool_blocks = num_blocks
        self.num_blocks = num_blocks // layout.blocks_per_unit  # allocation units
        self.free: list[int] = list(reversed(range(self.num_blocks)))  # a stack: pops 0, 1, 2, ...
        self.refcount = np.zeros(self.num_blocks, dtype=np.int64)
        self.seqs: dict[str, SeqKV] = {}
        # Prefix cache (LAST_EXITED only): key -> one unit per table, oldest first (LRU).
        self.prefix_caching = prefix_caching and layout.prefix_cache
        self.cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self.on_freed = None  # callback(list[int] of pool blocks) for poisoning freed blocks in tests
        self.stats = {"prefix_hit_tokens": 0, "prefix_query_tokens": 0, "evictions": 0}
        self._plane_layers = [layout.layers_in_plane(p) for p in range(layout.num_planes)]

    # Capacity ------------------------------------------------------------------------------------------
    @property
    def planes(self) -> int:
        return self.layout.num_planes

    @property
    def tables(self) -> int:
        return self.layout.num_tables

    def pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def blocks_for(self, tokens: int) -> int:
        return self.pages(tokens) * self.tables

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks // self.tables * self.block_size

    def cache_only_blocks(self) -> int:
        """Blocks held by the prefix cache alone (no request): evictable on demand."""
        return sum(1 for blocks in self.cache.values() for b in blocks if self.refcount[b] == 1)

    def available_blocks(self) -> int:
        """Free units plus units held only by the prefix cache (evictable)."""
        return len(self.free) + self.cache_only_blocks()

    def reserved_growth(self) -> int:
        return sum(s.blocks_needed_total * self.tables - self._owned(s) for s in self.seqs.values())

    def _owned(self, s: SeqKV) -> int:
        return sum(len(t) for t in s.tables)

    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def _watermark_units(self, watermark_blocks: int) -> int:
        return math.ceil(watermark_blocks / self.layout.blocks_per_unit)

    # Admission ------------------------------------------------------------------------------------------
    def can_admit(
        self, request_id: str, prompt: list[int], max_kv_tokens: int, watermark: int, salt: bytes = b""
    ) -> bool:
        hits = self._lookup(prompt, salt) if self.prefix_caching else []
        need = (self.pages(max_kv_tokens) - len(hits)) * self.tables
        # Hit blocks held only by the cache count as evictable in available_blocks(); taking them for
        # this request makes them unavailable, so do not count them twice.
        taken = sum(1 for key in hits for b in self.cache[key] if self.refcount[b] == 1)
        spare = self.available_blocks() - taken - self.reserved_growth() - self._watermark_units(watermark)
        return spare >= need

    def admit(self, request_id: str, prompt: list[int], max_kv_tokens: int, salt: bytes = b"") -> int:
        """Registers the request, takes cached prefix pages; returns the number of cached prompt tokens."""
        written = {(p, i): WrittenState() for p, layers in enumerate(self._plane_layers) for i in layers}
        seq = SeqKV([[] for _ in range(self.tables)], written, self.pages(max_kv_tokens))
        self.seqs[request_id] = seq
        if not self.prefix_caching:
            return 0
        seq.hashes = self._page_hashes(prompt, salt)
        hits = self._lookup(prompt, salt)
        self.stats["prefix_query_tokens"] += len(prompt)
        for key in hits:
            blocks = self.cache[key]
            self.cache.move_to_end(key)  # LRU refresh
            for t, b in enumerate(blocks):
                seq.tables[t].append(b)
                self.refcount[b] += 1
        cached = len(hits) * self.block_size
        for ws in written.values():
            ws.mark(0, cached)
        seq.published_pages = len(hits)
        self.stats["prefix_hit_tokens"] += cached
        return cached

    # Allocation -----------------------------------------------------------------------------------------
    def ensure_capacity(self, request_id: str, num_tokens: int) -> bool:
        """Grows every table to hold `num_tokens` positions (claiming from free/evictable)."""
        seq = self.seqs[request_id]
        missing = self.pages(num_tokens) - len(seq.tables[0])
        if missing <= 0:
            return True
        fresh = self._claim(missing * self.tables)
        if fresh is None:
            return False
        for t in range(self.tables):  # table t gets fresh[t*missing:(t+1)*missing]
            seq.tables[t].extend(fresh[t * missing : (t + 1) * missing])
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
            self.on_freed(self.pool_block_ids(freed))

    def pool_block_ids(self, units: list[int]) -> list[int]:
        n = self.layout.blocks_per_unit
        return [u * n + k for u in units for k in range(n)]

    def free_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._release([b for table in seq.tables for b in table])

    # Addresses and written state ------------------------------------------------------------------------
    def table(self, request_id: str, plane: int) -> list[int]:
        """The allocation units of `plane`'s table (shared with other planes under `packed`)."""
        return self.seqs[request_id].tables[self.layout.table_of(plane)]

    def entries(self, request_id: str, plane: int) -> np.ndarray:
        """Entry base of every page of `plane`: layer l of page i is entry `entries[i] + l`."""
        table = np.asarray(self.table(request_id, plane), dtype=np.int64)
        return table * self.layout.unit_entries + self.layout.entry_offset(plane)

    def slot(self, request_id: str, plane: int, pos: int) -> tuple[int, int]:
        """(entry base, offset) of one position of `plane`."""
        unit = self.table(request_id, plane)[pos // self.block_size]
        return unit * self.layout.unit_entries + self.layout.entry_offset(plane), pos % self.block_size

    def _layers(self, layers: Layers) -> Iterable[int]:
        return self.layout.role_layer_ids(layers) if isinstance(layers, str) else layers

    def _state(self, request_id: str, plane: int, layer: int) -> WrittenState | None:
        return self.seqs[request_id].written.get((plane, layer))

    def check_history(self, request_id: str, plane: int, layers: Layers, first_pos: int) -> None:
        """Every position before `first_pos` must be written, by every one of these layers of `plane`,
        before a query at `first_pos` attends (`layers`: a role name or physical layer ids)."""
        for layer in self._layers(layers):
            ws = self._state(request_id, plane, layer)
            if ws is None or not ws.covers(first_pos):
                upto = "never (no slot in this plane)" if ws is None else f"up to {ws.prefix}"
                raise KVHistoryError(
                    f"uninitialized KV history: request {request_id} plane {plane} layer {layer} written "
                    f"{upto}, query at position {first_pos}"
                )

    def check_written(self, request_id: str, plane: int, layers: Layers, pos: int) -> None:
        """Position `pos` itself must be written by every one of these layers of `plane` (exit-plane copy)."""
        for layer in self._layers(layers):
            ws = self._state(request_id, plane, layer)
            if ws is None or not ws.has(pos):
                raise KVHistoryError(
                    f"uninitialized KV history: request {request_id} plane {plane} layer {layer} has not "
                    f"written position {pos} (exit-plane copy)"
                )

    def mark_written(self, request_id: str, plane: int, layers: Layers, start: int, stop: int) -> None:
        seq = self.seqs[request_id]
        for layer in self._layers(layers):
            ws = seq.written.get((plane, layer))
            if ws is None:
                raise RuntimeError(f"layer {layer} has no KV slot in plane {plane} ({self.layout.name})")
            ws.mark(start, stop)

    # Prefix cache ---------------------------------------------------------------------------------------
    def _page_hashes(self, prompt: list[int], salt: bytes = b"") -> list[bytes]:
        """Chained SHA-256 over full pages of tokens[:-1] (the last prompt token is never cached). `salt`
        starts the chain: KV that depends on more than the tokens (a request's noise seed) only matches
        KV made with the same salt."""
        keys, prev = [], salt
        usable = prompt[:-1]
        for i in range(len(usable) // self.block_size):
            page = np.asarray(usable[i * self.block_size : (i + 1) * self.block_size], dtype="<i8")
            prev = hashlib.sha256(prev + page.tobytes()).digest()
            keys.append(prev)
        return keys

    def _lookup(self, prompt: list[int], salt: bytes = b"") -> list[bytes]:
        hits = []
        for key in self._page_hashes(prompt, salt):
            if key not in self.cache:
                break
            hits.append(key)
        return hits

    def publish(self, request_id: str, prefilled: int, prompt_len: int) -> int:
        """Publishes full prompt pages every plane covers (see `_page_covered`); stops at the first gap."""
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
                blocks = [seq.tables[t][page] for t in range(self.tables)]
                for b in blocks:
                    self.refcount[b] += 1
                self.cache[key] = blocks
                new += 1
            seq.published_pages += 1
        return new

    def _page_covered(self, seq: SeqKV, plane: int, stop: int) -> bool:
        """`all_planes` (base rule): every layer of the model, dead slots included, must have written the
        page in this plane, so a plane with dead slots (Huginn planes >= 1) never covers. `per_plane`: the
        layers the plane holds must have written it."""
        if self.publication == "per_plane":
            layers = self._plane_layers[plane]
        else:
            layers = range(self.layout.spec.num_layers)
        for layer in layers:
            ws = seq.written.get((plane, layer))
            if ws is None or not ws.covers(stop):
                return False
        return True

    def prefix_summary(self) -> dict:
        q, h = self.stats["prefix_query_tokens"], self.stats["prefix_hit_tokens"]
        return {
            "prefix_publication": self.publication,
            "prefix_query_tokens": q,
            "prefix_hit_tokens": h,
            "prefix_hit_rate": h / q if q else 0.0,
        }


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
        """copies [n, 4] = (src entry base, src offset, dst entry base, dst offset): copy one token slot of
        every core layer (entry = base + layer). One gather and one scatter per K/V, whatever the number of
        exiting tokens."""
        sb, so, db, do = (copies[:, i, None] for i in range(4))
        layers = self.core_layers[None, :]
        src, dst = sb + layers, db + layers
        for cache in (self.k_cache, self.v_cache):
            flat = cache.flatten(0, 1)  # entry view (a view: the pool is contiguous)
            flat[dst, do] = flat[src, so]

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
    """Blocks in the pool: explicit, or CPU tokens x blocks per page, or what fits in free CUDA memory."""
    if num_blocks is not None:
        return num_blocks
    per_page = layout.blocks_per_page
    if device.type != "cuda":
        return math.ceil(cpu_pool_tokens / block_size) * per_page
    bytes_per_block = 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim
    bytes_per_block *= torch.empty((), dtype=dtype).element_size()
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1 - gpu_memory_utilization) * total - (1 << 30)  # 1 GiB for graphs and activations
    return max(per_page, int(budget // bytes_per_block) // per_page * per_page)
