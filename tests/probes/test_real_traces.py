"""`trace analyze` on real traces that looptrace did not write (`../shared/traces/`, see its README): a vLLM
full-graph decode on an MI300X with its capture trace, an SGLang prefill on an MI300X, a Hugging Face eager
run on an H100. Each trace is loaded and analysed once per module.

Expected counts were read from the files themselves, independently of looptrace: a plain `json.load` of the
gzip and `collections.Counter` over `(cat, name)` of the `ph: X` events (runtime calls by name, kernels by
category, annotations by name); GPU busy = union of the kernel/memcpy/memset intervals, timeline = last end
- first start, computed with a 10-line interval merge. The TraceLens figures are those of the README.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from looptrace.cli.trace_cmd import trace_app
from looptrace.probes.capture import HOW_TO_RECORD, find_capture_dir, load_captures
from looptrace.probes.counters import Analysis, analyze
from looptrace.probes.events import TraceError, load_chrome_trace

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
VLLM = TRACES / "vllm_decode_full" / "graph_execution.json.gz"
SGLANG = TRACES / "sglang_prefilldecode" / "sglang_Qwen3-8B_prefilldecode.json.gz"
H100 = TRACES / "h100_qwen1.5_0.5b" / "trace.json.gz"

pytestmark = pytest.mark.skipif(
    not TRACES.is_dir(), reason=f"real traces not present at {TRACES} (see the shared traces README)"
)


def _load(path: Path, capture: bool = True) -> Analysis:
    folder = find_capture_dir(path) if capture else None
    return analyze(load_chrome_trace(path), captures=load_captures(folder) if folder else None)


@pytest.fixture(scope="module")
def vllm() -> Analysis:
    return _load(VLLM)


@pytest.fixture(scope="module")
def vllm_no_capture() -> Analysis:
    return _load(VLLM, capture=False)


@pytest.fixture(scope="module")
def sglang() -> Analysis:
    return _load(SGLANG)


@pytest.fixture(scope="module")
def h100() -> Analysis:
    return _load(H100)


def share(a: Analysis, category: str) -> float:
    return next((r.share for r in a.categories if r.category == category), 0.0)


def op_share(a: Analysis, *ops: str) -> float:
    total = sum(r.gpu_us for r in a.categories)
    return 100.0 * sum(r.gpu_us for r in a.ops if r.op in ops) / total


def within(value: float, reference: float, rel: float = 0.005) -> bool:
    return abs(value - reference) <= rel * reference


# --- vLLM: one FULL graph replay of a 32-row decode step, ROCm names --------------------------------------


def test_vllm_counts(vllm) -> None:
    c = vllm.counters
    # 3 hipLaunchKernel + 1 hipExtModuleLaunchKernel; 1 hipGraphLaunch whose correlation 421 kernels share
    assert (c.kernels, c.eager_launches, c.graph_launches, c.graph_kernels) == (425, 4, 1, 421)
    # 9 hipMemcpyAsync (DtoD), 1 hipEventSynchronize
    assert (c.dtod, c.syncs, c.sync_event) == (9, 1, 1)
    # execute_32_context_0(sq0...)_generation_32(sq32sk55086...): one decode step of 32 output tokens
    assert (c.steps, c.tokens, vllm.step_marker) == (1, 32, "execute_")
    assert vllm.tokens_source.startswith(
        "execute_…_context_…_generation_… step annotations: 32 output tokens"
    )
    [phase] = vllm.phases
    assert (phase.phase, phase.steps, phase.tokens, phase.unit) == ("decode", 1, 32, "output token")


def test_vllm_timeline_matches_tracelens(vllm) -> None:
    c = vllm.counters
    assert within(c.gpu_busy_us, 10_718.0) and within(c.wall_us, 10_743.0)  # TraceLens: 10.718 / 10.743 ms
    assert c.gpu_busy_us == pytest.approx(10_717.697, abs=1e-3)  # independent interval merge
    assert c.wall_us == pytest.approx(10_743.182, abs=1e-3)
    assert c.gpu_busy_us <= c.wall_us and c.gpu_idle_us == pytest.approx(c.wall_us - c.gpu_busy_us)
    assert c.host_us == pytest.approx(2_408.598, abs=1e-3)  # the step annotation: shorter than the GPU's


def test_vllm_categories_match_tracelens(vllm) -> None:
    # MoE includes the fused pad kernel named after moe_forward; TopK/SortTokens are "MoE routing" here
    # (TraceLens: other).
    for category, reference in (("MoE", 67.0), ("attention", 6.8), ("RMSNorm", 3.0), ("RoPE", 1.4),
                                ("KV write", 1.3)):  # fmt: skip
        assert abs(share(vllm, category) - reference) <= 2.0, category
    # TraceLens's GEMM 8.9 % is the graph's aten::addmm; the lm-head aten::mm launched eagerly after the
    # replay (one 276.7 µs kernel, 2.6 %) is GEMM here too.
    assert abs(op_share(vllm, "aten::addmm") - 8.9) <= 2.0
    assert share(vllm, "GEMM") == pytest.approx(op_share(vllm, "aten::addmm", "aten::mm"))
    assert op_share(vllm, "aten::mm") == pytest.approx(100 * 276.678 / 10_717.708, abs=0.01)
    assert 4.0 < share(vllm, "MoE routing") < 5.0


def test_vllm_gemm_rows_per_shape(vllm) -> None:
    """aten::addmm runs three shapes in each layer; each is its own roofline row (TraceLens: the
    32×5120×2880 bf16 GEMM is memory-bound at about 35 % of the MI300X roofline; lumped, 25.8 %)."""
    rows = {r.shape: r for r in vllm.ops if r.op == "aten::addmm"}
    assert set(rows) == {"32×5120×2880", "32×2880×4096", "32×32×2880"}
    assert all(r.calls == 24 and r.bound == "memory" for r in rows.values())
    qkv = rows["32×5120×2880"]
    assert qkv.flops == 24 * 2 * 32 * 5120 * 2880
    assert abs(qkv.pct_of_peak - 35.2) <= 1.0


def test_vllm_paged_attention_roofline_from_the_step_kv_length(vllm) -> None:
    """vllm::unified_attention_with_output has no cost in the op table; its q/k shapes (32×64×64 and
    32×8×64, bf16) and the step annotation's KV length (generation sk 55,086 keys over 32 rows) give it:
    per layer, K and V of 55,086 positions × 8 heads × 64 × 2 B, plus q in and out."""
    (attn,) = [r for r in vllm.ops if r.op == "vllm::unified_attention_with_output"]
    per_call = 55_086 * 8 * 64 * 2 * 2 + 2 * 32 * 64 * 64 * 2
    assert attn.calls == 24 and attn.bytes == 24 * per_call
    assert attn.flops == 24 * 4 * 64 * 64 * 55_086
    assert attn.bound == "memory" and 0 < attn.pct_of_peak < 100


def test_vllm_capture_attributes_replayed_kernels(vllm) -> None:
    r = vllm.replays
    assert (r.kernels, r.attributed_share >= 95.0) == (421, True)
    assert r.attributed_us == pytest.approx(r.gpu_us)  # every replayed kernel: a captured op, not "other"
    assert "421 of 421 kernels matched by order" in " ".join(vllm.notes)
    moe = next(row for row in vllm.ops if row.op == "vllm::moe_forward")
    assert (moe.category, moe.calls, moe.kernels) == ("MoE", 24, 72)  # 24 layers, 3 kernels per call


def test_vllm_without_capture_says_so(vllm_no_capture) -> None:
    note = next(n for n in vllm_no_capture.notes if "cannot be attributed" in n)
    assert note.startswith("421 kernels of 1 graph replay(s)") and HOW_TO_RECORD in note
    assert vllm_no_capture.replays.attributed_us == 0.0
    assert vllm_no_capture.counters.kernels == 425


# --- SGLang: one prefill step (15 requests, 15,360 prompt tokens), eager, ROCm names ----------------------


def test_sglang_counts(sglang) -> None:
    c = sglang.counters
    # 380 hipLaunchKernel + 145 hipExtModuleLaunchKernel + 2 hipModuleLaunchKernel, one kernel each
    assert (c.kernels, c.eager_launches, c.graph_launches) == (527, 527, 0)
    # 5 hipMemcpyWithStream (synchronous) and 2 hipMemcpyAsync HtoD
    assert (c.sync_memcpy, c.htod) == (5, 2)
    # execute_15360_context_15(sq15360...)_generation_0 around step[EXTEND bs=15 toks=15360]: one step
    assert (c.steps, c.tokens) == (1, 15_360)
    [phase] = sglang.phases
    assert (phase.phase, phase.tokens, phase.unit) == ("prefill", 15_360, "prompt token")


def test_sglang_timeline_matches_tracelens(sglang) -> None:
    c = sglang.counters
    assert within(c.gpu_busy_us, 492_810.0) and within(c.wall_us, 987_290.0)  # TraceLens ms: 492.81, 987.29
    assert c.gpu_busy_us == pytest.approx(492_806.864, abs=1e-3)
    assert c.wall_us == pytest.approx(987_288.887, abs=1e-3)


def test_sglang_categories_match_tracelens(sglang) -> None:
    for category, reference in (("GEMM", 85.3), ("RMSNorm", 5.3), ("attention", 4.3), ("RoPE", 1.0)):
        assert abs(share(sglang, category) - reference) <= 2.0, category
    # TraceLens's elementwise 4.1 %: silu_and_mul (activation here) and the qk-norm reshape copies
    lumped = share(sglang, "activation") + share(sglang, "copy/cast") + share(sglang, "elementwise")
    assert abs(lumped - 4.1) <= 2.0


def test_sglang_layers_from_module_names(sglang) -> None:
    gemm_layers = {r.layer for r in sglang.ops if r.category == "GEMM" and r.layer is not None}
    assert gemm_layers == set(range(36))  # nn.Module: Qwen3DecoderLayer_0 … _35


# --- Hugging Face eager on an H100: ProfilerStep#6, CUDA names ---------------------------------------------


def test_h100_counts_leave_out_work_queued_before_profiling(h100) -> None:
    c = h100.counters
    # 860 cudaLaunchKernel + 168 cudaLaunchKernelExC + 1 cuLaunchKernel = 1,029 launches and as many
    # kernels with a launch in the trace; the file has 1,465 kernel events: 436 (and 73 memsets) ran before
    # the first recorded launch, with no call of their own (work queued before profiling began).
    assert (c.kernels, c.eager_launches, c.graph_launches, c.memset, c.dtoh) == (1029, 1029, 0, 168, 1)
    assert (c.steps, c.tokens, h100.step_marker) == (1, 1, "ProfilerStep#")
    with gzip.open(H100, "rt") as fh:
        raw = json.load(fh)["traceEvents"]
    assert sum(1 for e in raw if e.get("cat") == "kernel") == 1465 == c.kernels + 436
    assert any(n.startswith("509 device events (13.74 ms) ran before the first launch") for n in h100.notes)


def test_h100_category_rows_add_up_to_the_kernel_count(h100) -> None:
    """One count: kernel rows sum to the 1,029 kernels; the 168 memsets (cuBLAS workspace, under aten::mm)
    and the D2H copy are rows of their own, not GEMM or copy/cast kernels."""
    rows = {r.category: r for r in h100.categories}
    assert sum(r.kernels for r in h100.categories) == h100.counters.kernels == 1029
    assert (rows["memset"].events, rows["memset"].kernels, rows["memcpy"].events) == (168, 0, 1)
    assert rows["GEMM"].kernels == 169
    assert sum(r.gpu_us for r in h100.categories) == pytest.approx(h100.counters.gpu_us)


def test_h100_timeline_matches_tracelens(h100) -> None:
    c = h100.counters
    assert within(c.gpu_busy_us, 31_910.0) and within(c.wall_us, 34_890.0)  # TraceLens: 31.91 / 34.89 ms
    assert c.gpu_busy_us == pytest.approx(31_905.483, abs=1e-3)
    # = the gpu_user_annotation ProfilerStep#6 span (34,892.421 µs; timestamps of 1.4e12 µs keep 2 ns)
    assert c.wall_us == pytest.approx(34_892.421, abs=0.01)


def test_h100_categories_match_tracelens(h100) -> None:
    assert abs(share(h100, "GEMM") - 28.0) <= 2.0
    assert abs(share(h100, "reduce") - 2.0) <= 2.0
    # TraceLens's "other" 15 % is SDPA (attention here), aten::cat and the embedding gather (copy/cast
    # here); its elementwise 54 % is the rest: elementwise, activation and the other copies.
    other = share(h100, "attention") + op_share(h100, "aten::cat", "aten::index_select")
    assert abs(other - 15.0) <= 2.0
    copies = share(h100, "copy/cast") - op_share(h100, "aten::cat", "aten::index_select")
    assert abs(share(h100, "elementwise") + share(h100, "activation") + copies - 54.0) <= 2.0


def test_h100_roofline_of_gemms(h100) -> None:
    gemm = [r for r in h100.ops if r.op == "aten::mm" and r.flops]
    assert gemm and all(r.bytes and r.achieved_tflops and r.pct_of_peak for r in gemm)
    assert h100.device and "H100" in h100.device


# --- CLI and bad inputs -------------------------------------------------------------------------------------

app = typer.Typer()
app.add_typer(trace_app, name="trace")
runner = CliRunner()


def run(*args: object):
    return runner.invoke(app, ["trace", "analyze", *map(str, args)])


def test_cli_json_finds_the_capture_folder() -> None:
    result = run(VLLM, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["header"]["capture"].endswith("capture_traces")
    assert (data["tokens"], data["totals"]["kernels"], data["totals"]["graph_launches"]) == (32, 425, 1)
    assert (data["totals"]["eager_launches"], round(data["totals"]["wall_us"], 3)) == (4, 10_743.182)
    assert data["tokens_source"].startswith("execute_")
    assert {"category", "gpu_us", "share", "per_token_us"} <= data["categories"][0].keys()
    assert {
        "category",
        "op",
        "layer",
        "calls",
        "gpu_us",
        "bytes",
        "flops",
        "achieved_tbps",
        "pct_of_peak",
    } <= (data["ops"][0].keys())
    assert data["graph_replays"]["attributed_share"] >= 95.0


def test_capture_folder_without_details_is_an_error(tmp_path) -> None:
    (tmp_path / "capture").mkdir()
    with pytest.raises(TraceError, match="capture folder without its execution_details.json"):
        load_captures(tmp_path / "capture")
    result = run(VLLM, "--capture", tmp_path / "capture")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "without its execution_details.json" in result.stderr


@pytest.mark.parametrize("damage", ["truncated", "not_a_trace"])
def test_bad_files_are_one_line_errors(tmp_path, damage) -> None:
    path = tmp_path / "t.json.gz"
    if damage == "truncated":
        data = VLLM.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        with gzip.open(path, "wt") as fh:
            json.dump({"schemaVersion": 1}, fh)
    result = run(path)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_capture_trace_file_missing_is_an_error(tmp_path) -> None:
    folder = tmp_path / "capture_traces"
    folder.mkdir()
    shutil.copy(VLLM.parent / "capture_traces" / "execution_details.json", folder)
    with pytest.raises(TraceError, match="no such file"):
        load_captures(folder)
