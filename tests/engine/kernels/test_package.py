"""The kernels package's own functions (`looptrace/engine/kernels/__init__.py`): importing it imports no
Triton, the eager-or-exact policy by row count, and the calibration on a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from looptrace.engine.kernels import reduce_order, use_exact

gpu = pytest.mark.gpu


@gpu
def test_calibrate_keeps_one_kernel_form():
    from looptrace.engine import kernels

    assert kernels.calibrate("cuda") == {"order": reduce_order.default_shuffle_order(), "one_kernel": True}


def test_importing_engine_and_kernels_does_not_import_triton():
    code = (
        "import sys, looptrace.engine, looptrace.engine.layers, looptrace.engine.kernels as k;"
        "from looptrace.engine.kernels import reduce_order; from looptrace.engine import kernel_checks;"
        "k.use_exact(1, False); assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_use_exact_policy():
    assert use_exact(1, capturing=True)
    assert use_exact(300, capturing=False)
    assert not use_exact(256, capturing=False)
    assert not use_exact(8, capturing=False)
