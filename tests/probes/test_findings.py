"""Findings on traces whose truth is known: looptrace's engine on an H100 with the toggle that removes each
cost off and on (`fixtures/README.md`), the public Ouro CPU trace, and synthetic timelines.

Each finding kind must fire where its cost holds and stay silent where the toggle removed it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from looptrace.cli.main import app as looptrace_app
from looptrace.cli.trace_cmd import trace_app
from looptrace.probes.context import Context
from looptrace.probes.counters import Analysis, analyze
from looptrace.probes.events import TraceEvent, load_chrome_trace
from looptrace.probes.findings import (
    EXACT_NORM_KERNELS,
    Finding,
    find,
    gaps,
    loop_syncs,
    norm_calls,
    per_loop_ops,
    sync_drains,
)
from looptrace.probes.findings_kv import attention_calls
from looptrace.probes.window_items import DeviceItem, SyncItem

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "hf_looped"
OURO_LOOPS = 4  # ouro-tiny: 4 layers x 4 loops
# ouro-tiny's norms per token: 4 per layer (sandwich block) x 4 layers x 4 loops, plus 1 closing each loop
OURO_NORMS_PER_TOKEN = 4 * 4 * OURO_LOOPS + OURO_LOOPS


@pytest.fixture(scope="module")
def analyses() -> dict[str, Analysis]:
    names = ("eager", "sync-gate", "async-gate", "exactloop", "exactloop-unfused-norm")
    out = {name: _analyze(f"ouro-tiny_h100_{name}.json.gz") for name in names}
    out["huginn-exactloop"] = _analyze("huginn-tiny_h100_exactloop.json.gz")
    return out


def _analyze(name: str) -> Analysis:
    return analyze(load_chrome_trace(FIXTURES / name), window="decode")


def _kind(found: list[Finding], kind: str) -> Finding | None:
    return next((f for f in found if f.kind == kind), None)


# --- the analysis hook ----------------------------------------------------------------------------------


def test_device_items_are_the_windows_device_events(analyses) -> None:
    for a in analyses.values():
        c = a.counters
        copies = c.htod + c.dtoh + c.dtod + c.memcpy_other + c.memset
        assert len(a.device_items) == c.kernels + copies
        assert len(a.sync_items) == c.syncs


# --- host gaps → CUDA graphs ----------------------------------------------------------------------------


def test_host_gaps_fire_on_eager_launches_and_not_with_whole_token_graphs(analyses) -> None:
    eager = _kind(find(analyses["eager"]), "host_gaps")
    assert eager is not None
    c = analyses["eager"].counters
    assert c.graph_launches == 0 and c.eager_launches > 0
    idle_on_host = c.gpu_idle_us - min(c.graph_gap_us, c.gpu_idle_us)  # the timeline table's column
    assert eager.cost_us_per_token == pytest.approx(idle_on_host / c.tokens)
    assert 0 < eager.saving_us_per_token <= eager.cost_us_per_token
    assert "cuda_graphs.enabled" in eager.remedy and "upper bound" in eager.estimate
    # the toggle: whole-token graphs (exactloop) leave no eager kernel launch in the decode window
    assert analyses["exactloop"].counters.eager_launches == 0
    assert _kind(find(analyses["exactloop"]), "host_gaps") is None


def test_host_gaps_beside_per_loop_graphs_point_at_the_whole_token_graph(analyses) -> None:
    found = _kind(find(analyses["sync-gate"]), "host_gaps")
    assert found is not None
    assert "scheduler.whole_token" in found.remedy
    assert "measured on this trace's own replays" in found.estimate


# --- a sync per loop → asynchronous gate ----------------------------------------------------------------


def _readback_syncs(name: str) -> int:
    """cudaStreamSynchronize calls inside lt.op/readback ranges of the decode window, by plain JSON."""
    with gzip.open(FIXTURES / name, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    window = [e for e in events if e["name"] == "lt.window/decode"]
    ranges = [e for e in events if e["name"] == "lt.op/readback"]
    syncs = [e for e in events if e["name"] == "cudaStreamSynchronize"]

    def inside(t: float, r: dict) -> bool:
        return r["ts"] <= t < r["ts"] + r["dur"]

    in_window = [s for s in syncs if any(inside(s["ts"], w) for w in window)]
    return sum(1 for s in in_window if any(inside(s["ts"], r) for r in ranges))


def test_loop_sync_fires_with_a_blocking_gate_and_not_with_the_async_gate(analyses) -> None:
    a = analyses["sync-gate"]
    found = _kind(find(a), "loop_sync")
    assert found is not None
    tokens = a.counters.tokens
    syncs = _readback_syncs("ouro-tiny_h100_sync-gate.json.gz")
    assert syncs == tokens * OURO_LOOPS  # one gate readback per loop
    per_token = f"{syncs / tokens:,.2f} blocking syncs/token inside the loops"
    assert found.cost.startswith(f"{per_token}, 1.00 per loop over {OURO_LOOPS} loops")
    assert "recurrent / readback" in found.where
    assert "scheduler.async_gate" in found.remedy
    wall_us = a.counters.wall_us
    assert 0 < found.saving_us_per_token * tokens <= a.counters.gpu_idle_us <= wall_us
    # the toggle: with the async gate no blocking sync is left inside the loops
    assert _readback_syncs("ouro-tiny_h100_async-gate.json.gz") == 0
    assert _kind(find(analyses["async-gate"]), "loop_sync") is None


# --- an RMSNorm of many kernels → the fused exact norm --------------------------------------------------


def test_unfused_norm_fires_with_the_eager_norm_and_not_with_the_exact_norm(analyses) -> None:
    a = analyses["exactloop-unfused-norm"]
    found = _kind(find(a), "unfused_norm")
    assert found is not None
    calls, how = norm_calls(a.device_items)
    assert how.startswith("op ranges")
    assert len(calls) == OURO_NORMS_PER_TOKEN * a.counters.tokens
    assert {len(call) for call in calls} == {8}  # PyTorch's eager RMSNorm on CUDA
    calls_per_token = f"{OURO_NORMS_PER_TOKEN:.1f} calls/token"
    assert found.cost.startswith(f"RMSNorm runs as 8.0 kernels per call, {calls_per_token}")
    assert "4 layers" in found.where
    assert 0 < found.saving_us_per_token < found.cost_us_per_token
    assert "kernels.exact" in found.remedy
    # the toggle: the exact fused norm (at most EXACT_NORM_KERNELS kernels per call) is not flagged
    for name in ("exactloop", "huginn-exactloop"):
        calls, _ = norm_calls(analyses[name].device_items)
        assert calls and max(len(call) for call in calls) <= EXACT_NORM_KERNELS
        assert _kind(find(analyses[name]), "unfused_norm") is None


# --- small per-loop launches → fused into a neighbouring kernel -----------------------------------------


def test_fusable_launch_fires_on_per_loop_metadata_and_not_with_whole_token_steps(analyses) -> None:
    a = analyses["async-gate"]
    found = _kind(find(a), "fusable_launch")
    assert found is not None
    tokens = a.counters.tokens
    ops = {o.op: o for o in per_loop_ops(a.device_items, tokens)}
    # ouro-tiny per loop: metadata 7 kernels, eager 8-kernel norm, gate 3 (GEMV dot, reduce, copy), readback 1
    assert {op: (o.calls / tokens, len(o.kernels) / o.calls) for op, o in ops.items()} == {
        "metadata": (OURO_LOOPS, 7),
        "norm": (OURO_LOOPS, 8),
        "gate": (OURO_LOOPS, 3),
        "readback": (OURO_LOOPS, 1),
    }
    launches = OURO_LOOPS * (7 + 8 + 3 + 1)
    assert found.cost.startswith(f"{launches:.1f} short kernels/token launched once per loop")
    assert found.where.startswith("recurrent / metadata 4.0 calls/token × 7.0 kernels")
    cost = sum(o.launch_us for o in ops.values())
    assert found.cost_us_per_token == pytest.approx(cost / tokens)
    floor = min(i.event.dur for i in a.device_items)
    saving = sum(sum(o.gaps_us) + sum(min(k.event.dur, floor) for k in o.kernels) for o in ops.values())
    assert found.saving_us_per_token == pytest.approx(saving / tokens)
    assert 0 < found.saving_us_per_token < found.cost_us_per_token
    assert "scheduler.whole_token" in found.remedy
    # the toggle: whole-token steps (exactloop) build the metadata once per token; the per-loop norm and gate
    # left are graph nodes whose launches cost too little to reach the threshold
    exact = analyses["exactloop"]
    left = {o.op for o in per_loop_ops(exact.device_items, exact.counters.tokens)}
    assert left == {"norm", "gate"}
    assert _kind(find(exact), "fusable_launch") is None


def test_per_loop_ops_are_outside_the_layers_in_more_than_one_loop() -> None:
    def cx(loop: int | None, op: str, layer: str | None = None) -> Context:
        return Context(stage="recurrent", loop=loop, layer=layer, op=op)

    items = [_item(0, 1, context=cx(0, "gate")), _item(10, 1, context=cx(1, "gate"))]  # 2 loops: per loop
    items += [_item(20, 1, context=cx(0, "head")), _item(30, 1, context=cx(0, "head"))]  # one loop only
    items += [_item(40, 1, context=cx(0, "mlp", "core0")), _item(50, 1, context=cx(1, "mlp", "core0"))]
    items += [_item(60, 9, context=cx(0, "norm")), _item(80, 9, context=cx(1, "norm"))]  # not short
    found = per_loop_ops(items, tokens=1)
    assert [(o.op, o.calls, o.gaps_us) for o in found] == [("gate", 2, [0.0, 9.0])]


def test_findings_are_ranked_by_saving(analyses) -> None:
    found = find(analyses["eager"])
    assert {f.kind for f in found} == {"host_gaps", "loop_sync", "unfused_norm", "fusable_launch"}
    savings = [f.saving_us_per_token for f in found]
    assert savings == sorted(savings, reverse=True)
    assert find(analyses["exactloop"]) == []


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared traces not present at {SHARED}")
def test_eager_rmsnorm_pattern_in_a_trace_without_ranges() -> None:
    """The public Ouro CPU trace: 4 forwards x (2 layers x 4 loops x 4 norms + 4 loop norms), no lt ranges."""
    a = analyze(load_chrome_trace(SHARED / "ouro-tiny_cpu_public_decode.json.gz"), window="all")  # 4 forwards
    calls, how = norm_calls(a.device_items)
    assert how.startswith("PyTorch's eager RMSNorm")
    assert len(calls) == 4 * (2 * 4 * 4 + 4)
    found = _kind(find(a), "unfused_norm")
    assert found is not None and "CPU op time" in found.cost


# --- attention over dead KV slots → exact-length attention ---------------------------------------------

OURO_ATTENTION_PER_TOKEN = 4 * OURO_LOOPS  # ouro-tiny: one attention per layer and loop


@pytest.fixture(scope="module")
def kv_traces(tmp_path_factory) -> dict[int, Analysis]:
    """ouro-tiny on CPU, torch attention path, prompts of 2 tokens, shapes recorded: KV pages of 16 slots
    (the row's last page is read whole) against pages of one slot (exactly the live keys)."""
    out = {}
    for block_size in (16, 1):
        path = tmp_path_factory.mktemp("kv") / f"bs{block_size}.json"
        args = ["profile", "--model", "ouro-tiny", "--prompt-len", "2", "--decode-steps", "12", "--shapes"]
        args += ["--set", f"kv.block_size={block_size}", "--trace", str(path), "--device", "cpu"]
        result = CliRunner().invoke(looptrace_app, args)
        assert result.exit_code == 0, result.output
        out[block_size] = analyze(load_chrome_trace(path), window="decode")
    return out


def test_dead_kv_fires_on_whole_pages_and_not_on_exact_length_keys(kv_traces) -> None:
    exact = kv_traces[1]
    calls = attention_calls(exact.device_items, exact.live_keys)
    tokens = exact.counters.tokens
    assert len(calls) == OURO_ATTENTION_PER_TOKEN * tokens
    # one-slot pages: the recorded key length is each row's live context (prompt + tokens so far)
    assert all(c.rows == 1 and c.keys_read == c.live for c in calls)
    assert {c.live for c in calls} == {5, 6}
    assert _kind(find(exact), "dead_kv") is None
    paged = kv_traces[16]
    calls = attention_calls(paged.device_items, paged.live_keys)
    assert len(calls) == OURO_ATTENTION_PER_TOKEN * paged.counters.tokens
    assert {(c.keys_read, c.live) for c in calls} == {(16, 5), (16, 6)}  # the row's one page, read whole
    found = _kind(find(paged), "dead_kv")
    assert found is not None
    assert found.cost.startswith("decode attention reads 16.0 keys per call where 5.5 are live (66 % dead)")
    dead_us = sum(c.us * (16 - c.live) / 16 for c in calls)
    assert found.saving_us_per_token == pytest.approx(dead_us / paged.counters.tokens)
    assert "kernels.attention=triton" in found.remedy


def test_dead_kv_is_silent_without_live_key_markers() -> None:
    """The public Huginn code's dynamic cache: shapes but no lt.kv markers (and key length = context)."""
    a = analyze(load_chrome_trace(FIXTURES / "huginn-tiny_cpu_public_decode.json.gz"), window="all")
    assert a.live_keys == [] and attention_calls(a.device_items, a.live_keys) == []
    assert _kind(find(a), "dead_kv") is None


# --- the timeline ---------------------------------------------------------------------------------------


def _item(ts: float, dur: float, eager: bool = True, context: Context | None = None) -> DeviceItem:
    event = TraceEvent(cat="kernel", name="k", ts=ts, dur=dur, pid=0, tid=7)
    return DeviceItem(event, context or Context(), eager)


def test_gaps_are_idle_time_between_busy_intervals() -> None:
    items = [_item(0, 10), _item(5, 10), _item(20, 5), _item(40, 2), _item(41, 1)]  # overlaps count once
    found = gaps(list(reversed(items)))
    assert [(g.start, g.end) for g in found] == [(15, 20), (25, 40)]
    assert sum(g.us for g in found) == 20


# --- rendering ------------------------------------------------------------------------------------------


def test_trace_analyze_shows_findings_in_text_and_json() -> None:
    app = typer.Typer()
    app.add_typer(trace_app, name="trace")
    runner = CliRunner()
    path = FIXTURES / "ouro-tiny_h100_sync-gate.json.gz"
    text = runner.invoke(app, ["trace", "analyze", str(path), "--window", "decode"])
    assert text.exit_code == 0, text.output
    assert "Findings (largest estimated saving first)" in text.stdout
    assert "1. loop_sync: 4.00 blocking syncs/token" in text.stdout
    as_json = runner.invoke(app, ["trace", "analyze", str(path), "--window", "decode", "--format", "json"])
    assert as_json.exit_code == 0, as_json.output
    found = json.loads(as_json.stdout)["findings"]
    assert [f["kind"] for f in found] == ["loop_sync", "fusable_launch", "host_gaps", "unfused_norm"]
    assert set(found[0]) >= {"cost", "where", "evidence", "remedy", "saving_us_per_token", "estimate"}
    as_csv = runner.invoke(app, ["trace", "analyze", str(path), "--window", "decode", "--format", "csv"])
    assert as_csv.exit_code == 0, as_csv.output
    assert "finding,loop_sync,saving_us_per_token," in as_csv.stdout
    quiet = runner.invoke(app, ["trace", "analyze", str(FIXTURES / "ouro-tiny_h100_exactloop.json.gz")])
    assert quiet.exit_code == 0 and "none: no cost in this window" in quiet.stdout


def test_a_sync_drains_the_gap_that_holds_its_end_once() -> None:
    idle = gaps([_item(0, 10), _item(30, 10), _item(40, 5), _item(60, 5)])  # gaps 10-30 and 45-60
    sync = TraceEvent(cat="cuda_runtime", name="cudaStreamSynchronize", ts=2, dur=10)  # returns at 12
    busy = TraceEvent(cat="cuda_runtime", name="cudaStreamSynchronize", ts=33, dur=2)  # returns while busy
    again = TraceEvent(cat="cuda_runtime", name="cudaStreamSynchronize", ts=20, dur=5)  # the same gap
    items = [SyncItem("stream", e, Context()) for e in (sync, busy, again)]
    assert sync_drains(items, idle) == [20.0, 0.0, 0.0]


def test_norm_calls_from_op_contexts_keep_their_loops() -> None:
    """Traces without op ranges whose kernels carry a norm op and loops (foreign traces with structure)."""
    norm = [Context(stage="recurrent", loop=i // 2, layer="core0", op="RMSNorm") for i in range(4)]
    items = [_item(0, 1, context=norm[0]), _item(2, 1), _item(4, 1, context=norm[1])]
    items += [_item(6, 1, context=norm[2]), _item(8, 1, context=norm[3])]
    calls, how = norm_calls(items)
    assert how == "runs of kernels of the norm op"
    assert [len(call) for call in calls] == [1, 1, 2]  # a run ends at another op, layer or loop
    assert {call[0].context.loop for call in calls} == {0, 1}


def test_a_sync_without_ranges_between_two_loop_kernels_is_in_the_loops() -> None:
    """Foreign traces: loops come from the kernels, syncs have no range; one between loop kernels counts."""
    loop0 = Context(stage="recurrent", loop=0, op="GEMM")
    loop1 = Context(stage="recurrent", loop=1, op="GEMM")
    items = [_item(0, 5, context=loop0), _item(20, 5, context=loop1), _item(40, 5), _item(60, 5)]
    between = TraceEvent(cat="cuda_runtime", name="cudaStreamSynchronize", ts=3, dur=6)  # ends at 9
    outside = TraceEvent(cat="cuda_runtime", name="cudaStreamSynchronize", ts=45, dur=5)  # ends at 50
    found = loop_syncs([SyncItem("stream", e, Context()) for e in (between, outside)], items)
    assert [s.event for s in found] == [between]
    assert found[0].context == loop0
