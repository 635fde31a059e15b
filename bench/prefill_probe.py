"""Where a burst's time goes, step by step (issue #8 diagnosis; not a benchmark: no pairing, no spread).

    python bench/prefill_probe.py [PROMPT] [CONCURRENCY] [RECIPE[+section.key=value...] ...]

For each recipe: one engine (Ouro-1.4B with random weights on CUDA, the trained ouro-tiny on CPU), three
rounds of CONCURRENCY fresh random prompts of PROMPT tokens and 32 output tokens each. Per round it prints
the stage of every engine step with its wall time (the GPU synchronized after each step), when the first
token came, and the median decode step of the round's second half (all rows decoding); in the last round
it profiles one eager prefill step with cProfile. Example (the H200 runs in bench/results):

    python bench/prefill_probe.py 512 8 exactloop exactloop+kernels.exact=false base
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import numpy as np
import torch

from looptrace.engine.llm_engine import LLMEngine
from looptrace.engine.request import SamplingParams, Stage
from looptrace.recipes import load_recipe

CUDA = torch.cuda.is_available()
OUTPUT_TOKENS = 32
DECODE_LABELS = ("token", "recurrent")


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def build(arm: str, concurrency: int) -> LLMEngine:
    """`arm` = RECIPE[+section.key=value...]; the KV pool is pinned so that engines built one after
    another in one process each get one (the first would otherwise size its pool to the free memory)."""
    recipe, *sets = arm.split("+")
    fixed = [f"scheduler.max_num_seqs={concurrency}", "cuda_graphs.max_graphs=64", "kv.num_blocks=4096"]
    cfg = load_recipe(recipe, fixed + sets).config
    return LLMEngine.from_preset("ouro-1.4b" if CUDA else "ouro-tiny", cfg, device="cuda" if CUDA else "cpu")


def run_round(engine: LLMEngine, prompts: list[list[int]], profile_prefill: bool):
    """Steps until every request finishes: [(ms, tokens emitted, stage label)], and the profile (if any)."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True))
    steps, profile = [], None
    seen = dict(engine.stats.steps_by_stage)
    while engine.has_unfinished_requests():
        profiling = (
            profile_prefill
            and profile is None
            and any(r.stage == Stage.PREFILL for r in engine.requests.values())
        )
        if profiling:
            profile = cProfile.Profile()
            profile.enable()
        sync()
        t0 = time.perf_counter()
        outputs = engine.step()
        sync()
        elapsed = (time.perf_counter() - t0) * 1e3
        if profiling:
            profile.disable()
        label = next((k for k, v in engine.stats.steps_by_stage.items() if v != seen.get(k, 0)), "?")
        seen = dict(engine.stats.steps_by_stage)
        steps.append((elapsed, len(outputs), label))
    return steps, profile


def describe(arm: str, rnd: int, steps) -> str:
    first = next(i for i, (_, emitted, _) in enumerate(steps) if emitted)
    decode = [ms for ms, _, label in steps if label in DECODE_LABELS]
    median = f"{float(np.median(decode[len(decode) // 2 :])):.2f} ms" if decode else "-"
    counts: dict[str, int] = {}
    for _, _, label in steps:
        counts[label] = counts.get(label, 0) + 1
    head = " ".join(f"{label[:4]}:{ms:.1f}" for ms, _, label in steps[: first + 4])
    return (
        f"{arm} round {rnd}: {len(steps)} steps {counts}; total {sum(s[0] for s in steps):.0f} ms; first "
        f"token after step {first + 1} at {sum(s[0] for s in steps[: first + 1]):.0f} ms; median decode "
        f"step (second half) {median}; steps ms: {head} ..."
    )


def main(argv: list[str]) -> None:
    prompt_len = int(argv[0]) if argv else 512
    concurrency = int(argv[1]) if len(argv) > 1 else 1
    arms = argv[2:] or ["base", "exactloop"]
    rng = np.random.default_rng(0)
    vocab = 40000 if CUDA else 200
    for arm in arms:
        engine = build(arm, concurrency)
        for rnd in range(3):
            prompts = [rng.integers(100, vocab, prompt_len).tolist() for _ in range(concurrency)]
            steps, profile = run_round(engine, prompts, profile_prefill=rnd == 2)
            print(describe(arm, rnd, steps))
        if profile is not None:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
            print(f"--- {arm}: cProfile of one prefill step (tottime) ---")
            print("\n".join(text.getvalue().splitlines()[:45]))
        del engine
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
