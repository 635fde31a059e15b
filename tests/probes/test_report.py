"""Report tables of `looptrace.probes.report` that the CLI tests do not reach with a GPU trace."""

from __future__ import annotations

import io

from rich.console import Console

from looptrace.probes.counters import Counters
from looptrace.probes.report import timeline_table


def _text(table) -> str:
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_timeline_table_splits_wall_time_per_token() -> None:
    gpu = Counters(tokens=4, steps=4, window="w", mode="gpu", host_us=8000.0)
    gpu.gpu_busy_us, gpu.graph_gap_us, gpu.gpu_idle_us = 6000.0, 1200.0, 2000.0
    cpu = Counters(tokens=4, steps=4, window="w", mode="cpu", host_us=8000.0)
    text = _text(timeline_table([("exactloop", gpu), ("cpu run", cpu)], title="Decode"))
    row = next(line for line in text.splitlines() if "exactloop" in line)
    # wall 2 ms/tok = busy 1.5 (75 %) + idle inside replays 0.3 (15 %) + waiting on the host 0.2 (10 %)
    assert row.replace("│", " ").split()[1:] == [
        "2.000",
        "1.500",
        "(75%)",
        "0.300",
        "(15%)",
        "0.200",
        "(10%)",
    ]
    assert "cpu run" not in text  # CPU traces have no GPU timeline
    assert timeline_table([("cpu run", cpu)]) is None


def _cpu_engine_trace(kt):
    """A CPU trace (leaf CPU ops, no kernels) of two SGLang decode steps of 2 rows each."""
    from looptrace.probes.counters import analyze
    from looptrace.probes.events import parse_chrome_trace

    for _ in range(2):
        with kt.range("step[DECODE bs=2]"):
            kt.cpu_op("aten::mm", kt.tick(20.0), 15.0)
            kt.cpu_op("aten::add", kt.tick(10.0), 5.0)
    return analyze(parse_chrome_trace(kt.to_dict(), "cpu.json"))


def test_cpu_trace_labels_cpu_op_time(kt) -> None:
    """CPU op time is not GPU time: tables say `CPU op`, the JSON says what was measured and gives each
    `gpu_us` a `cpu_op_us` twin (the old key stays for one release)."""
    from looptrace.probes.report import category_table, phase_table, to_dict

    a = _cpu_engine_trace(kt)
    assert a.counters.mode == "cpu" and a.counters.tokens == 4
    text = _text(phase_table(a)) + _text(category_table(a))
    assert "GPU" not in text and "CPU op ms" in text and "CPU op µs" in text
    d = to_dict(a, {})
    assert d["time_measured"].startswith("CPU op time")
    assert d["totals"]["cpu_op_us"] == d["totals"]["gpu_us"] == 40.0
    assert all(r["cpu_op_us"] == r["gpu_us"] for r in d["categories"] + d["ops"] + d["phases"])
    assert d["breakdown"]["by_op"][0]["cpu_op_us"] > 0
