"""bench/persistent_loop_faults.py: a child that dies is reported as a fault with its error line and the
repository frame it died in, without taking the parent with it; without CUDA the script refuses cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import persistent_loop_faults as faults  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the arm runs clean where CUDA is")
def test_a_child_that_fails_is_a_fault_with_its_error_and_frame():
    verdict = faults.child(["--child-arm", "p:1:1", "--layers", "1"], timeout=120)
    assert verdict.startswith("FAULT rc=1: ")
    assert "CUDA" in verdict and "persistent_loop_faults.py" in verdict and "run_arm" in verdict


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses only without CUDA")
def test_without_cuda_the_script_refuses_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "persistent_loop_faults.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "needs CUDA" in done.stderr
    assert list(tmp_path.iterdir()) == []
