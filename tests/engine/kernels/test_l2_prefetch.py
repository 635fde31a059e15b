"""`kernels.l2_prefetch` (R0): which weight each projection prefetches, and when (CPU); on the GPU, a
captured graph with prefetches computes bit for bit what it computes without them."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable")


def weights(n: int) -> list[torch.Tensor]:
    return [torch.zeros(512, 1024) for _ in range(n)]  # 2 MB each: above MIN_BYTES


def recorder(capturing: bool):
    from looptrace.engine.kernels.l2_prefetch import WeightPrefetcher

    issued: list[torch.Tensor] = []
    return WeightPrefetcher(torch.device("cpu"), issue=issued.append, capturing=lambda: capturing), issued


def test_successors_are_learnt_from_eager_calls_without_prefetching():
    pf, issued = recorder(capturing=False)
    w = weights(3)
    x = torch.zeros(1, 1024)
    for weight in w + w[:1]:
        pf.before(weight, x)
    assert issued == []
    assert [pf.next_of[a.data_ptr()] is b for a, b in zip(w, w[1:] + w[:1])] == [True, True, True]


def test_under_capture_each_call_prefetches_the_weight_that_followed_it():
    from looptrace.engine.kernels.l2_prefetch import MAX_ROWS

    pf, issued = recorder(capturing=False)
    w = weights(4)
    x = torch.zeros(2, 1024)
    for weight in w * 2:  # two eager passes (the warm-ups before a capture)
        pf.before(weight, x)
    pf.capturing = lambda: True
    for weight in w:
        pf.before(weight, x)
    assert [t is u for t, u in zip(issued, w[1:] + w[:1])] == [True] * 4
    pf.before(w[0], torch.zeros(MAX_ROWS + 1, 1024))  # prefill-sized: compute-bound, no prefetch
    pf.before(torch.zeros(8, 8), x)  # a small weight (an exit gate): neither recorded nor prefetched
    assert len(issued) == 4 and pf.issued == 4


def test_apply_wraps_linears_and_fused_projections_and_keeps_their_results():
    from looptrace.engine.kernels import l2_prefetch

    class Block(nn.Module):
        fused_linear = staticmethod(torch.nn.functional.linear)

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(1024, 512, bias=False)
            self.gate = nn.Linear(1024, 1, bias=True)  # biased: untouched
            self.qkv = torch.randn(768, 1024)

        def forward(self, x):
            return self.proj(x), self.fused_linear(x, self.qkv), self.gate(x)

    model = Block()
    x = torch.randn(3, 1024)
    before = model(x)
    pf = l2_prefetch.apply_l2_prefetch(model, "cpu")
    issued: list = []
    pf.issue = issued.append
    after = model(x)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert pf.next_of[model.proj.weight.data_ptr()] is model.qkv  # recorded through both wrappers
    assert issued == [] and pf in l2_prefetch._ACTIVE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_prefetches_change_no_bit():
    """A chain of projections captured with and without prefetches: the same bits, and the prefetch
    graph holds the extra kernels (it issued one per projection after the first pass)."""
    from looptrace.engine.kernels import join_prefetches, l2_prefetch

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)]).cuda().bfloat16()
    for lin in layers:
        lin.weight.data = torch.randn(2048, 2048, generator=gen, device="cuda").bfloat16() * 0.02
    x = torch.randn(1, 2048, generator=gen, device="cuda").bfloat16()

    def capture():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                layers(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = layers(x)
            join_prefetches()
        g.replay()
        torch.cuda.synchronize()
        return out.clone()

    plain = capture()
    pf = l2_prefetch.apply_l2_prefetch(layers, "cuda")
    prefetched = capture()
    assert pf.issued >= 7
    assert torch.equal(plain, prefetched)


def test_the_wrapped_gemv_fused_linear_takes_the_wrappers_call():
    """`kernels.l2_prefetch` wraps a fused projection's `fused_linear` and calls it as `(x, weight, bias)`:
    `GemvFusedLinear`'s (the Triton GEMV where it applies, `F.linear` on CPU) takes that call."""
    from looptrace.engine.kernels.l2_prefetch import _wrap_fused
    from looptrace.engine.models.ouro import GemvFusedLinear

    prefetched = []

    class Prefetcher:
        def before(self, weight, x):
            prefetched.append(tuple(weight.shape))

    module = GemvFusedLinear()
    _wrap_fused(module, Prefetcher())
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(module.fused_linear(x, w), torch.nn.functional.linear(x, w))
    assert prefetched == [(4, 8)]
