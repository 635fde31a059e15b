"""bench/gemv_batch.py's table step: each swept shape's fastest candidate becomes the tile the engine's arm
B picks at 2-8 rows for that shape, and nothing else changes (the timing needs CUDA)."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def gemv_batch(monkeypatch):
    pytest.importorskip("triton")  # the GEMV's tile table lives in a Triton module
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts bench/ first
    spec = importlib.util.spec_from_file_location("gemv_batch", BENCH / "gemv_batch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(name, n, k, timings):
    candidates = [{"config": asdict(cfg), "split_k": 1, "us": us} for cfg, us in timings]
    return {"shape": name, "N": n, "K": k, "M": 8, "candidates": candidates}


def test_each_shapes_fastest_candidate_is_the_tile_it_picks_at_two_to_eight_rows(gemv_batch, monkeypatch):
    tiles = gemv_batch.tiles
    slow, fast, other = tiles.MANY_ROW_CANDIDATES[:3]
    results = [_row("ouro_o", 2048, 2048, [(slow, 9.0), (fast, 4.0)]),
               _row("ouro_down", 2048, 5632, [(fast, 8.0), (other, 7.5)])]  # fmt: skip
    entries = gemv_batch.winners_first(results)
    one_row, unswept = tiles.pick_config(1, 2048, 2048), tiles.pick_config(8, 6144, 2048)
    monkeypatch.setattr(tiles, "TILE_TABLE", (*entries, *tiles.TILE_TABLE))
    assert [tiles.pick_config(m, 2048, 2048) for m in (2, 8)] == [fast, fast]
    assert tiles.pick_config(5, 2048, 5632) == other
    assert tiles.pick_config(1, 2048, 2048) == one_row  # one row: as before
    assert tiles.pick_config(8, 6144, 2048) == unswept  # a shape not swept: as before


def test_a_fused_form_shape_takes_its_fastest_unsplit_candidate(gemv_batch):
    """q/k/v and gate/up carry a fused output form only without a K split, so arm B takes the fastest
    one-split tile there, and the fastest overall where no candidate has one split."""
    split_fast, unsplit_slow, unsplit = gemv_batch.tiles.MANY_ROW_CANDIDATES[:3]
    qkv = {"shape": "ouro_qkv", "N": 6144, "K": 2048, "M": 8, "candidates": [
        {"config": asdict(split_fast), "split_k": 4, "us": 5.0},
        {"config": asdict(unsplit_slow), "split_k": 1, "us": 9.0},
        {"config": asdict(unsplit), "split_k": 1, "us": 7.0}]}  # fmt: skip
    down = {**qkv, "shape": "ouro_down", "K": 5632}
    all_split = {**qkv, "shape": "ouro_gate_up", "N": 11264, "candidates": qkv["candidates"][:1]}
    entries = gemv_batch.winners_first([qkv, down, all_split])
    assert [e[3] for e in entries] == [unsplit, split_fast, split_fast]


def _args(**overrides):
    import argparse

    args = dict(shapes="ouro_qkv,ouro_o", cublas_shapes="", rows=8, splits="1,2,4,8", a="fast")
    return argparse.Namespace(**{**args, **overrides})


def test_the_sweeps_choices_narrow_the_candidates_and_refuse_unknown_values(gemv_batch):
    """`--splits` keeps only candidates of those K splits; an unknown shape, split or row count is a
    ValueError naming its flag (main turns it into one line and exit code 2, before it looks for CUDA)."""
    tiles = gemv_batch.tiles
    shapes, kept, candidates = gemv_batch.choices(_args(cublas_shapes="ouro_down", splits="1, 4"))
    assert (shapes, kept) == (["ouro_qkv", "ouro_o"], ["ouro_down"])
    assert {c.split_k for c in candidates} == {1, 4}
    assert len(candidates) == len(tiles.MANY_ROW_CANDIDATES) // 2
    for bad, flag in ((dict(splits="3"), "--splits"), (dict(splits="1,x"), "--splits"),
                      (dict(cublas_shapes="ouro_x"), "--cublas-shapes"), (dict(shapes="a"), "--shapes"),
                      (dict(rows=9), "--rows"), (dict(a="base"), "--a")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{flag} "):
            gemv_batch.choices(_args(**bad))


def test_an_earlier_sweep_is_read_back_per_shape_and_a_bad_file_is_named(gemv_batch, tmp_path):
    """`--sweep-from` gives the rows of the shapes asked for, in their order, with the device they ran on;
    a file that is not a sweep, or lacks a shape, is a ValueError naming the file."""
    rows = [{"shape": name, "N": 1, "K": 1, "M": 8, "candidates": []} for name in ("ouro_o", "ouro_qkv")]
    sweep = tmp_path / "gemv_batch_sweep.json"
    sweep.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "results": rows}))
    device, read = gemv_batch.read_sweep(sweep, ["ouro_qkv", "ouro_o"])
    assert device == "NVIDIA H100 80GB HBM3"
    assert [r["shape"] for r in read] == ["ouro_qkv", "ouro_o"]
    with pytest.raises(ValueError, match="no sweep of ouro_down"):
        gemv_batch.read_sweep(sweep, ["ouro_qkv", "ouro_down"])
    not_a_sweep = tmp_path / "other.json"
    not_a_sweep.write_text("[1, 2]")
    for path in (not_a_sweep, tmp_path / "missing.json"):
        with pytest.raises(ValueError, match=f"^--sweep-from {path}: expected a gemv_batch_sweep.json"):
            gemv_batch.read_sweep(path, ["ouro_qkv"])
