"""The request lifecycle (engine/request_events.py): one handler per event, looked up in a table."""

from __future__ import annotations

from looptrace.engine import SamplingParams
from looptrace.engine.request import Event, Stage
from looptrace.engine.request_events import EVENT_HANDLERS, PENDING_TOKEN, RequestLifecycle
from tests.helpers import build_engine


def test_every_event_has_one_handler_of_the_lifecycle():
    assert set(EVENT_HANDLERS) == set(Event)
    for event, handler in EVENT_HANDLERS.items():
        assert getattr(RequestLifecycle, handler.__name__) is handler, event


def _admitted(engine, prompt=(5, 9, 13), max_tokens=4):
    rid = engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens))
    engine.step()  # admits it and runs its one prefill chunk
    return engine.requests[rid]


def test_the_last_prefill_chunk_moves_a_request_to_coda_at_full_depth():
    engine = build_engine("ouro-tiny")
    req = _admitted(engine)
    assert req.stage == Stage.CODA and req.loops_done == engine.max_loops
    assert req.num_prefilled == len(req.prompt) and req.state_slot >= 0


def test_a_token_read_late_fills_its_placeholder_and_stops_at_max_tokens():
    engine = build_engine("ouro-tiny")
    req = _admitted(engine, max_tokens=1)
    life = engine.lifecycle
    req.stage = Stage.RECURRENT
    life.advance(req, Event.TOKEN_SUBMITTED)
    assert req.outputs == [PENDING_TOKEN] and req.stage == Stage.RECURRENT  # held for its read
    out = life.advance(req, Event.TOKEN_READ, token=7, index=0)
    assert (out.token_id, out.finished, out.finish_reason) == (7, True, "length")
    assert req.outputs == [7] and req.stage == Stage.FINISHED and req.state_slot == -1
    assert engine.blocks.used_blocks() == engine.blocks.cache_only_blocks()  # its KV freed


def test_an_abort_with_a_token_unread_drops_the_placeholder():
    engine = build_engine("ouro-tiny")
    req = _admitted(engine, max_tokens=3)
    engine.lifecycle.advance(req, Event.TOKEN_SUBMITTED)
    engine.abort_request(req.request_id)
    assert req.outputs == [] and req.finish_reason == "abort" and not engine.has_unfinished_requests()


def test_a_gate_read_late_that_exits_rolls_back_the_loop_run_past_it():
    engine = build_engine("ouro-tiny", exit__threshold=0.5, exit__min_loops=1)
    req = _admitted(engine)
    life = engine.lifecycle
    req.stage, req.loops_done, req.remaining_probability = Stage.RECURRENT, 2, 1.0
    life.early_exits, life.rollbacks = [], []
    life.advance(req, Event.GATE_READ, gate=50.0, loop=1)  # a sure exit after loop 1, one loop ran past it
    assert req.loops_done == 1 and req.stage == Stage.CODA
    assert life.early_exits == [req] and life.rollbacks == [req]
