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
