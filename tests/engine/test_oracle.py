"""The paged, batched engine must match the dense per-request oracle (fp32 CPU) for every family, at every
loop, for mixed batches, chunked prefill and mixed exit depths."""

from __future__ import annotations

import random

import pytest
import torch

from looptrace.engine import LLMEngine, SamplingParams
from tests.helpers import Recorder, build_engine
from tests.oracle import reference_run

FAMILIES = ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"]


def make_engine(preset: str, **settings) -> tuple[LLMEngine, Recorder]:
    rec = Recorder(hidden=True)
    return build_engine(preset, seed=3, observers=(rec,), **settings), rec


def check_against_oracle(
    engine: LLMEngine, rec: Recorder, ids: list[str], oracles: dict | None = None
) -> int:
    """`oracles`: reference runs kept across engines of the same weights (a dense run per request costs as
    much as the engine's), keyed by everything a reference run reads besides the weights."""
    sd = {k: v.float() for k, v in engine.model.state_dict().items()}
    oracles = {} if oracles is None else oracles
    compared = 0
    for rid in ids:
        req = engine.requests[rid]
        shared = engine.cfg.kv.layout == "shared"
        key = (engine.max_loops, tuple(req.prompt), tuple(req.outputs), tuple(req.exit_depths), shared)
        if key not in oracles:
            oracles[key] = reference_run(
                engine.spec, sd, engine.max_loops, req.prompt, req.outputs, req.exit_depths, shared=shared
            )
        oracle, logits = oracles[key]
        for (pos, loop), h in oracle.hidden.items():
            got = rec.states.get((rid, pos, loop))
            assert got is not None, f"{rid}: no engine state for position {pos} loop {loop}"
            torch.testing.assert_close(got, h.float(), atol=2e-4, rtol=2e-4)
            compared += 1
        assert [int(row.argmax()) for row in logits] == req.outputs, (
            f"{rid}: greedy tokens differ from the oracle"
        )
    return compared


@pytest.mark.parametrize("preset", FAMILIES)
def test_mixed_batch_chunked_prefill_matches_oracle(preset):
    engine, rec = make_engine(
        preset,
        scheduler__prefill_chunk_size=7,
        scheduler__max_num_batched_tokens=12,
        scheduler__max_num_seqs=3,
    )
    rng = random.Random(0)
    ids = []
    for n, length in enumerate([1, 5, 16, 23, 40]):
        prompt = [rng.randrange(3, 500) for _ in range(length)]
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=3 + n % 3)))
    while engine.has_unfinished_requests():
        engine.step()
    compared = check_against_oracle(engine, rec, ids)
    assert compared > 0


@pytest.mark.parametrize("layout", ["planes", "packed"])
def test_ouro_mixed_exit_depths_match_oracle(layout):
    engine, rec = make_engine(
        "ouro-tiny",
        kv__layout=layout,
        exit__policy="gate",
        exit__threshold=0.8,
        exit__min_loops=1,
        scheduler__max_num_seqs=4,
    )
    # A sharper gate so tokens exit at different loops (random init gives logits near 0).
    with torch.no_grad():
        engine.model.model.early_exit_gate.weight.mul_(10.0)
        engine.model.model.early_exit_gate.bias.fill_(0.0)
    rng = random.Random(1)
    ids = [
        engine.add_request([rng.randrange(3, 500) for _ in range(9 + 4 * i)], SamplingParams(max_tokens=8))
        for i in range(4)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    depths = {d for rid in ids for d in engine.requests[rid].exit_depths[1:]}
    assert len(depths) >= 3, f"expected mixed exit depths, got {depths}"
    check_against_oracle(engine, rec, ids)


@pytest.mark.parametrize("preset", FAMILIES)
def test_shared_layout_is_chunk_invariant_and_matches_oracle(preset):
    """The shared layout prefills one position at a time (base engine), so chunk 1, 3 and 128 give the same
    states bit for bit (one request at a time, so GEMM row counts match), and they match the dense
    shared-slot oracle."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 17, 11)]
    runs = []
    oracles: dict = {}  # the three engines have the same weights (seed 3): one reference run per request
    for chunk in (1, 3, 128):
        engine, rec = make_engine(
            preset, kv__layout="shared", scheduler__prefill_chunk_size=chunk, scheduler__max_num_seqs=1
        )
        ids = [engine.add_request(p, SamplingParams(max_tokens=3)) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        check_against_oracle(engine, rec, ids, oracles)
        runs.append((rec.states, [engine.requests[i].outputs for i in ids]))
    (base_states, base_tokens), *others = runs
    for states, tokens in others:
        assert tokens == base_tokens
        assert states.keys() == base_states.keys()
        assert all(torch.equal(states[k], base_states[k]) for k in base_states)
