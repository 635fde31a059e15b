"""Packed prefill (ExactLoop, R3): each request's chunk is one causal query block reading its pages once.
Same function as per-row prefill (it matches the dense oracle), another reduction shape (bits may move)."""

from __future__ import annotations

import pytest

from looptrace.engine import SamplingParams
from tests.engine.test_oracle import check_against_oracle
from tests.helpers import Recorder, build_engine

PROMPTS = [[3 + (i * 7 + n) % 400 for i in range(n)] for n in (5, 17, 30)]


def run(preset: str, packed: bool):
    rec = Recorder(hidden=True)
    engine = build_engine(  # chunks of mixed length
        preset,
        observers=(rec,),
        prefill__packed=packed,
        scheduler__prefill_chunk_size=7,
        scheduler__max_num_batched_tokens=20,
    )
    ids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in PROMPTS]
    while engine.has_unfinished_requests():
        engine.step()
    return engine, rec, ids


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"])
def test_packed_prefill_matches_the_oracle_and_per_row_tokens(preset):
    engine, rec, ids = run(preset, packed=True)
    assert check_against_oracle(engine, rec, ids) > 0
    per_row, _, per_row_ids = run(preset, packed=False)
    assert [engine.requests[i].outputs for i in ids] == [per_row.requests[i].outputs for i in per_row_ids]
