"""`looptrace diff` at real shape on CUDA (Huginn-0125 ran out of memory with every run's engine
still allocated). One engine alive at a time, the peak bounded by one engine, and a pool that cannot fit
named in one line. Skipped without CUDA."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from typer.testing import CliRunner

from looptrace.cli.main import app

pytestmark = pytest.mark.gpu
runner = CliRunner()
REAL = ["--device", "cuda", "-c", "4", "--prompt-len", "128", "--max-tokens", "16", "--no-progress"]
GIB = 1 << 30


@pytest.mark.parametrize("model, peak_gib", [("huginn-0125", 75), ("ouro-1.4b", 18)])
def test_base_vs_exactloop_one_engine_at_a_time(model: str, peak_gib: int, monkeypatch) -> None:
    # Two engines alive would pass the bound: Huginn 7 GiB weights each (and the master copy), pools 41 +
    # 22 GiB; Ouro-1.4B 2.8 GiB weights, 6 GiB pools.
    from looptrace.engine import llm_engine

    refs: list[weakref.ref] = []

    class Tracked(llm_engine.LLMEngine):
        def __init__(self, *args, **kwargs) -> None:
            assert all(r() is None for r in refs), "an earlier engine is still alive"
            super().__init__(*args, **kwargs)
            refs.append(weakref.ref(self))

    monkeypatch.setattr(llm_engine, "LLMEngine", Tracked)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    r = runner.invoke(app, ["diff", "base", "exactloop", "--model", model, *REAL, "-f", "json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    r01 = [t for t in data["toggles"] if t["graded_rung"] in ("R0", "R1")]
    assert r01 and all(t["verdict"] in ("holds", "untested") for t in r01)
    assert len(refs) >= 6 and all(x() is None for x in refs)
    assert torch.cuda.max_memory_allocated() < peak_gib * GIB


def test_a_pool_that_cannot_fit_is_one_line_exit_2() -> None:
    sets = ["--a-set", "kv.gpu_memory_utilization=0.05", "--b-set", "kv.gpu_memory_utilization=0.05"]
    r = runner.invoke(app, ["diff", "base", "exactloop", "--model", "huginn-0125", *REAL, *sets])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "kv.gpu_memory_utilization=0.05 leaves" in lines[0], r.stderr
    assert "Traceback" not in r.output
