"""`kernels.rope` (ExactLoop R0): the exact RoPE and the RoPE + K/V cache write, bitwise equal to the engine's
eager ops on a GPU (every row bucket x model width x input kind, eager and replayed in a CUDA graph). CPU: the
RoPE + K/V write (`rope_half_write_kv`) runs in the Triton interpreter against the single RoPE kernel then
the K/V write kernel (the same interpreted roundings: equal), and against the eager rotation approximately
(its bf16 casts round toward zero); v, copied without arithmetic, must be exact, and the padding row must
write nothing."""

from __future__ import annotations

import pytest
import torch

from tests.engine.kernels.conftest import MODELS, ROWS, kernel_case_failures
from tests.helpers import interpreted_results_fixture

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", MODELS)
def test_rope_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.rope_case(checks.spec(model), rows, kind, gen, "cuda")

    assert kernel_case_failures(make) == []


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", ["ouro-1.4b", "olmo-retrofit-1b"])
def test_rope_kv_write_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.rope_write_case(checks.spec(model), rows, kind, gen, "cuda")

    assert kernel_case_failures(make) == []


# ------------------------------------------------------------------------------ CPU (Triton interpreter)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference over the largest magnitude of b."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels import paged_attention as pa
    from looptrace.engine.kernels import rope
    from looptrace.engine.layers import RotaryHalf

    # The wrapper takes CUDA tensors only; the interpreter runs the same kernels on CPU tensors.
    rope.supported_half = lambda q, k, c, s: True
    gen = torch.Generator().manual_seed(7)
    res = {}
    # rope + K/V write: 4 rows (the last a padding row), 3 layers, pages of 16
    rows, hq, hk, d, layers, page, layer_id = 4, 4, 2, 64, 3, 16, 2
    qkv = torch.randn(rows, (hq + 2 * hk) * d, generator=gen).bfloat16()
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.reshape(rows, hq, d), k.reshape(rows, hk, d), v.reshape(rows, hk, d)
    mod = RotaryHalf(d, 10000.0)
    cos, sin = mod.tables(torch.tensor([0, 5, 17, 3]), torch.bfloat16)
    went = torch.tensor([0, 3, 6, -1]) * 1
    woff = torch.tensor([4, 0, 15, 2])
    kc_ref, vc_ref = (torch.zeros(5 * layers, page, hk, d, dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.zeros(5 * layers, page, hk, d, dtype=torch.bfloat16) for _ in range(2))
    # Reference: the single rope kernel (the same interpreted roundings) then the K/V write kernel; and
    # the eager rotation, at the scale of the row.
    q_ref, k_ref = rope.rope_half(q, k, cos, sin)
    pa.write_kv(k_ref, v, kc_ref, vc_ref, went, woff, layer_id)
    q_got = rope.rope_half_write_kv(q, k, v, cos, sin, kc, vc, went, woff, layer_id)
    q_eager, _ = mod(q, k, cos, sin)
    res["rope_q"] = [bool(torch.equal(q_got, q_ref)) and _rel(q_got, q_eager) < 0.02, _rel(q_got, q_eager)]
    res["rope_k_in_cache"] = [bool(torch.equal(kc, kc_ref)), None]
    res["v_copied_exactly"] = [bool(torch.equal(vc, vc_ref)), None]
    written = torch.zeros(5 * layers, page, dtype=torch.bool)
    for r in range(rows - 1):
        written[went[r] + layer_id, woff[r]] = True
    res["nothing_else_written"] = [
        bool((kc[~written] == 0).all() and (vc[~written] == 0).all() and written.sum() == rows - 1),
        None,
    ]
    return res


cpu_results = interpreted_results_fixture("tests.engine.kernels.test_rope")


@pytest.mark.parametrize("case", ["rope_q", "rope_k_in_cache", "v_copied_exactly", "nothing_else_written"])
def test_interpreted_rope_kv_write(cpu_results, case):
    ok, detail = cpu_results[case]
    assert ok, detail
