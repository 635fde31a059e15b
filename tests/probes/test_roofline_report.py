"""Roofline rows of `looptrace profile`: per-call floors of our op modules and calls per token."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from looptrace.probes.events import Trace, TraceEvent
from looptrace.probes.roofline import DEVICES
from looptrace.probes.roofline_report import Shapes, call_cost, calls_per_token, roofline_rows, token_total

# Ouro-1.4B decode at batch 1 with a 520-token context, bf16: hidden 2048, 16 heads (and KV heads) x 128.
OURO = Shapes(rows=1, context=520, act_bytes=2, kv_bytes=2, num_heads=16, num_kv_heads=16, head_dim=128,
              hidden=2048)  # fmt: skip


def test_decode_paged_attention_floor_matches_hand_computation():
    cost = call_cost("paged_attention", nn.Module(), OURO)
    assert cost is not None
    kv_row = 16 * 128  # K (or V) elements of one position
    read = 520 * 2 * kv_row * 2  # K and V of 520 positions, bf16
    io = 2 * 2048 * 2 + 2 * kv_row * 2  # q in and out; this row's new K and V written
    assert cost.bytes == read + io == 4_276_224
    assert cost.flops == 4 * 16 * 128 * 520  # QK^T and PV over 520 keys, 2 FLOPs per multiply-add
    # the measurement: 18.5 µs per launch on the H200, against a byte floor under 1 µs
    (row,) = roofline_rows([("paged_attention", "core", 18.5 * 96)], {("paged_attention", "core"): cost},
                           {("paged_attention", "core"): 96.0}, 1, DEVICES["h200"], "bf16")  # fmt: skip
    assert row.us_per_call == pytest.approx(18.5)
    assert row.floor_us_per_call == pytest.approx(4_276_224 / 4.8e6)  # 0.89 µs
    assert row.pct_of_peak == pytest.approx(100 * 4_276_224 / 4.8e6 / 18.5)
    assert row.bound == "memory"


def test_mlp_floor_is_its_weights_and_rows():
    class MLP(nn.Module):
        op_kind = "mlp"

        def __init__(self) -> None:
            super().__init__()
            self.gate_up = nn.Linear(2048, 2 * 5632, bias=False, dtype=torch.bfloat16)
            self.down = nn.Linear(5632, 2048, bias=False, dtype=torch.bfloat16)

    cost = call_cost("mlp", MLP(), OURO)
    assert cost is not None
    assert cost.bytes == 3 * 2048 * 5632 * 2 + 2 * 2048 * 2  # weights once; x in, out
    assert cost.flops == 2 * 3 * 2048 * 5632


def _ann(name: str, ts: float, dur: float) -> TraceEvent:
    return TraceEvent("user_annotation", name, ts, dur)


def test_calls_per_token_counts_eager_ranges_and_graph_replays():
    events = [
        _ann("lt.window/decode", 0, 100),
        _ann("lt.op/embed", 1, 1),  # eager prelude step in the window
        # graph bodies run after the window: the rows-1 body is the one replayed at 1 row per call
        _ann("lt.graph/recurrent/1", 200, 50),
        _ann("lt.layer/core0", 201, 10),
        _ann("lt.op/attention", 202, 2),
        _ann("lt.op/paged_attention", 203, 1),
        _ann("lt.layer/core1", 212, 10),
        _ann("lt.op/attention", 213, 2),
        _ann("lt.op/norm", 240, 1),  # outside the layers: role "-"
        _ann("lt.graph/recurrent/8", 300, 50),
        _ann("lt.layer/core0", 301, 10),
        _ann("lt.op/attention", 302, 2),
    ]
    window = {"tokens": 2, "graph": {"recurrent": {"replays": 8}, "coda": {"replays": 0}}}
    calls = calls_per_token(Trace(events=events), window, rows=1)
    assert calls == {
        ("embed", "-"): 0.5,
        ("attention", "core"): 8 * 2 / 2,
        ("paged_attention", "core"): 8 / 2,
        ("norm", "-"): 8 / 2,
    }
    # 8 rows per call: the rows-8 body
    assert calls_per_token(Trace(events=events), window, rows=8)[("attention", "core")] == 8 / 2


def test_graph_body_run_twice_at_one_size_is_counted_once():
    # On the H200 a graph's body ran eagerly twice at the same batch size; sorting (size, event) pairs
    # then compared two TraceEvents and the roofline block was lost (TypeError).
    events = [
        _ann("lt.window/decode", 0, 100),
        _ann("lt.graph/recurrent/1", 200, 50),
        _ann("lt.layer/core0", 201, 10),
        _ann("lt.op/attention", 202, 2),
        _ann("lt.graph/recurrent/1", 300, 50),
        _ann("lt.layer/core0", 301, 10),
        _ann("lt.op/attention", 302, 2),
    ]
    window = {"tokens": 4, "graph": {"recurrent": {"replays": 4}}}
    assert calls_per_token(Trace(events=events), window, rows=1) == {("attention", "core"): 4 * 1 / 4}


def test_gpu_row_copies_of_the_ranges_are_not_counted():
    # Kineto repeats user annotations on the GPU stream's row (cat gpu_user_annotation): on the H200 every
    # op of the whole-token body was counted twice (192 attention calls per token instead of 96).
    host = [
        _ann("lt.window/decode", 0, 100),
        _ann("lt.graph/whole_token/1", 200, 50),
        _ann("lt.layer/core0", 201, 10),
        _ann("lt.op/attention", 202, 2),
    ]
    gpu = [TraceEvent("gpu_user_annotation", e.name, e.ts + 1, e.dur, pid=0, tid=7) for e in host]
    window = {"tokens": 1, "graph": {"whole_token": {"replays": 1}}}
    assert calls_per_token(Trace(events=host + gpu), window, rows=1) == {("attention", "core"): 1.0}


def test_unattributed_graph_rows_get_their_floor_and_the_token_total():
    # exactloop-style decode: every replayed kernel is "graph"; the ops still ran (their body ranges count)
    attn = call_cost("paged_attention", nn.Module(), OURO)
    costs = {("paged_attention", "core"): attn}
    rows = roofline_rows([("graph", "-", 6000.0)], costs, {("paged_attention", "core"): 96.0}, 1,
                         DEVICES["h200"], "bf16")  # fmt: skip
    graph, paged = rows
    assert graph.op == "graph" and graph.bytes_per_call is None and graph.us_per_call is None
    assert paged.gpu_us_per_token is None and paged.us_per_call is None and paged.pct_of_peak is None
    assert paged.floor_us_per_call == pytest.approx(4_276_224 / 4.8e6) and paged.bound == "memory"
    total = token_total(rows, 6000.0, DEVICES["h200"])
    assert total["bytes_per_token"] == 96 * 4_276_224
    assert total["floor_us_per_token"] == pytest.approx(96 * 4_276_224 / 4.8e6)
    assert total["pct_of_peak"] == pytest.approx(100 * 96 * 4_276_224 / 4.8e6 / 6000.0)
