"""The runner's host metadata (`runner_metadata.HostMetadata.raw`): the vectorized build equals the
per-row definition (row fields, write entry, the block-table prefix each row may read, -1 elsewhere) for
prefill and for decode rows at mixed depth planes, on the planes and packed layouts; duplicate writes are
refused."""

from __future__ import annotations

import numpy as np
import pytest

from looptrace.engine.layers import (
    META_CTX,
    META_FIXED,
    META_POS,
    META_SLOT,
    META_TOKEN,
    META_WBLOCK,
    META_WOFF,
)
from looptrace.engine.llm_engine import LLMEngine
from looptrace.engine.request import SamplingParams, Stage
from looptrace.engine.runner_parts import Row
from looptrace.recipes import load_recipe


def reference_raw(runner, rows: list[Row], plane_sets: list[list[int]], width: int) -> np.ndarray:
    """One row and one plane at a time: what every field means."""
    bs = runner.block_size
    raw = np.full((len(plane_sets), len(rows), META_FIXED + width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        need = row.pos // bs + 1
        for j, planes in enumerate(plane_sets):
            table = runner.blocks.entries(row.request.request_id, planes[i])
            raw[j, i, META_SLOT] = row.request.state_slot
            raw[j, i, META_POS] = row.pos
            raw[j, i, META_CTX] = row.pos + 1
            raw[j, i, META_WOFF] = row.pos % bs
            raw[j, i, META_TOKEN] = row.token
            raw[j, i, META_WBLOCK] = table[row.pos // bs]
            raw[j, i, META_FIXED : META_FIXED + need] = table[:need]
    return raw


def admitted(preset: str, recipe: str, prompt_lens: tuple[int, ...]):
    cfg = load_recipe(
        recipe,
        [
            f"scheduler.max_num_seqs={len(prompt_lens)}",
            f"scheduler.max_num_batched_tokens={sum(prompt_lens)}",
            f"scheduler.prefill_chunk_size={max(prompt_lens)}",
        ],
    ).config
    engine = LLMEngine.from_preset(preset, cfg, device="cpu")
    rng = np.random.default_rng(3)
    for n in prompt_lens:
        engine.add_request(rng.integers(1, 100, n).tolist(), SamplingParams(max_tokens=40, ignore_eos=True))
    engine.scheduler.admit()
    batch = engine.scheduler.take(Stage.PREFILL)
    rows = [
        Row(s.request, p, s.request.prompt[p])
        for s in batch.spans
        for p in range(s.start, s.start + s.length)
    ]
    return engine.runner, rows


@pytest.mark.parametrize(
    "preset,recipe", [("huginn-tiny", "base"), ("huginn-tiny", "exactloop"), ("ouro-tiny", "base")]
)
def test_prefill_metadata_equals_the_per_row_definition(preset, recipe) -> None:
    runner, rows = admitted(preset, recipe, (37, 16, 70))
    planes = sorted(
        {
            runner.layout.plane("prelude", 0),
            *(runner.layout.plane("core", t) for t in range(runner.max_loops)),
        }
    )
    plane_sets = [[p] * len(rows) for p in planes]
    width = runner.host_meta.width(rows)
    got = runner.host_meta.raw(rows, plane_sets, width)
    assert np.array_equal(got, reference_raw(runner, rows, plane_sets, width))
    # A wider table than the rows need (the graphs' fixed width) only adds -1 columns.
    wide = runner.host_meta.raw(rows, plane_sets, width + 3)
    assert np.array_equal(wide, reference_raw(runner, rows, plane_sets, width + 3))
    assert (wide[..., META_FIXED + width :] == -1).all()


def test_decode_rows_at_mixed_planes() -> None:
    """Recurrent steps: one plane set, each row (a different request) at its own depth's plane."""
    runner, rows = admitted("huginn-tiny", "base", (20, 33, 9))
    last = {}
    for r in rows:
        last[r.request.request_id] = r  # each request's last prompt position
    decode = [Row(r.request, r.pos, 5) for r in last.values()]
    planes = [[runner.layout.plane("core", t) for t in (0, 3, 7)]]
    width = runner.host_meta.width(decode)
    got = runner.host_meta.raw(decode, planes, width)
    assert np.array_equal(got, reference_raw(runner, decode, planes, width))


def test_two_rows_writing_one_slot_are_refused() -> None:
    runner, rows = admitted("ouro-tiny", "base", (20,))
    twice = [rows[3], rows[3]]
    with pytest.raises(RuntimeError, match=r"duplicate KV write at plane/entry/offset \(0, \d+, 3\)"):
        runner.host_meta.raw(twice, [[0, 0]], runner.host_meta.width(twice))
    # The same position in two planes is two slots, not a duplicate.
    runner.host_meta.raw([rows[3], rows[3]], [[0, 1]], runner.host_meta.width(twice))
