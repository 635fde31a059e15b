"""The runner's host metadata of one traversal: for every row its state slot, position, token, the KV
entry it writes and the block table it may read, in each plane it runs in (`[planes, R, 6 + width]`,
columns `layers.META_*`); and the written-state guard around a traversal (`check` before, `mark` after),
kept by the block manager. Plain numpy on the host; the runner stages the result to the device."""

from __future__ import annotations

import numpy as np

from looptrace.engine.kv_cache import BlockManager
from looptrace.engine.layers import (
    META_CTX,
    META_FIXED,
    META_POS,
    META_SLOT,
    META_TOKEN,
    META_WBLOCK,
    META_WOFF,
)
from looptrace.engine.runner_parts import Row


class HostMetadata:
    def __init__(self, blocks: BlockManager, block_size: int) -> None:
        self.blocks, self.block_size = blocks, block_size

    def raw(self, rows: list[Row], plane_sets: list[list[int]], width: int) -> np.ndarray:
        """Host metadata -> [len(plane_sets), R, 6 + width]; entry j gives row i the plane plane_sets[j][i]
        (prefill: one entry per plane; recurrent: one entry, each row at its own depth's plane).

        Vectorized over rows: a whole-burst prefill is tens of thousands of rows times every plane (Huginn:
        32), which a per-row loop turned into seconds of host time before the first kernel."""
        bs, n = self.block_size, len(rows)
        raw = np.full((len(plane_sets), n, META_FIXED + width), -1, dtype=np.int64)
        if not n:
            return raw
        pos = np.fromiter((r.pos for r in rows), np.int64, n)
        raw[:, :, META_SLOT] = np.fromiter((r.request.state_slot for r in rows), np.int64, n)
        raw[:, :, META_POS] = pos
        raw[:, :, META_CTX] = pos + 1
        raw[:, :, META_WOFF] = pos % bs
        raw[:, :, META_TOKEN] = np.fromiter((r.token for r in rows), np.int64, n)
        page = pos // bs
        below_need = np.arange(width)[None, :] <= page[:, None]  # the table columns a row may read
        rid_index: dict[str, int] = {}
        req = np.fromiter(
            (rid_index.setdefault(r.request.request_id, len(rid_index)) for r in rows), np.int64, n
        )
        rids = list(rid_index)
        slots = []
        for j, planes in enumerate(plane_sets):
            plane = np.asarray(planes, dtype=np.int64)
            # One padded table per distinct (request, plane) of this entry; each row indexes its own.
            span = int(plane.max()) + 1
            keys, key_of_row = np.unique(req * span + plane, return_inverse=True)
            tables = np.full((len(keys), width), -1, dtype=np.int64)
            for k, key in enumerate(keys.tolist()):
                table = self.blocks.entries(rids[key // span], key % span)
                tables[k, : min(len(table), width)] = table[:width]
            row_tables = tables[key_of_row]
            write_block = row_tables[np.arange(n), page]
            if (write_block < 0).any():
                i = int(np.argmax(write_block < 0))
                raise IndexError(f"row {i} (position {int(pos[i])}) has no KV page in plane {int(plane[i])}")
            raw[j, :, META_WBLOCK] = write_block
            raw[j, :, META_FIXED:] = np.where(below_need, row_tables, -1)
            slots.append(np.stack([plane, write_block, pos % bs], axis=1))
        self.check_unique_writes(np.concatenate(slots))
        return raw

    @staticmethod
    def check_unique_writes(slots: np.ndarray) -> None:
        """slots [N, 3] = (plane, entry base, offset): two rows of one traversal must never write one slot."""
        if not len(slots):
            return
        plane, entry, offset = slots.T
        keys = (plane * (int(entry.max()) + 1) + entry) * (int(offset.max()) + 1) + offset  # one int a slot
        order = np.argsort(keys, kind="stable")
        repeated = np.flatnonzero(keys[order][1:] == keys[order][:-1])
        if len(repeated):
            dup = tuple(int(x) for x in slots[order[repeated[0]]])
            raise RuntimeError(f"duplicate KV write at plane/entry/offset {dup}")

    def width(self, rows: list[Row]) -> int:
        return max(r.pos // self.block_size + 1 for r in rows)

    def check(self, rows: list[Row], plane: int, role) -> None:
        """Every layer of `role` (or the given physical layer ids) in `plane` wrote each row's history."""
        firsts: dict[str, int] = {}
        for r in rows:  # a chunk's later rows see the rows written before them in this traversal
            firsts.setdefault(r.request.request_id, r.pos)
        for rid, pos in firsts.items():
            self.blocks.check_history(rid, plane, role, pos)

    def mark(self, rows: list[Row], plane: int, role) -> None:
        """Marks each row's position written by every layer of `role` (or the given layer ids) in `plane`;
        consecutive positions of one request are marked as one range."""
        run: list = []  # [request id, start, stop]
        for r in rows:
            rid = r.request.request_id
            if run and run[0] == rid and run[2] == r.pos:
                run[2] += 1
                continue
            if run:
                self.blocks.mark_written(run[0], plane, role, run[1], run[2])
            run = [rid, r.pos, r.pos + 1]
        if run:
            self.blocks.mark_written(run[0], plane, role, run[1], run[2])

    @staticmethod
    def raw_no_kv(rows: list[Row]) -> np.ndarray:
        """Row fields only (slot, position, token) for a traversal that reads and writes no KV."""
        raw = np.zeros((1, len(rows), META_FIXED + 1), dtype=np.int64)
        for i, row in enumerate(rows):
            raw[0, i, META_SLOT], raw[0, i, META_POS], raw[0, i, META_TOKEN] = (
                row.request.state_slot,
                row.pos,
                row.token,
            )
        return raw
