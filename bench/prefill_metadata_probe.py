"""Host time of one whole-burst prefill step's metadata (`ModelRunner._raw`), on any device.

    python bench/prefill_metadata_probe.py [PRESET RECIPE REQUESTS PROMPT [section.key=value ...]] ...

With `looptrace bench --prefill-batch whole` (the paper's harness) one prefill step holds every prompt of
the burst: REQUESTS x PROMPT rows, each needing its block table in every depth plane (Huginn: 32). The
metadata is built on the host before the step's first kernel, so its time adds to every request's TTFT.
This builds an engine on the CPU (tiny preset; `exit.max_loops` sets the plane count of a real model),
admits the burst and times `_raw` for the step's rows (median of 3). No model compute runs.

Example (bench/results/prefill_metadata_cpu.txt):
    python bench/prefill_metadata_probe.py huginn-tiny base 32 512 exit.max_loops=32
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from looptrace.engine.llm_engine import LLMEngine
from looptrace.engine.request import SamplingParams, Stage
from looptrace.engine.runner import Row
from looptrace.recipes import load_recipe


def probe(preset: str, recipe: str, requests: int, prompt: int, sets: list[str]) -> str:
    cfg = load_recipe(
        recipe,
        [
            f"scheduler.max_num_seqs={requests}",
            f"scheduler.max_num_batched_tokens={requests * prompt}",
            f"scheduler.prefill_chunk_size={prompt}",
            "kv.num_blocks=60000",
            *sets,
        ],
    ).config
    engine = LLMEngine.from_preset(preset, cfg, device="cpu")
    rng = np.random.default_rng(0)
    for _ in range(requests):
        engine.add_request(
            rng.integers(1, 200, prompt).tolist(), SamplingParams(max_tokens=4, ignore_eos=True)
        )
    engine.scheduler.admit()
    batch = engine.scheduler.take(Stage.PREFILL)
    runner = engine.runner
    rows = [
        Row(s.request, p, s.request.prompt[p])
        for s in batch.spans
        for p in range(s.start, s.start + s.length)
    ]
    boundary = runner.layout.plane("prelude", 0)
    planes = sorted({boundary, *(runner.layout.plane("core", t) for t in range(runner.max_loops))})
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        raw = runner._raw(rows, [[p] * len(rows) for p in planes], runner._width(rows))
        times.append(time.perf_counter() - t0)
    extra = " ".join(sets)
    return (
        f"{preset} {recipe} {extra}: {requests} x {prompt} = {len(rows)} rows, {len(planes)} planes, "
        f"metadata {raw.nbytes / 1e6:.0f} MB, _raw {statistics.median(times) * 1e3:.0f} ms (median of 3)"
    )


def main(argv: list[str]) -> int:
    if not argv:
        argv = ["huginn-tiny", "base", "32", "512", "exit.max_loops=32"]
    groups, current = [], []
    for arg in argv:  # a new group starts at each preset name
        if current and "=" not in arg and not arg.isdigit() and len(current) >= 4:
            groups.append(current)
            current = []
        current.append(arg)
    groups.append(current)
    for preset, recipe, requests, prompt, *sets in groups:
        print(probe(preset, recipe, int(requests), int(prompt), sets), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
