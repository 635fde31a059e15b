"""Compile a Gluon kernel for Hopper (sm_90a) on any machine, no GPU: Triton to PTX, then Triton's own
`ptxas` for the registers, spills and shared memory one launch form needs (`ptxas_report` serves plain
Triton kernels too)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton


def tile_descriptor(rows: int, cols: int) -> str:
    """The signature type of a host TensorDescriptor of bf16 [rows, cols] boxes, no swizzle."""
    layout = "NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2, transposed=False, "
    return f"tensordesc<bf16[{rows}, {cols}],{layout}fp4_padded=False, cga_layout=[])>"


def compile_sm90(fn, signature: dict, constexprs: dict, warps: int, fp_fusion: bool = True,
                 aligned: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """registers per thread, spill bytes and shared bytes of one launch form of Gluon kernel `fn` (compiled
    with the launch's own `enable_fp_fusion`). `aligned`: arguments known to be multiples of 16 (bytes for
    pointers), as a launch specializes them at real shapes."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = [p.name for p in fn.params]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    kernel = triton.compile(
        GluonASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, enable_fp_fusion=fp_fusion),
    )
    return dict(**ptxas_report(kernel.asm["ptx"]), shared_bytes=kernel.metadata.shared)


def ptxas_report(ptx: str) -> dict:
    """registers per thread and spill bytes of sm_90a PTX, from Triton's own `ptxas -v`."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.ptx").write_text(ptx)
        report = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", Path(tmp, "k.ptx"), "-o", Path(tmp, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    text = report.stdout + report.stderr
    spills = re.search(r"(\d+) bytes spill stores", text)
    return dict(
        registers=int(re.search(r"Used (\d+) registers", text).group(1)),
        spill_bytes=int(spills.group(1)) if spills else 0,
    )
