"""Op categories from CPU-op ancestry and kernel names, and layers from module names."""

from __future__ import annotations

import pytest

from looptrace.probes import categories as cats


@pytest.mark.parametrize(
    ("ancestry", "kernel", "category", "decided_by"),
    [
        # a composite op owns every kernel under it, even a GEMM
        (["vllm::moe_forward"], "_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1", "MoE", 0),
        (["vllm::moe_forward", "SortTokens"], "_combined_routing_compute", "MoE routing", 1),
        (["vllm::unified_kv_cache_update", "_C_cache_ops::reshape_and_cache_flash"], "k", "KV write", 1),
        (["vllm::unified_attention_with_output"], "kernel_unified_attention_3d", "attention", 0),
        (["vllm::rocm_aiter_rmsnorm2d_fwd_with_add", "aiter::rmsnorm2d_fwd_with_add_ck"], "k", "RMSNorm", 1),
        (["_C::rotary_embedding"], "k", "RoPE", 0),
        (["sgl_kernel::silu_and_mul"], "k", "activation", 0),
        # generic ops: the innermost one
        (["vllm::rocm_unquantized_gemm", "aten::linear", "aten::addmm"], "Cijk_Alik_Bljk", "GEMM", 2),
        (["aten::contiguous", "aten::clone", "aten::copy_"], "elementwise_kernel", "copy/cast", 2),
        (["aten::mean"], "reduce_kernel", "reduce", 0),
        (["aten::mul"], "elementwise_kernel", "elementwise", 0),
        # a qk-norm wrapper is not a norm: its reshape copy stays a copy
        (["sglang_profiler::utils_apply_qk_norm_487", "aten::reshape", "aten::clone", "aten::copy_"], "k",
         "copy/cast", 3),
        # no op: the kernel name
        ([], "void at::native::reduce_kernel<512, 1>", "reduce", None),
        ([], "triton_poi_fused__to_copy_1", "copy/cast", None),
        # Inductor's CPU op of a Triton launch carries the kernel's name: it decides
        (["triton_poi_fused__to_copy_1"], "triton_poi_fused__to_copy_1", "copy/cast", 0),
        (["triton_poi_fused_0"], "triton_poi_fused_0", "elementwise", 0),
        ([], "Memcpy DtoD (Device -> Device)", "copy/cast", None),
        ([], "mystery", "other", None),
        # collectives are communication, never a compute reduce or a copy (names: probes/collectives.py)
        ([], "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication",
         None),
        ([], "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", "communication", None),
        ([], "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "communication", None),
        (["c10d::allreduce_", "record_param_comms"], "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)",
         "communication", 1),
        (["nccl:all_reduce"], "k", "communication", 0),
        (["vllm::all_reduce"], "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(...)",
         "communication", 0),
        # vision ops (names from an eager timesformer/ViT trace on an H100, ATen's CUDA kernels)
        (["aten::layer_norm", "aten::native_layer_norm"],
         "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(...)",
         "LayerNorm", 1),
        (["aten::conv3d", "aten::convolution", "aten::_convolution", "aten::cudnn_convolution"],
         "sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_ndhwckrsc_ndhwc_tilesize128x128x32", "convolution",
         3),
        ([], "sm80_xmma_fprop_implicit_gemm_indexed_f32f32_tf32f32_f32_nhwckrsc_nchw", "convolution", None),
        (["aten::upsample_bilinear2d"],
         "void at::native::(anonymous namespace)::upsample_bilinear2d_out_frame<float, float>(...)",
         "interpolation", 0),
        (["aten::group_norm", "aten::native_group_norm"], "k", "normalization", 1),
        (["aten::conv2d", "aten::convolution", "aten::_convolution", "aten::_conv_depthwise2d"], "k",
         "convolution", 3),
        (["aten::rms_norm"], "k", "RMSNorm", 0),
    ],
)  # fmt: skip
def test_categorize(ancestry: list[str], kernel: str, category: str, decided_by: int | None) -> None:
    assert cats.categorize(ancestry, kernel) == (category, decided_by)


def test_layer_index_from_module_names_and_paths() -> None:
    assert (
        cats.layer_index(["nn.Module: Qwen2Model_0", "nn.Module: Qwen2DecoderLayer_7", "nn.Module: Linear_3"])
        == 7
    )
    assert cats.layer_index(["model.layers.12.mlp.down_proj"]) == 12
    assert cats.layer_index(["nn.Module: Qwen2RMSNorm_4"]) is None


def test_lt_ops_set_the_category_in_looptrace_traces() -> None:
    assert cats.lt_category("norm", "reduce_kernel") == "RMSNorm"
    assert cats.lt_category("mlp", "sm90_xmma_gemm_bf16") == "GEMM"
    assert cats.lt_category(None, "mystery") == "other"
    # a GEMM kernel inside lt.op/attention (the q/k/v/o projections) counts as GEMM, as in vLLM's traces
    assert cats.lt_category("attention", "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT") == "GEMM"
    assert cats.lt_category("attention", "_attn_kernel") == "attention"


def test_looptrace_triton_kernels_by_name():
    # inside exactloop's whole-token graph replays on the H200 these were "other" (no eager body matched)
    assert cats.kernel_category("_attn_kernel") == "attention"
    assert cats.kernel_category("_residual_norm_kernel") == "RMSNorm"
    assert cats.kernel_category("_rope_half_write_kernel") == "RoPE"
    assert cats.kernel_category("_write_kv_kernel") == "KV write"
    assert cats.kernel_category("_silu_mul_kernel") == "activation"


def test_vision_ops_recorded_on_cpu(tmp_path) -> None:
    """A small conv + LayerNorm + upsample model recorded by torch.profiler: each op is named for what it
    is (not RMSNorm, elementwise or sampling, as an H100 timesformer trace was labelled)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from looptrace.probes.counters import analyze
    from looptrace.probes.events import load_chrome_trace

    conv, norm = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.LayerNorm(8)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        y = norm(conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        torch.nn.functional.interpolate(y, scale_factor=2, mode="bilinear")
    prof.export_chrome_trace(str(tmp_path / "vision.json"))
    a = analyze(load_chrome_trace(tmp_path / "vision.json"))
    found = {r.category for r in a.categories}
    assert {"convolution", "LayerNorm", "interpolation"} <= found
    assert not found & {"RMSNorm", "sampling"}
    by_op = {r.op: r.category for r in a.ops}
    assert by_op["aten::upsample_bilinear2d"] == "interpolation"
    assert [c for op, c in by_op.items() if "conv" in op] and all(
        c == "convolution" for op, c in by_op.items() if "conv" in op
    )
