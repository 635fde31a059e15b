"""Which op a kernel is attributed to: the launching CPU op's name, short kernel names."""

from __future__ import annotations

import pytest

from looptrace.probes.events import TraceEvent
from looptrace.probes.opstats import kernel_op, short_kernel_name


def op(name: str, ts: float = 0.0, dur: float = 10.0) -> TraceEvent:
    return TraceEvent("cpu_op", name, ts, dur, 1, 1)


@pytest.mark.parametrize(
    ("kernel", "short"),
    [
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>(at::native::ReduceOp<float>)",
         "at::native::reduce_kernel"),
        # ATen's kernels in an anonymous namespace (softmax, layer norm): not `void`
        ("void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, 10>(...)",
         "softmax_warp_forward"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float)",
         "at::native::vectorized_layer_norm_kernel"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT"),
    ],
)  # fmt: skip
def test_short_kernel_names(kernel: str, short: str) -> None:
    assert short_kernel_name(kernel) == short


def test_launching_op_keeps_its_name_when_the_kernel_name_decides() -> None:
    """A custom op no category rule knows launched the kernel: the kernel name gives the category, the
    op keeps its name (and is the call, once per instance)."""
    launcher = op("_C::dynamic_per_token_scaled_fp8_quant")
    k = kernel_op(
        "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10>(...)", [launcher]
    )
    assert (k.category, k.op, k.shapes) == ("reduce", "_C::dynamic_per_token_scaled_fp8_quant", launcher)
    assert k.call is not None
    bare = kernel_op("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10>(...)", [])
    assert (bare.op, bare.call) == ("softmax_warp_forward", None)
