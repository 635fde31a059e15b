"""Windows, host positions, attribution, formulas and per-token division (synthetic + one real trace)."""

from __future__ import annotations

import pytest

from looptrace.probes.counters import (
    Counters,
    analyze,
    context_of,
    enclosing_chains,
    layer_name,
    loop_name,
    op_name,
    select_windows,
    stage_name,
    step_name,
    window_name,
)
from looptrace.probes.events import (
    TraceError,
    TraceEvent,
    load_chrome_trace,
    parse_chrome_trace,
    trace_from_profiler,
)
from tests.probes.conftest import PID, TID

# Window totals of conftest.build_decode_trace's decode window (2 steps, 1 token each):
#   per step 40 recurrent kernels (4 layer-loop cells × (6 norm + 2 rope + 1 attention + 1 mlp)),
#   6 graph kernels (coda replay 4 + head replay 2), 1 argmax; plus a side-thread kernel and an orphan.
DECODE_TOTALS = {
    "kernels": 96,
    "eager_launches": 83,  # 2 × 41 + side thread (cudaLaunchKernel, ExC and cuLaunchKernelEx_v11060 alike)
    "graph_launches": 4,
    "graph_kernels": 12,
    "htod": 0,
    "dtoh": 3,  # 2 pinned sampled tokens + 1 pageable synchronous cudaMemcpy
    "dtod": 0,
    "memcpy_other": 0,
    "htod_bytes": 0,
    "dtoh_bytes": 20,
    "dtod_bytes": 0,
    "pageable": 1,
    "pinned": 2,
    "memset": 1,
    "syncs": 5,
    "sync_stream": 2,  # runtime call + Stream Sync activity: once each
    "sync_device": 1,
    "sync_event": 1,
    "sync_memcpy": 1,
    "sync_unknown": 0,
    "stream_wait": 1,
    "scalar_reads": 2,
    "copy_kernels": 24,  # 2 norm casts + 1 rope cat per layer-loop cell
    "gpu_us": 301.5,
}


@pytest.fixture
def decode(decode_kt):
    return parse_chrome_trace(decode_kt.to_dict(), source="decode.json")


def window_dur(kt, name: str) -> float:
    return next(e["dur"] for e in kt.events if e["name"] == name)


def test_name_helpers_follow_the_convention() -> None:
    assert window_name("decode") == "lt.window/decode"
    assert step_name(3) == "lt.step#3"
    assert stage_name("recurrent") == "lt.stage/recurrent"
    assert loop_name(0) == "lt.loop/0"
    assert layer_name("core", 3) == "lt.layer/core3"
    assert op_name("kv_copy") == "lt.op/kv_copy"


def test_decode_window_totals(decode, decode_kt) -> None:
    a = analyze(decode, tokens=2)
    c = a.counters
    assert (c.mode, c.window, c.tokens, c.steps) == ("gpu", "lt.window/decode ×1", 2, 2)
    totals = c.totals()
    assert {k: totals[k] for k in DECODE_TOTALS} == DECODE_TOTALS
    assert totals["host_us"] == window_dur(decode_kt, "lt.window/decode")
    assert c.syncs_by_kind == {
        "stream": 2,
        "device": 1,
        "event": 1,
        "sync_memcpy": 1,
        "unknown": 0,
        "stream_wait": 1,
        "event_query": 0,
    }
    assert "submissions" not in totals


def test_per_token_and_per_step(decode) -> None:
    c = analyze(decode, tokens=2, submissions=10).counters
    per_token = c.per_token()
    assert (per_token["kernels"], per_token["dtoh"], per_token["dtoh_bytes"]) == (48.0, 1.5, 10.0)
    assert (per_token["syncs"], per_token["copy_kernels"], per_token["submissions"]) == (2.5, 12.0, 5.0)
    assert per_token["gpu_us"] == pytest.approx(150.75)
    assert c.per_step() == per_token  # one token per step
    c4 = analyze(decode, tokens=4).counters  # e.g. 2 requests per step
    assert c4.per_token()["kernels"] == 24.0
    assert c4.per_step()["kernels"] == 48.0
    assert Counters(tokens=1, steps=0, window="w", mode="gpu").per_step() is None


def test_attribution_innermost_ranges_win(decode) -> None:
    b = analyze(decode, tokens=2).breakdown
    by_op = {s.key: (s.kernels, s.gpu_us) for s in b.by_op}
    assert by_op == {
        ("norm",): (48, 96.0),
        ("rope",): (16, 24.0),  # nested inside lt.op/attention: rope wins
        ("attention",): (8, 40.0),  # the kernel after the rope range closed
        ("graph",): (8, 32.0),  # coda replay: no lt.op range around its cudaGraphLaunch
        ("mlp",): (8, 80.0),
        ("head",): (4, 16.0),  # replay launched inside lt.op/head: the finer range is used
        ("other",): (2, 2.0),  # side-thread kernel and orphan
        ("sample",): (2, 6.0),
    }
    assert [s.key[0] for s in b.by_op] == [
        "norm",
        "rope",
        "attention",
        "graph",
        "mlp",
        "head",
        "other",
        "sample",
    ]
    assert {s.key: s.kernels for s in b.by_stage} == {
        ("recurrent",): 80,
        ("coda",): 12,
        ("sample",): 2,
        ("-",): 2,
    }
    assert {s.key: s.kernels for s in b.by_op_role} == {
        ("norm", "core"): 48,
        ("rope", "core"): 16,
        ("attention", "core"): 8,
        ("mlp", "core"): 8,
        ("graph", "-"): 8,
        ("head", "-"): 4,
        ("other", "-"): 2,
        ("sample", "-"): 2,
    }


def test_formulas_are_computed_from_the_ranges(decode) -> None:
    assert analyze(decode, tokens=2).breakdown.formulas == [
        "norm: 3 kernels × 2 norm calls × 2 layers × 2 loops = 24 kernels/token (50 %)",
        "rope: 2 kernels × 1 rope call × 2 layers × 2 loops = 8 kernels/token (17 %)",
        "attention: 1 kernel × 1 attention call × 2 layers × 2 loops = 4 kernels/token (8 %)",
        "graph: 4 kernels/token (8 %), inside CUDA-graph replays, no lt.op range",
        "mlp: 1 kernel × 1 mlp call × 2 layers × 2 loops = 4 kernels/token (8 %)",
        "head: 2 kernels × 1 head call = 2 kernels/token (4 %)",
        "other: 1 kernel/token (2 %), no lt.op range",
        "sample: 1 kernel × 1 sample call = 1 kernel/token (2 %)",
    ]


def test_top_kernels(decode) -> None:
    a = analyze(decode, tokens=2, top=3)
    # the three norm kernels tie on count and time: ordered by name
    assert [(k.count, k.total_us) for k in a.top_by_count] == [(16, 32.0)] * 3
    kinds = ["reduce_kernel", "direct_copy_kernel", "rsqrt_kernel"]
    assert [kind in k.name for k, kind in zip(a.top_by_count, kinds, strict=True)] == [True] * 3
    first = a.top_by_time[0]
    assert (first.name[:14], first.count, first.total_us, first.avg_us) == ("sm90_xmma_gemm", 8, 80.0, 10.0)
    assert len(a.top_by_time) == 3


def test_notes_name_mode_tokens_and_warnings(decode) -> None:
    notes = analyze(decode, tokens=2).notes
    assert notes[0].startswith("mode gpu")
    assert "tokens: 2 (given)" in notes
    assert any(n.startswith("1 device events in the window have no runtime call") for n in notes)
    assert "WARNING: 1 pageable memcpy in the window (each stalls the host)" in notes


def test_prefill_and_whole_trace_windows(decode, decode_kt) -> None:
    pre = analyze(decode, window="prefill")
    c = pre.counters
    assert (c.window, c.steps, c.tokens, pre.tokens_source.startswith("step-marker")) == (
        "lt.window/prefill ×1", 1, 1, True
    )  # fmt: skip
    assert (c.kernels, c.eager_launches, c.htod, c.htod_bytes, c.pageable) == (5, 5, 1, 4096, 1)
    assert (c.syncs, c.sync_stream, c.scalar_reads, c.graph_launches) == (1, 1, 1, 0)
    assert c.host_us == window_dur(decode_kt, "lt.window/prefill")
    assert pre.breakdown.formulas == ["mlp: 5 kernels × 1 mlp call = 5 kernels/token (100 %)"]
    whole = analyze(decode, window="all").counters
    assert (whole.window, whole.kernels, whole.steps, whole.syncs) == ("whole trace", 103, 3, 6)


def test_auto_window_is_decode(decode) -> None:
    assert analyze(decode).counters.window == "lt.window/decode ×1"
    assert analyze(decode).counters.tokens == 2  # from the 2 lt.step# markers in the window


def test_missing_window(kt) -> None:
    kt.launch("k", kt.tick(), 1.0)
    trace = parse_chrome_trace(kt.to_dict(), source="x.json")
    assert select_windows(trace, "auto") == (None, "whole trace (no lt.window/decode range)")
    with pytest.raises(TraceError, match="x.json: no 'lt.window/prefill' range"):
        analyze(trace, window="prefill")
    with pytest.raises(ValueError, match="window must be one of"):
        select_windows(trace, "middle")


def test_several_window_instances_are_one_window(kt) -> None:
    for _ in range(3):
        with kt.range("lt.window/decode"):
            kt.launch("k", kt.tick(), 1.0)
        kt.launch("between_windows", kt.tick(), 1.0)
    c = analyze(parse_chrome_trace(kt.to_dict()), tokens=3).counters
    assert (c.window, c.kernels, c.host_us) == ("lt.window/decode ×3", 3, 3 * 5.0)  # end is exclusive


def test_external_trace_step_markers(kt) -> None:
    """A vLLM-like trace: no lt ranges; steps from ProfilerStep# by default or a given marker."""
    for step in range(3):
        with kt.range(f"ProfilerStep#{step}"), kt.range("execute_model"):
            kt.launch("gemm", kt.tick(), 1.0)
            kt.launch("gemm", kt.tick(), 1.0)
        with kt.range("execute_model"):  # outside any ProfilerStep
            kt.launch("gemm", kt.tick(), 1.0)
    trace = parse_chrome_trace(kt.to_dict())
    auto = analyze(trace)
    assert (auto.step_marker, auto.counters.steps, auto.counters.tokens) == ("ProfilerStep#", 3, 3)
    assert auto.counters.window == "whole trace (no lt.window/decode range)"
    assert auto.counters.per_token()["kernels"] == 3.0
    vllm = analyze(trace, step_marker="execute_model")
    assert (vllm.counters.steps, vllm.counters.tokens, vllm.counters.per_token()["kernels"]) == (6, 6, 1.5)
    given = analyze(trace, step_marker="execute_model", tokens=9)
    assert (given.counters.steps, given.counters.tokens, given.tokens_source) == (6, 9, "given")


def test_unknown_tokens_fall_back_to_totals(kt) -> None:
    kt.launch("k", kt.tick(), 1.0)
    a = analyze(parse_chrome_trace(kt.to_dict()))
    assert (a.counters.tokens, a.counters.steps, a.step_marker) == (1, 0, None)
    assert a.tokens_source.startswith("unknown")
    with pytest.raises(ValueError):
        analyze(parse_chrome_trace(kt.to_dict()), tokens=0)
    with pytest.raises(TraceError, match="no complete events"):
        analyze(parse_chrome_trace([]))


def test_uneven_calls_show_measured_average(kt) -> None:
    with kt.range("lt.window/decode"):
        with kt.range("lt.loop/0"):
            for layer, calls in ((0, 2), (1, 1)):  # a layer with an extra norm call: no even factoring
                with kt.range(f"lt.layer/core{layer}"):
                    for _ in range(calls):
                        with kt.range("lt.op/norm"):
                            kt.launch("a", kt.tick(), 1.0)
                            kt.launch("b", kt.tick(), 1.0)
        with kt.range("lt.op/norm"):  # a final norm outside loops and layers
            kt.launch("a", kt.tick(), 1.0)
            kt.launch("b", kt.tick(), 1.0)
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=1)
    assert a.breakdown.formulas == [
        "norm: 6 kernels in 3 norm calls (avg 2.00 kernels/call) + 2 kernels × 1 norm call "
        "= 8 kernels/token (100 %)"
    ]


def test_op_range_without_kernels_still_gets_a_formula(kt) -> None:
    with kt.range("lt.window/decode"):
        with kt.range("lt.op/state_init"):
            kt.cpu_op("aten::zeros", kt.tick(), 1.0)
        with kt.range("lt.op/norm"):
            kt.launch("k", kt.tick(), 1.0)
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=1)
    assert a.breakdown.formulas == [
        "norm: 1 kernel × 1 norm call = 1 kernel/token (100 %)",
        "state_init: 0 kernels × 1 state_init call = 0 kernels/token (0 %)",
    ]


def test_graph_kernels_land_on_the_replay_ranges_not_device_time(kt) -> None:
    with kt.range("lt.window/decode"), kt.range("lt.stage/recurrent"), kt.range("lt.loop/3"):
        corr = kt.graph_launch(
            kt.tick(), ["gemm", "softcap"], graph_id=0
        )  # graph id 0: linked by correlation
    for e in kt.events:
        if e["cat"] == "kernel":
            e["ts"] += 10_000.0  # device clock far past the window: the host call decides
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=1)
    assert (a.counters.kernels, a.counters.graph_kernels, a.counters.graph_launches) == (2, 2, 1)
    assert [(s.key, s.kernels) for s in a.breakdown.by_stage] == [(("recurrent",), 2)]
    assert [(s.key, s.kernels) for s in a.breakdown.by_op] == [(("graph",), 2)]
    assert corr > 0


def test_replay_kernels_take_ops_from_the_eager_graph_body(kt) -> None:
    """A replay's kernels, matched in device order to the eager run of the graph body, get its op and
    layer; stage and loop come from the replay's own launch ranges."""
    with kt.range("lt.window/decode"):
        for loop in (0, 1):
            with kt.range("lt.stage/recurrent"), kt.range(f"lt.loop/{loop}"):
                kt.graph_launch(kt.tick(), ["pow", "mean", "gemm", "gemm", "pow", "mean", "gemm"])
        with kt.range("lt.stage/recurrent"), kt.range("lt.loop/2"):
            kt.graph_launch(kt.tick(), ["other_graph_kernel"])  # no body matches: stays `graph`
    with kt.range("lt.graph/recurrent/1"):  # outside the window: maps, is not counted
        for layer in (0, 1):
            with kt.range(f"lt.layer/core{layer}"):
                with kt.range("lt.op/norm"):
                    kt.launch("pow", kt.tick())
                    kt.launch("mean", kt.tick())
                with kt.range("lt.op/mlp"):
                    kt.launch("gemm", kt.tick())
                if layer == 1:
                    break
            with kt.range("lt.op/mlp"):
                kt.launch("gemm", kt.tick())
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=1)
    assert a.counters.kernels == 15
    assert {s.key: s.kernels for s in a.breakdown.by_op} == {("norm",): 8, ("mlp",): 6, ("graph",): 1}
    assert {s.key: s.kernels for s in a.breakdown.by_op_role} == {
        ("norm", "core"): 8,
        ("mlp", "core"): 4,
        ("mlp", "-"): 2,
        ("graph", "-"): 1,
    }
    assert {s.key: s.kernels for s in a.breakdown.by_stage} == {("recurrent",): 15}
    assert a.breakdown.formulas[:2] == [
        "norm: 2 kernels × 1 norm call × 2 layers × 2 loops = 8 kernels/token (53 %)",
        "mlp: 1 kernel × 1 mlp call × 2 layers × 2 loops + 1 kernel × 1 mlp call × 2 loops"
        " = 6 kernels/token (40 %)",
    ]


def test_replay_with_an_extra_kernel_is_aligned_to_its_body(kt) -> None:
    """Under capture cuBLAS may add a kernel (a `memcpy_post` before a gemv on an H200): the common prefix
    and suffix still map, the extra kernel takes the op around it."""
    with kt.range("lt.window/decode"), kt.range("lt.stage/recurrent"), kt.range("lt.loop/0"):
        kt.graph_launch(kt.tick(), ["pow", "mean", "memcpy_post", "gemv", "sigmoid"])
    with kt.range("lt.graph/recurrent/1"):
        with kt.range("lt.op/norm"):
            kt.launch("pow", kt.tick())
            kt.launch("mean", kt.tick())
        with kt.range("lt.op/gate"):
            kt.launch("gemv", kt.tick())
            kt.launch("sigmoid", kt.tick())
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=1)
    assert {s.key: s.kernels for s in a.breakdown.by_op} == {("norm",): 2, ("gate",): 3}
    assert any("1 aligned" in n for n in a.notes)


def test_replay_prefetch_kernels_are_their_own_op_and_the_rest_still_matches(kt) -> None:
    """`kernels.l2_prefetch` adds a side-stream `_prefetch_kernel` before each GEMM of a captured graph,
    never in its eager body: 3 extra kernels in 5 would fail the body match (slack 8 covers them here,
    but a whole token has 384 per 990), so they are set apart and the rest matches exactly."""
    with kt.range("lt.window/decode"), kt.range("lt.stage/recurrent"), kt.range("lt.loop/0"):
        kt.graph_launch(kt.tick(), ["pow", "_prefetch_kernel", "gemv", "_prefetch_kernel", "gemv"] * 10)
    with kt.range("lt.graph/whole_token/1"):
        for _ in range(10):
            with kt.range("lt.op/norm"):
                kt.launch("pow", kt.tick())
            with kt.range("lt.op/mlp"):
                kt.launch("gemv", kt.tick())
                kt.launch("gemv", kt.tick())
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=1)
    by_op = {s.key: s.kernels for s in a.breakdown.by_op}
    assert by_op == {("norm",): 10, ("mlp",): 20, ("l2_prefetch",): 20}
    assert any("1 exact" in n for n in a.notes)


def test_event_query_is_a_poll_not_a_blocking_sync(kt) -> None:
    """CUPTI reports an `Event Sync` activity for cudaEventQuery (H200, CUDA 13); it never blocks."""
    with kt.range("lt.window/decode"):
        kt.sync("cudaEventQuery", kt.tick(), "Event Sync")
        kt.sync("cudaEventSynchronize", kt.tick(), "Event Sync")
    c = analyze(parse_chrome_trace(kt.to_dict()), tokens=1).counters
    assert (c.syncs, c.sync_event, c.event_query) == (1, 1, 1)


def test_sync_and_copy_sites_name_the_call_and_the_op(kt) -> None:
    with kt.range("lt.window/decode"), kt.range("lt.stage/coda"):
        with kt.range("lt.op/sample"):
            kt.memcpy(kt.tick(), "DtoH", "Device", "Pinned", 8)
            kt.sync("cudaStreamSynchronize", kt.tick(), "Stream Sync")
        kt.memcpy(kt.tick(), "HtoD", "Pageable", "Device", 64)
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=1)
    got = {(x.what, x.api, x.stage, x.op): x.count for x in a.sites}
    assert got == {
        ("memcpy DtoH", "cudaMemcpyAsync", "coda", "sample"): 1,
        ("sync stream", "cudaStreamSynchronize", "coda", "sample"): 1,
        ("memcpy HtoD pageable", "cudaMemcpyAsync", "coda", "-"): 1,
    }


def test_enclosing_chains_and_context() -> None:
    def rng(name: str, ts: float, dur: float) -> TraceEvent:
        return TraceEvent("user_annotation", name, ts, dur)

    ranges = [
        rng("lt.stage/recurrent", 0, 100),
        rng("lt.loop/1", 1, 50),
        rng("lt.layer/core12", 2, 40),
        rng("lt.op/attention", 3, 20),
        rng("lt.op/rope", 4, 5),
        rng("lt.loop/2", 51, 40),
    ]
    chains = enclosing_chains(ranges, [4.5, 10.0, 60.0, 100.0, -1.0])
    assert [[r.name for r in chain] for chain in chains] == [
        ["lt.stage/recurrent", "lt.loop/1", "lt.layer/core12", "lt.op/attention", "lt.op/rope"],
        ["lt.stage/recurrent", "lt.loop/1", "lt.layer/core12", "lt.op/attention"],
        ["lt.stage/recurrent", "lt.loop/2"],
        [],  # end is exclusive
        [],
    ]
    ctx = context_of(chains[0])
    assert (ctx.stage, ctx.loop, ctx.layer, ctx.role, ctx.op) == ("recurrent", 1, "core12", "core", "rope")
    assert context_of([]).op is None


def test_cpu_mode_counts_leaf_ops(kt) -> None:
    with kt.range("lt.window/decode"), kt.range("lt.step#0"), kt.range("lt.stage/coda"):
        with kt.range("lt.layer/coda0"), kt.range("lt.op/norm"):
            kt.cpu_op("aten::rms_norm", kt.now, 20.0)
            kt.cpu_op("aten::pow", kt.tick(), 2.0)
            kt.cpu_op("aten::mean", kt.tick(), 2.0)
            kt.cpu_op("aten::to", kt.now, 5.0)
            kt.cpu_op("aten::_to_copy", kt.tick(), 4.0)
            kt.cpu_op("aten::copy_", kt.tick(), 1.0)
            kt.tick(10.0)
        kt.cpu_op("aten::cat", kt.tick(), 1.0)
    a = analyze(parse_chrome_trace(kt.to_dict()))
    c = a.counters
    assert (c.mode, c.kernels, c.copy_kernels, c.tokens, c.gpu_us) == ("cpu", 4, 2, 1, 6.0)
    assert a.notes[0].startswith("mode cpu")
    assert {s.key: s.kernels for s in a.breakdown.by_op_role} == {("norm", "coda"): 3, ("other", "-"): 1}
    assert a.breakdown.formulas[0] == "norm: 3 kernels × 1 norm call × 1 coda layer = 3 kernels/token (75 %)"


# --- a real torch.profiler CPU session ------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_profile(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    x, w = torch.randn(16, 16), torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("lt.window/decode"):
            for step in range(2):
                with record_function(f"lt.step#{step}"):
                    with record_function("lt.op/norm"):
                        y = torch.mm(x, w).to(torch.float64)  # leaves: mm, copy_ (cast)
                    with record_function("lt.op/mlp"):
                        z = torch.mul(torch.add(y, y), y)  # leaves: add, mul
                    torch.cat([z, z])[0, 0].item()  # leaf: cat; item is a scalar read, not a kernel
        torch.mm(x, w)  # outside the window
    path = tmp_path_factory.mktemp("prof") / "trace.json"
    return trace_from_profiler(prof, path), path  # torch exports a session once: keep the file


def test_real_profiler_session_leaf_ops_are_counted_and_attributed(real_profile) -> None:
    trace, _ = real_profile
    a = analyze(trace)
    c = a.counters
    assert (c.mode, c.steps, c.tokens) == ("cpu", 2, 2)
    assert (c.kernels, c.copy_kernels, c.scalar_reads, c.syncs) == (10, 4, 2, 0)
    assert {s.key: s.kernels for s in a.breakdown.by_op} == {("norm",): 4, ("mlp",): 4, ("other",): 2}
    assert {(k.name, k.count) for k in a.top_by_count} == {
        ("aten::mm", 2), ("aten::copy_", 2), ("aten::add", 2), ("aten::mul", 2), ("aten::cat", 2)
    }  # fmt: skip
    assert a.breakdown.formulas[:2] == [
        "mlp: 2 kernels × 1 mlp call = 2 kernels/token (40 %)",
        "norm: 2 kernels × 1 norm call = 2 kernels/token (40 %)",
    ]
    assert analyze(trace, window="all").counters.kernels == 11


def test_real_profiler_chrome_export_loads(real_profile) -> None:
    live, path = real_profile
    assert live.source == str(path)
    loaded = load_chrome_trace(path)
    assert loaded.metadata.get("schemaVersion") == 1
    assert [e.name for e in loaded.events if e.cat == "user_annotation"] == [
        "lt.window/decode", "lt.step#0", "lt.op/norm", "lt.op/mlp", "lt.step#1", "lt.op/norm", "lt.op/mlp"
    ]  # fmt: skip
    assert analyze(loaded).counters.totals() == analyze(live).counters.totals()


def test_timeline_splits_wall_time_into_busy_graph_gaps_and_host_waits(kt) -> None:
    """Window of 100 µs: one replay of three kernels with 2 and 3 µs gaps between them, one eager kernel
    overlapping another (their union counts once), nothing else on the GPU."""
    window = kt.annotation("lt.window/decode", 0.0, 100.0)
    corr = kt.runtime("cudaGraphLaunch", 1.0)
    for ts, dur in ((10.0, 5.0), (17.0, 4.0), (24.0, 6.0)):  # gaps 2 + 3 inside the replay
        kt.kernel("k", ts, dur, corr, graph_id=1)
    for ts, dur in ((50.0, 10.0), (55.0, 10.0)):  # two streams overlap: union 15
        kt.kernel("e", ts, dur, kt.runtime("cudaLaunchKernel", 40.0))
    c = analyze(parse_chrome_trace(kt.to_dict()), tokens=2).counters
    assert window["dur"] == c.host_us == 100.0
    assert c.gpu_us == pytest.approx(35.0)  # durations summed
    assert c.gpu_busy_us == pytest.approx(30.0)  # 15 in the replay + 15 union of the eager pair
    assert c.graph_gap_us == pytest.approx(5.0)
    assert c.gpu_idle_us == pytest.approx(70.0)
    assert c.per_token()["gpu_idle_us"] == pytest.approx(35.0)


def test_pdl_overlap_inside_a_replay_is_charged_once(kt) -> None:
    """Under programmatic dependent launch a replay's next kernel starts early and waits inside itself
    (H200, `kernels.pdl`): its raw span covers the tail of the one before. Kernel time counts that tail
    once: the later kernel is charged from the earlier one's end, the busy time does not change, and the
    raw values stay in its args. Eager kernels of other streams are not touched."""
    kt.annotation("lt.window/decode", 0.0, 100.0)
    corr = kt.runtime("cudaGraphLaunch", 1.0)
    kt.kernel("a", 10.0, 10.0, corr, graph_id=1)
    kt.kernel("b", 14.0, 10.0, corr, graph_id=1)  # launched early: waits 6 µs, then runs 4
    kt.kernel("c", 22.0, 8.0, corr, graph_id=1)  # waits 2 µs
    trace = parse_chrome_trace(kt.to_dict())
    b = next(e for e in trace.events if e.name == "b")
    assert (b.ts, b.dur, b.args["raw_ts"], b.args["raw_dur"]) == (20.0, 4.0, 14.0, 10.0)
    c = analyze(trace, tokens=1).counters
    assert c.gpu_us == pytest.approx(20.0)  # 10 + 4 + 6, not 28
    assert c.gpu_busy_us == pytest.approx(20.0)


def test_pdl_overlap_is_charged_once_when_the_trace_links_replays_by_correlation_only(kt) -> None:
    """A trace whose graph kernels carry no `graph id` (0 or absent) links them to their replay only
    through the `cudaGraphLaunch` correlation (the H200 profiles of `fast` under PDL: their kernel time
    was 13.1 ms per token in a 4.4 ms token because the overlap went uncharged). Charged as with an id."""
    kt.annotation("lt.window/decode", 0.0, 100.0)
    corr = kt.runtime("cudaGraphLaunch", 1.0)
    kt.kernel("a", 10.0, 10.0, corr)
    kt.kernel("b", 14.0, 10.0, corr)  # launched early: waits 6 µs, then runs 4
    kt.kernel("c", 22.0, 8.0, corr)  # waits 2 µs
    eager = kt.launch("d", 40.0)  # an eager kernel is not a replay: left as it is
    trace = parse_chrome_trace(kt.to_dict())
    b = next(e for e in trace.events if e.name == "b")
    assert (b.ts, b.dur, b.args["raw_ts"], b.args["raw_dur"]) == (20.0, 4.0, 14.0, 10.0)
    d = next(e for e in trace.events if e.name == "d")
    assert "raw_ts" not in d.args and d.correlation == eager
    c = analyze(trace, tokens=1).counters
    assert c.gpu_us == pytest.approx(25.0)  # 10 + 4 + 6 + the eager 5, not 33


def test_timeline_is_absent_in_cpu_mode(kt) -> None:
    with kt.range("lt.window/decode"):
        kt.cpu_op("aten::add", kt.tick(), 2.0)
    c = analyze(parse_chrome_trace(kt.to_dict()), tokens=1).counters
    assert c.mode == "cpu" and c.kernels == 1
    assert not {"gpu_busy_us", "graph_gap_us", "gpu_idle_us"} & c.totals().keys()


# --- traces looptrace did not write ------------------------------------------------------------------------


def test_device_work_queued_before_profiling_is_left_out(kt) -> None:
    """Kernels with no launching call that ran before the first launched one were queued before the
    profiler started: dropped (and said so); an unlinked kernel after that still counts."""
    kt.kernel("stale", 0.0, 5.0, corr=None)
    kt.now = 10.0
    kt.launch("first", kt.tick(), 2.0)
    kt.kernel("orphan_later", 50.0, 1.0, corr=None)
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=1)
    assert (a.counters.kernels, a.counters.gpu_busy_us) == (2, 3.0)
    assert any(n.startswith("1 device events (0.01 ms) ran before the first launch") for n in a.notes)


def test_wall_is_the_gpu_timeline_without_lt_windows(kt) -> None:
    kt.cpu_op("aten::empty", kt.tick(), 1.0)
    kt.launch("a", kt.tick(), 2.0)  # host 3, device 13-15
    kt.launch("b", kt.tick(), 4.0)  # host 6, device 16-20
    kt.cpu_op("aten::empty", kt.tick(100.0), 1.0)
    c = analyze(parse_chrome_trace(kt.to_dict()), tokens=1).counters
    assert (c.host_us, c.wall_us, c.gpu_busy_us, c.gpu_idle_us) == (10.0, 7.0, 6.0, 1.0)  # host 0-10


def test_lt_window_wall_is_at_least_the_window(kt) -> None:
    window = kt.annotation("lt.window/decode", 0.0, 8.0)
    kt.kernel("late", 20.0, 4.0, kt.runtime("cudaLaunchKernel", 1.0))  # runs past the window's end
    c = analyze(parse_chrome_trace(kt.to_dict()), tokens=1).counters
    assert (c.host_us, c.wall_us, c.gpu_idle_us) == (window["dur"], 8.0, 4.0)  # window longer than span 4


def test_categories_and_ops_from_cpu_op_ancestry(kt) -> None:
    """No lt ranges: each kernel's category comes from the CPU ops open at its launch; a call's kernels
    make one op row; the layer comes from the module event around it."""
    layer = kt._add("python_function", "nn.Module: LlamaDecoderLayer_3", kt.tick(0.0), 100.0, PID, TID, {})
    linear = kt.cpu_op("aten::linear", kt.tick(0.0), 20.0)
    kt.cpu_op("aten::mm", kt.tick(0.0), 10.0)
    kt.launch("sm90_xmma_gemm", kt.tick(), 6.0)
    kt.launch("memset_like_prologue", kt.tick(), 2.0)
    kt.now = linear["ts"] + linear["dur"]
    kt.cpu_op("aten::silu", kt.tick(0.0), 5.0)
    kt.launch("vectorized_elementwise_kernel", kt.tick(), 2.0)
    kt.now = layer["ts"] + layer["dur"]
    kt.launch("unattributed", kt.tick(), 2.0)
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=2)
    assert [(r.category, r.kernels, r.gpu_us, r.share) for r in a.categories] == [
        ("GEMM", 2, 8.0, 66.66666666666667), ("activation", 1, 2.0, 100 / 6), ("other", 1, 2.0, 100 / 6)
    ]  # fmt: skip
    gemm = a.ops[0]
    assert (gemm.category, gemm.op, gemm.layer, gemm.calls, gemm.kernels) == ("GEMM", "aten::mm", 3, 1, 2)
    assert [s.key[0] for s in a.breakdown.by_op] == ["GEMM", "activation", "other"]
    assert a.categories[0].per_token_us == 4.0


def test_replay_with_extra_kernels_at_several_places_is_aligned(kt) -> None:
    """H200, exactloop's whole-token graph: a `memcpy_post` before each loop's gate gemv, so the replay
    (990 kernels) differs from its eager body (986) at 4 places; a common prefix + suffix cannot span
    that, an alignment does. Each extra kernel takes the op of the kernel after it."""
    body = [("norm", ["pow", "mean"]), ("gate", ["gemv", "sigmoid"])] * 3
    replay = ["pow", "mean", "memcpy_post", "gemv", "sigmoid"] * 3
    with kt.range("lt.window/decode"), kt.range("lt.stage/recurrent"), kt.range("lt.loop/0"):
        kt.graph_launch(kt.tick(), replay)
    with kt.range("lt.graph/whole_token/1"):
        for op, names in body:
            with kt.range(f"lt.op/{op}"):
                for name in names:
                    kt.launch(name, kt.tick())
    a = analyze(parse_chrome_trace(kt.to_dict()), tokens=1)
    assert {s.key: s.kernels for s in a.breakdown.by_op} == {("norm",): 6, ("gate",): 9}
    assert any("1 aligned" in n for n in a.notes)
