"""Shared by the kernel tests: the bitwise harness of the exact kernels on a GPU (every input kind, eager
and captured-and-replayed, against `looptrace.engine.layers` run eagerly) and the helpers of the GEMV forms'
tests (CUDA gates opened for the interpreter child, relative error, a result from a graph replay)."""

from __future__ import annotations

import torch

ROWS = (1, 3, 5, 13, 64, 300)  # buckets 1, 2-3, 4-7, 8-15, >= 16, > 256
MODELS = ("ouro-1.4b", "huginn-0125", "olmo-retrofit-1b")
KINDS = ("random", "wide", "tiny", "large", "ties", "exp-edge")


def kernel_case_failures(make_case) -> list[str]:
    """All input kinds x {eager, graph} for one (kernel, model, rows); returns the failures."""
    from looptrace.engine import kernel_checks as checks

    gen = torch.Generator(device="cuda").manual_seed(20260)
    failures = []
    for kind in KINDS:
        case = make_case(checks, kind, gen)
        assert case.uses_kernel, f"{case.kernel} fell back to eager for {case.model} rows={case.rows}"
        for mode in ("eager", "graph"):
            ok, diff = checks.compare(case, mode)
            if not ok:
                failures.append(
                    f"{case.kernel} {case.model} rows={case.rows} {kind} {mode}: {diff} elements differ"
                )
    return failures


def _rel_err(a, ref) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def _open_cuda_gates():
    """In the interpreter child only: the CUDA-only gates accept CPU tensors (the kernels run on CPU)."""
    from looptrace.engine.kernels import rmsnorm, silu_mul
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    def cpu_ok(x, *rest):
        return x.dtype == torch.bfloat16 and x.numel() > 0

    gemv_tiles.supported = lambda x, w, b: (
        b is None and x.dtype == w.dtype == torch.bfloat16 and x.numel() > 0
    )
    rmsnorm.supported = lambda x, w: cpu_ok(x) and w.dim() == 1 and w.shape[0] == x.shape[-1]
    silu_mul.supported = lambda g, u: cpu_ok(g) and g.shape == u.shape


def _replayed(fn):
    """fn's result from a CUDA graph replay (captured after an eager warm-up), outputs copied out."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
