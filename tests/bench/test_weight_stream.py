"""bench/kernel_weight_stream.py: the TMA-ring probe compiles for sm_90a on any machine without spilling and
within one SM's shared memory; bad launch shapes and a missing GPU are refused in one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = BENCH / "kernel_weight_stream.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_the_probe_compiles_for_hopper_without_spills(tmp_path):
    done = run("--out", str(tmp_path), "--compile-only", "--shapes", "16:12:4")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads((tmp_path / "weight_stream.json").read_text())["compiled"]
    assert row["shape"] == "16:12:4" and row["spill_bytes"] == 0 and row["registers"] <= 255
    ring, x = 12 * 16 * 256 * 2, 32 * 256 * 4
    assert ring + x <= row["shared_bytes"] <= 227 * 1024


@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ("16:12", "expected BN:SLOTS:WARPS"),
        ("12:8:4", "BN in 8/16/32/64"),
        ("64:8:4", "bytes of shared memory"),
    ],
)
def test_a_bad_shape_is_refused_in_one_line(tmp_path, shape, says):
    done = run("--out", str(tmp_path), "--compile-only", "--shapes", shape)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and says in done.stderr
    assert shape in done.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses only without CUDA")
def test_without_cuda_the_timing_refuses_in_one_line(tmp_path):
    done = run("--out", str(tmp_path))
    assert done.returncode == 2 and "needs CUDA" in done.stderr and list(tmp_path.iterdir()) == []
