"""Roofline model: op costs checked against hand computations, device detection from real traces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from looptrace.probes.roofline import DEVICES, OpCost, achieved, device_for, op_cost, op_dtype

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
BF16 = "c10::BFloat16"


def _device_properties(relpath: str) -> list[dict]:
    path = TRACES / relpath
    if not path.exists():
        pytest.skip(f"{path} not present (shared real traces)")
    with gzip.open(path, "rt") as f:
        return json.load(f)["deviceProperties"]


def test_addmm_decode_gemm_matches_hand_computation():
    # The vLLM gpt-oss decode GEMM (capture trace): bias[5120] + x[32,2880] @ W^T[2880,5120], bf16.
    cost = op_cost(
        "aten::addmm",
        [[5120], [32, 2880], [2880, 5120], [], []],
        [BF16, BF16, BF16, "Scalar", "Scalar"],
        ["", "", "", "1", "1"],
    )
    flops = 2 * 32 * 2880 * 5120  # one multiply-add per (row, column, k)
    nbytes = (32 * 2880 + 2880 * 5120 + 32 * 5120 + 5120) * 2  # x, W, out, bias: 2 bytes each
    assert cost == OpCost(flops=flops, bytes=nbytes)
    # the same call reached through aten::linear (weight [N, K]) costs the same
    assert op_cost("aten::linear", [[32, 2880], [5120, 2880], [5120]], [BF16] * 3) == cost


def test_causal_sdpa_prefill_matches_hand_computation():
    # HF Qwen1.5-0.5B prefill (H100 trace): q, k, v [B=16, H=16, S=559, D=64] bf16, is_causal=True.
    dims = [[16, 16, 559, 64]] * 3 + [[], [], [], [], []]
    types = [BF16] * 3 + ["", "Scalar", "Scalar", "Scalar", "Scalar"]
    concrete = ["", "", "", "", "0.", "True", "0.125", "False"]
    cost = op_cost("aten::scaled_dot_product_attention", dims, types, concrete)
    pairs = 559 * 560 // 2  # causal: query i scores keys 0..i
    flops = 16 * 16 * pairs * (2 * 64 + 2 * 64)  # QK^T and PV: 2 FLOPs per multiply-add, D=64 each
    nbytes = 4 * 16 * 16 * 559 * 64 * 2  # Q, K, V read and O written once, bf16
    assert cost == OpCost(flops=flops, bytes=nbytes)
    # not causal: every query scores all 559 keys
    concrete[5] = "False"
    full = op_cost("aten::scaled_dot_product_attention", dims, types, concrete)
    assert full is not None and full.flops == 16 * 16 * 559 * 559 * 256
    # the memory-efficient backend, [B, S, H, D] with custom_mask_type 1 (causal, top-left): same cost
    bshd = [[16, 559, 16, 64]] * 3 + [[]] * 7
    eff = op_cost("aten::_efficient_attention_forward", bshd, [BF16] * 3 + [""] * 7, [""] * 9 + ["1"])
    assert eff == cost


def test_flash_decode_is_bottom_right_causal():
    # one new query against 640 cached keys, [B, S, H, D] layout: causal keeps all 640 keys
    dims = [[1, 1, 8, 128], [1, 640, 2, 128], [1, 640, 2, 128]]
    concrete = ["", "", "", "0.0", "0.088", "True"]
    cost = op_cost("flash_attn::_flash_attn_forward", dims, [BF16] * 3, concrete)
    assert cost is not None
    assert cost.flops == 2 * 8 * 640 * (128 + 128)  # 8 heads x 640 keys, QK^T and PV
    assert cost.bytes == (8 * 128 + 2 * 2 * 640 * 128 + 8 * 128) * 2


def test_norm_elementwise_and_casts():
    x = [[32, 2880], [32, 2880], [2880], []]
    fused = op_cost("vllm::rocm_aiter_rmsnorm2d_fwd_with_add", x, [BF16, BF16, BF16, "Scalar"])
    assert fused is not None and fused.bytes == (4 * 32 * 2880 + 2880) * 2  # x, residual in and out; weight
    silu = op_cost("aten::silu", [[4, 100]], [BF16])
    assert silu is not None and silu.bytes == 2 * 400 * 2
    # float tensor times a wrapped Python number: the output stays float
    mul = op_cost("aten::mul", [[1, 559, 64], []], ["float", "double"])
    assert mul is not None and mul.bytes == 559 * 64 * 4 * 2 + 8
    cast = op_cost("aten::_to_copy", [[10], [], [], [], [], [], []], ["float", "Scalar"], ["", "15"])
    assert cast == OpCost(0.0, 10 * (4 + 2))  # ScalarType 15 = bfloat16
    assert op_cost("aten::view", [[32, 2880], []], [BF16, "ScalarList"]) == OpCost(0.0, 0.0)
    assert op_dtype(["long int", BF16]) == "bf16"


def test_unknown_or_underdetermined_ops_are_none():
    assert op_cost("my::mystery_op", [[4, 4]], [BF16]) is None
    # vLLM's paged attention: the KV lengths are not among its arguments
    dims = [[32, 64, 64], [32, 8, 64], [32, 8, 64], [32, 64, 64], [], [], [], [0]]
    assert op_cost("vllm::unified_attention_with_output", dims, [BF16] * 4 + [""] * 3 + [BF16]) is None
    # a schema the rule does not expect gives None, not an exception
    assert op_cost("aten::mm", [[4]], [BF16]) is None
    assert op_cost("aten::cat", [[[1, 2], [1, 2]], []], ["TensorList", "Scalar"]) is None


def test_achieved_and_floor():
    h200 = DEVICES["h200"]
    cost = OpCost(flops=2 * 32 * 2880 * 5120, bytes=30_013_440)
    a = achieved(cost, 12.5, h200, "bf16")
    mem_us = 30_013_440 / 4.8e12 * 1e6  # 6.25 µs at 4.8 TB/s; the FLOPs take 0.95 µs at 989 TFLOP/s
    assert a.bound == "memory"
    assert a.floor_us == pytest.approx(mem_us)
    assert a.pct_of_peak == pytest.approx(100 * mem_us / 12.5)
    assert a.achieved_tbps == pytest.approx(30_013_440 / 12.5e-6 / 1e12)
    unknown = achieved(cost, 12.5, None, "bf16")
    assert unknown.pct_of_peak is None and unknown.floor_us is None and unknown.achieved_tbps is not None
    big = achieved(OpCost(flops=1e12, bytes=1e6), 2000.0, h200, "bf16")
    assert big.bound == "compute" and big.floor_us == pytest.approx(1e12 / 989.4e6)


@pytest.mark.parametrize(
    ("relpath", "expected"),
    [
        ("h100_qwen1.5_0.5b/trace.json.gz", "NVIDIA H100 SXM"),
        ("sglang_prefilldecode/sglang_Qwen3-8B_prefilldecode.json.gz", "AMD Instinct MI300X"),
        # vLLM's ROCm trace leaves the name empty: recognised by 304 CUs, wave64, gfx942, 192 GiB
        ("vllm_decode_full/graph_execution.json.gz", "AMD Instinct MI300X"),
    ],
)
def test_device_from_real_trace_properties(relpath, expected):
    device = device_for(_device_properties(relpath))
    assert device is not None and device.name == expected and device.source


def test_device_override_and_unknown():
    assert device_for(None, "H200") is DEVICES["h200"]
    assert device_for([], "NVIDIA H100 PCIe") is DEVICES["h100-pcie"]
    assert device_for([{"name": "Some Future GPU", "totalGlobalMem": 1}]) is None
    assert device_for(None) is None
    with pytest.raises(ValueError, match="unknown device"):
        device_for(None, "tpu-v9")
    assert DEVICES["h200-measured"].peak_tbps == 4.28
    assert DEVICES["mi300x"].tflops_for("fp8") == 2614.9
    assert DEVICES["a100-sxm"].tflops_for("fp8") == 312.0  # no FP8 on the A100: falls back to bf16


def test_paged_attention_cost_from_kv_length() -> None:
    """One decode call of 4 rows, 2 KV heads of 64 (8 query heads), bf16, 1,000 keys read in all."""
    from looptrace.probes.roofline import paged_attention_cost

    dims = [[4, 8, 64], [4, 2, 64], [4, 2, 64], [4, 8, 64], [], []]
    types = ["c10::BFloat16"] * 4 + ["", ""]
    cost = paged_attention_cost(dims, types, keys=1_000, pairs=1_000)
    assert cost.bytes == 1_000 * 2 * 64 * 2 * 2 + 2 * 4 * 8 * 64 * 2  # K and V once, q in, out
    assert cost.flops == 4 * 8 * 64 * 1_000  # QKᵀ and PV: 2·D per pair per query head each
    assert paged_attention_cost([[4, 512]], ["c10::BFloat16"], 10, 10) is None  # no [T, H, D] shapes


@pytest.mark.parametrize(
    ("op", "dims", "label"),
    [
        ("aten::addmm", [[5120], [32, 2880], [2880, 5120], [], []], "32×5120×2880"),
        ("aten::mm", [[32, 2880], [2880, 201088]], "32×201088×2880"),
        ("aten::linear", [[4, 8, 16], [32, 16], [32]], "32×32×16"),
        ("aten::bmm", [[2, 3, 4], [2, 4, 5]], "2×3×5×4"),
        (
            "vllm::unified_attention_with_output",
            [[32, 64, 64], [32, 8, 64], [32, 8, 64], []],
            "32×64×64, 32×8×64",
        ),
        ("aten::mm", None, None),
    ],
)
def test_shape_labels(op, dims, label) -> None:
    from looptrace.probes.roofline import shape_label

    assert shape_label(op, dims) == label
