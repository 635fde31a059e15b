"""CUDA-graph behaviour on a GPU: capture/replay/fallback counters and graph replay == eager, bit for bit."""

from __future__ import annotations

import pytest
import torch

from looptrace.engine import LLMEngine, SamplingParams
from tests.helpers import build_engine

pytestmark = pytest.mark.gpu


# A fixed KV pool. Sized from free memory, the pool of an engine built while other test processes hold
# the GPU (pytest -n 4) is the one-page minimum: requests then run one at a time, a two-request batch
# never decodes two rows, and a test that counts graphs per row count sees one capture instead of three.
POOL_BLOCKS = 4096


def _engine(preset: str, graphs: bool, **settings) -> LLMEngine:
    return build_engine(
        preset,
        device="cuda",
        seed=1,
        noise="sequential",
        cuda_graphs__enabled=graphs,
        scheduler__max_model_len=256,
        kv__num_blocks=POOL_BLOCKS,
        **settings,
    )


def test_huginn_one_request_five_positions_three_depths_counts():
    """Base-engine check: 5 fed-back positions x 3 loops = 15 recurrent steps -> 1 capture, 15 replays."""
    eng = _engine("huginn-tiny", True, exit__max_loops=3)
    eng.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(max_tokens=6, seed=7))
    rec = eng.graph_counters()["recurrent"]
    assert (rec["captures"], rec["replays"], rec["fallbacks"]) == (1, 15, 0)


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"])
def test_graph_replay_equals_eager_bitwise(preset):
    prompts = [[3 + i + j for j in range(5 + 3 * i)] for i in range(5)]
    outs = []
    for graphs in (True, False):
        eng = _engine(preset, graphs)
        outs.append(eng.generate(prompts, SamplingParams(max_tokens=8, seed=11)))
    assert outs[0] == outs[1]


def test_budget_full_falls_back_with_reason():
    eng = build_engine(
        "ouro-tiny",
        device="cuda",
        seed=1,
        noise="sequential",
        cuda_graphs__max_graphs=1,
        cuda_graphs__coda=False,
        scheduler__max_model_len=128,
        kv__num_blocks=POOL_BLOCKS,
    )
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    while eng.has_unfinished_requests():
        eng.step()
    [eng.add_request([4, 5, 6 + i], SamplingParams(max_tokens=3)) for i in range(2)]
    while eng.has_unfinished_requests():
        eng.step()
    rec = eng.graph_counters()["recurrent"]
    assert rec["captures"] == 1 and rec["fallbacks"] > 0
    assert set(rec["fallback_reasons"]) == {"budget_full"}
    torch.cuda.synchronize()


def test_lru_eviction_captures_evicts_and_recaptures_with_counters():
    """max_graphs=1 + LRU: a new row count evicts the old graph; returning to it captures it again."""
    eng = build_engine(
        "ouro-tiny",
        device="cuda",
        seed=1,
        noise="sequential",
        cuda_graphs__max_graphs=1,
        cuda_graphs__eviction="lru",
        cuda_graphs__coda=False,
        scheduler__max_model_len=128,
        kv__num_blocks=POOL_BLOCKS,
    )
    for batch in ([[1, 2, 3]], [[4, 5, 6], [7, 8, 9]], [[1, 2, 4]]):
        eng.generate(batch, SamplingParams(max_tokens=3))
    rec = eng.graph_counters()["recurrent"]
    assert rec["fallbacks"] == 0 and rec["captures"] == 3 and rec["evictions"] == 2


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_fused_loop_graph_equals_eager_and_replays_once_per_token(preset):
    outs, counters = [], []
    for graphs in (True, False):
        eng = _engine(preset, graphs, scheduler__loop_fusion=True, scheduler__prefill_share=True)
        outs.append(eng.generate([[3, 4, 5, 6], [7, 8, 9]], SamplingParams(max_tokens=5, seed=3)))
        counters.append(eng.graph_counters())
    assert outs[0] == outs[1]
    fused = counters[0]["recurrent_fused"]
    assert fused["fallbacks"] == 0 and fused["replays"] + fused["captures"] >= 4


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"])
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_whole_token_graph_equals_eager_and_replays_once_per_token(preset, attention):
    """The whole-token graph (prelude + every loop + coda + head + argmax) gives the eager step's tokens bit
    for bit, and the three-step fused path's; one replay per decode token."""
    prompts, params = [[3, 4, 5, 6], [7, 8, 9]], SamplingParams(max_tokens=5, seed=3)
    outs, counters = [], []
    for graphs, whole in ((True, True), (False, True), (True, False)):
        eng = _engine(
            preset,
            graphs,
            scheduler__loop_fusion=True,
            scheduler__prefill_share=True,
            scheduler__whole_token=whole,
            kernels__attention=attention,
        )
        outs.append([eng.generate([p], params)[0] for p in prompts])  # batch 1: R1 allows no change
        counters.append(eng.graph_counters())
    assert outs[0] == outs[1] == outs[2]
    token = counters[0]["whole_token"]
    assert token["fallbacks"] == 0 and token["captures"] == 1
    assert token["replays"] == 2 * 4  # 4 decode tokens after the prefill's first, per request


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_whole_token_graph_at_24_rows_equals_eager(preset):
    """exactloop.yaml's whole_token_max_rows=64: a 24-row whole-token graph (over the former 8-row limit)
    gives the eager whole-token step's tokens bit for bit; one replay per 24-row step, no fallback."""
    prompts = [[3 + i, 4, 5 + i % 7, 6] for i in range(24)]
    params = SamplingParams(max_tokens=4)
    outs, counters = [], []
    for graphs in (True, False):
        eng = _engine(
            preset,
            graphs,
            scheduler__loop_fusion=True,
            scheduler__prefill_share=True,
            scheduler__whole_token=True,
            scheduler__whole_token_max_rows=64,
            scheduler__max_num_seqs=24,
            kernels__attention="triton",
        )
        outs.append(eng.generate(prompts, params))
        counters.append(eng.graph_counters().get("whole_token"))  # the eager engine has no graph counters
    assert outs[0] == outs[1]
    assert counters[0]["fallbacks"] == 0 and counters[0]["captures"] == 1 and counters[0]["replays"] == 3


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"])
def test_async_decode_equals_synchronous_whole_token_decode(preset):
    """scheduler.async_decode on CUDA: graph replays whose input tokens come from the device buffer, tokens
    read one step late through pinned memory, give the synchronous whole-token tokens, batched (the same
    batches: greedy, no EOS) and at batch 1; one replay per decode token."""
    prompts, params = [[3, 4, 5, 6], [7, 8, 9], [2, 11, 4]], SamplingParams(max_tokens=6)
    outs, counters = [], []
    for async_decode in (False, True):
        eng = _engine(
            preset,
            True,
            scheduler__loop_fusion=True,
            scheduler__prefill_share=True,
            scheduler__whole_token=True,
            scheduler__async_decode=async_decode,
        )
        outs.append((eng.generate(prompts, params), [eng.generate([p], params)[0] for p in prompts]))
        counters.append(eng.graph_counters()["whole_token"])
    assert outs[0] == outs[1]
    assert counters[1]["fallbacks"] == 0 and counters[1]["replays"] == counters[0]["replays"]


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_async_gate_readback_equals_the_synchronous_gate(threshold):
    """Async gate readback on CUDA (pinned buffer + event, read after the next submission) gives the
    synchronous gate's tokens and exit depths, with and without early exits."""
    outs = []
    for async_gate in (False, True):
        eng = _engine(
            "ouro-tiny", True, scheduler__async_gate=async_gate, exit__threshold=threshold, exit__min_loops=1
        )
        prompts = [[3 + i + j for j in range(5 + 3 * i)] for i in range(4)]
        tokens = [eng.generate([p], SamplingParams(max_tokens=6))[0] for p in prompts]
        outs.append((tokens, [r.exit_depths for r in eng.requests.values()]))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_prefill_graphs_equal_eager_prefill_bitwise(preset, exact, packed):
    """cuda_graphs.prefill: chunks replayed from graphs (with the exact kernels inside when they are on,
    and the packed prefill kernel's query blocks as a graph input under prefill.packed) write the eager
    chunks' KV and give their tokens, bit for bit."""
    prompts = [[3 + i + j for j in range(5 + 9 * i)] for i in range(4)]
    outs = []
    for prefill_graphs in (False, True):
        eng = _engine(
            preset,
            True,
            cuda_graphs__prefill=prefill_graphs,
            kernels__exact=exact,
            prefill__packed=packed,
            scheduler__prefill_chunk_size=8,
            scheduler__max_num_batched_tokens=16,  # two requests' chunks share a prefill batch
        )
        tokens = eng.generate(prompts, SamplingParams(max_tokens=4, seed=2))
        outs.append((tokens, eng.pool.k_cache.clone(), eng.graph_counters().get("prefill")))
    assert outs[0][0] == outs[1][0] and torch.equal(outs[0][1], outs[1][1])
    assert outs[1][2]["fallbacks"] == 0 and outs[1][2]["replays"] >= 4


def _cuda_kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name for e in sorted(kernels, key=lambda e: e.time_range.start)]


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_eager_graph_body_launches_the_replay_kernels(preset):
    """Profilers map a replay's kernels to ops through the graph body run eagerly
    (`graph_bodies()`). With the exact kernels that run took the eager fallbacks below 256 rows (H200,
    exactloop whole-token graph: 5,142 kernels vs the replay's 990), so no replay matched; the body now
    takes the capture's code path: the same kernel names in the same order."""
    eng = _engine(
        preset,
        True,
        scheduler__loop_fusion=True,
        scheduler__prefill_share=True,
        scheduler__whole_token=True,
        kernels__exact=True,
        kernels__residual_norm=True,
        kernels__rope_kv_write=True,
    )
    eng.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=3, seed=3))
    bodies = [(rows, thunk) for name, rows, thunk in eng.graph_bodies() if name == "whole_token"]
    assert bodies, "no whole-token graph was captured"
    rows, thunk = bodies[0]
    replay = _cuda_kernel_names(eng.runner.token_graphs.entries[rows].graph.replay)
    body = _cuda_kernel_names(thunk)
    assert len(replay) > 0
    # The exact Triton kernels (names `_..._kernel`) run in both, the same ones in the same order; cuBLAS
    # may pick another GEMM kernel under capture (counters' body matching aligns those), so only they may
    # differ, and by at most a few launches.
    assert [k for k in body if k.startswith("_")] == [k for k in replay if k.startswith("_")]
    assert abs(len(body) - len(replay)) <= max(8, len(replay) // 50)
