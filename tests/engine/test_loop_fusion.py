"""Loop fusion (ExactLoop, R1): a fixed-depth decode row runs all its loops in one submission, and prefill
share admits up to L prefill batches after an L-loop fused step."""

from __future__ import annotations

import pytest

from looptrace.engine import EngineConfig, EngineInputError, LLMEngine, Observer, SamplingParams
from looptrace.engine.config import ConfigError
from tests.helpers import Recorder, build_engine

PROMPTS = [[5 + i, 9, 13 + 2 * i, 7, 21, 3 + i] for i in range(4)]


def engine(preset: str, fusion: bool, share: bool = False, **sched) -> LLMEngine:
    settings = {f"scheduler__{k}": v for k, v in sched.items()}
    return build_engine(
        preset, noise="sequential", scheduler__loop_fusion=fusion, scheduler__prefill_share=share, **settings
    )


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"])
def test_fusion_is_identical_at_batch_1_and_takes_three_steps_per_token(preset):
    params = SamplingParams(max_tokens=12)
    runs = {}
    for fusion in (False, True):
        e = engine(preset, fusion)
        tokens = [e.generate([p], params)[0] for p in PROMPTS[:2]]  # one request at a time
        runs[fusion] = (tokens, e.stats.steps / e.stats.output_tokens)
    assert runs[True][0] == runs[False][0]
    depth = e.max_loops
    # prefill + (prelude, fused recurrent, coda) per later token: (1 + 1 + 3 * 11) / 12 steps per token
    assert runs[True][1] == pytest.approx((2 + 3 * 11) / 12)
    assert runs[False][1] == pytest.approx((2 + (depth + 2) * 11) / 12)


@pytest.mark.parametrize("wants_hidden", [False, True])
def test_fused_step_reports_loops_to_observers(wants_hidden):
    # An observer of hidden states sees every loop (the loops then run one by one); a range observer
    # (the profiler's) sees the fused loops as one range (-1), so profiling keeps the fused graph.
    e = engine("huginn-tiny", True)
    log = Recorder()
    e.attach(log)
    loops = []
    members = {"on_loop_begin": lambda self, st, t: loops.append((st, t)), "wants_hidden": wants_hidden}
    e.attach(type("Loops", (Observer,), members)())
    e.generate([PROMPTS[0]], SamplingParams(max_tokens=3))
    assert log.stages == ["prefill", "coda"] + ["prelude", "recurrent", "coda"] * 2
    recurrent = [t for st, t in loops if st == "recurrent"]
    assert recurrent == (list(range(e.max_loops)) if wants_hidden else [-1]) * 2


def test_prefill_share_admits_up_to_l_prefill_batches_after_a_fused_step():
    # A decode row keeps running while later requests arrive one chunk-batch at a time.
    for share, allowance in ((False, 1), (True, 4)):
        e = engine("ouro-tiny", True, share, max_num_batched_tokens=4, prefill_chunk_size=4)
        log = Recorder()
        e.attach(log)
        e.add_request(PROMPTS[0], SamplingParams(max_tokens=40))
        while "coda" not in log.stages:
            e.step()
        e.add_request(list(range(3, 40)), SamplingParams(max_tokens=2))  # 37 tokens: 10 prefill batches
        for _ in range(30):
            e.step()
        runs, current = [], 0
        seen_recurrent = False
        for st in log.stages:
            if st == "recurrent":
                if seen_recurrent and current:
                    runs.append(current)
                seen_recurrent, current = True, 0
            elif st == "prefill" and seen_recurrent:
                current += 1
        assert runs and max(runs) == allowance, (share, runs)


def test_fusion_with_an_early_exit_gate_is_rejected():
    from looptrace.engine.config import ExitConfig, SchedulerConfig

    with pytest.raises(ConfigError, match="loop_fusion"):
        EngineConfig(scheduler=SchedulerConfig(loop_fusion=True), exit=ExitConfig(threshold=0.5))
    cfg = EngineConfig()
    cfg.scheduler.loop_fusion, cfg.exit.threshold = True, 0.5  # mutated after construction
    with pytest.raises(EngineInputError, match="loop_fusion"):
        LLMEngine.from_preset("ouro-tiny", cfg, device="cpu")
