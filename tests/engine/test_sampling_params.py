"""SamplingParams at the engine boundary: every field range-checked at add_request (nothing
that can raise reaches a step), seeds over the whole 64-bit range on every seed path, tiny temperatures
and top_p that used to give NaN / an invalid multinomial, the logit processing (bias, penalties), stop
token ids, and logprobs against the engine's own log-softmax of the logits it sampled from."""

from __future__ import annotations

import pytest
import torch

from looptrace.engine import EngineInputError, LLMEngine, Observer, SamplingParams
from looptrace.engine.request import Request, SamplingParamsError, derive_seed, reduce_seed
from looptrace.engine.sampling import process_logits, sample
from looptrace.recipes import load_recipe
from tests.helpers import build_engine

PROMPT = [17, 250, 3, 99, 411, 64, 8, 300, 12, 45]


def _req(prompt=(1,), outputs=(), **kw) -> Request:
    r = Request(list(prompt), SamplingParams(**kw))
    r.outputs = list(outputs)
    r.generator = torch.Generator().manual_seed(kw.get("seed") or 0)
    return r


# --- validation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", -1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", -1e-9),
        ("top_p", 0.0),
        ("top_p", float("nan")),
        ("top_k", -1),
        ("max_tokens", 0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {10**6: 1.0}),
        ("logit_bias", {5: float("nan")}),
        ("stop_token_ids", [-3]),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_out_of_range_fields_are_named_and_rejected_at_add_request(field, value):
    params = SamplingParams(**({"max_tokens": 2, "temperature": 1.0} | {field: value}))
    with pytest.raises(SamplingParamsError) as err:
        params.check(vocab_size=512)
    assert err.value.param == field
    engine = build_engine("ouro-tiny")
    with pytest.raises(EngineInputError, match=f"(sampling: )?{field}"):
        engine.add_request(PROMPT, params)
    assert not engine.has_unfinished_requests()


def test_seed_reduction_is_the_identity_in_range_and_wraps_derived_seeds():
    assert reduce_seed(0) == 0 and reduce_seed(2**64 - 1) == 2**64 - 1
    assert reduce_seed(2**64 + 5) == 5
    assert derive_seed(7, 2) == 9 and derive_seed(2**64 - 1, 1) == 0


# --- seeds: every path the seed takes -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**63, 2**64 - 1])
def test_huge_seeds_on_huginn_exactloop_cache(seed):
    """Regression: seed 2**63 overflowed the prefix-cache salt (signed 8 bytes) and killed the server's
    engine thread; seeds are 64-bit unsigned: the position-keyed noise and the sampler take them."""
    cfg = load_recipe("exactloop-cache").config
    runs = []
    for _ in range(2):
        engine = LLMEngine.from_preset("huginn", cfg, device="cpu", seed=0)
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=seed)
        runs.append(engine.generate([PROMPT, PROMPT[:6]], params))
        assert engine.requests["req-0"].prefix_salt == seed.to_bytes(8, "little")
    assert runs[0] == runs[1] and all(len(o) == 4 for o in runs[0])


def test_prefix_salt_bytes_unchanged_for_seeds_below_2_63():
    cfg = load_recipe("exactloop-cache").config
    engine = LLMEngine.from_preset("huginn", cfg, device="cpu", seed=0)
    engine.add_request(PROMPT, SamplingParams(max_tokens=1, seed=12345), request_id="a")
    assert engine.requests["a"].prefix_salt == (12345).to_bytes(8, "little", signed=True)


def test_largest_engine_seed_derives_generator_seeds_in_range():
    engine = build_engine("ouro-tiny", seed=2**64 - 1)  # seed * 1_000_003 + seq wraps mod 2**64
    out = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=1.0))
    assert len(out[0]) == 3


# --- the sampler's numeric edges ----------------------------------------------------------------------------
def test_tiny_temperature_is_greedy():
    """Regression: temperature 1e-45 gave NaN probabilities; below 1e-5 it is greedy (vLLM's rule)."""
    assert SamplingParams(temperature=1e-45).greedy and not SamplingParams(temperature=1e-5).greedy
    greedy = build_engine("ouro-tiny").generate([PROMPT], SamplingParams(max_tokens=6))
    tiny = build_engine("ouro-tiny").generate(
        [PROMPT], SamplingParams(max_tokens=6, temperature=1e-45, seed=3)
    )
    assert tiny == greedy


def test_top_p_below_float32s_smallest_value_keeps_the_top_token():
    """Regression: top_p 1e-300 rounds to 0 in float32, dropped every token, multinomial raised."""
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    reqs = [_req(temperature=1.0, top_p=1e-300, seed=s) for s in range(3)]
    assert torch.equal(sample(logits, reqs), logits.argmax(-1))


# --- logit processing ---------------------------------------------------------------------------------------
def test_process_logits_matches_vllm_semantics_by_hand():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    req = _req(
        prompt=[0, 1],
        outputs=[3, 3, 2],
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=2.0,
        logit_bias={4: 10.0},
    )
    got = process_logits(row, req)
    # bias first: token 4 -> 8.0; repetition on prompt+output {0,1,2,3}: >0 divided, <0 multiplied;
    # then output tokens: 3 (twice) -= 0.5 + 0.25*2, 2 (once) -= 0.5 + 0.25
    want = torch.tensor([1.0, -2.0, 0.25 - 0.75, 1.5 - 1.0, 8.0])
    torch.testing.assert_close(got, want)
    assert torch.equal(row, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # the input is not changed


def test_defaults_sample_exactly_as_before_and_processing_changes_only_its_row():
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    plain = [_req(), _req(temperature=0.8, seed=5), _req(), _req(temperature=1.1, top_k=30, seed=6)]
    again = [_req(), _req(temperature=0.8, seed=5), _req(), _req(temperature=1.1, top_k=30, seed=6)]
    mixed = [_req(logit_bias={7: 100.0}), _req(temperature=0.8, seed=5), _req(), again[3]]
    base = sample(logits, plain)
    assert torch.equal(sample(logits, again[:3] + [_req(temperature=1.1, top_k=30, seed=6)]), base)
    got = sample(logits, mixed)
    assert got[0].item() == 7 and torch.equal(got[1:], base[1:])


def test_logit_bias_and_penalties_in_the_engine_touch_only_the_requests_that_ask():
    solo = build_engine("ouro-tiny").generate([PROMPT], SamplingParams(max_tokens=6))[0]
    params = [
        SamplingParams(max_tokens=6),
        SamplingParams(max_tokens=6, logit_bias={42: 100.0}),
        SamplingParams(max_tokens=6, repetition_penalty=1.8, frequency_penalty=2.0),
    ]
    out = build_engine("ouro-tiny").generate([PROMPT] * 3, params)
    assert out[0] == solo and out[1] == [42] * 6
    assert len(set(out[2])) == 6  # frequency 2 on a tiny random model: no token twice


def test_penalised_rows_never_defer_their_tokens_under_async_decode():
    from tests.engine.test_async_decode import engine as async_engine

    params = SamplingParams(max_tokens=6, presence_penalty=2.0, frequency_penalty=2.0)
    outs = [async_engine("ouro-tiny", mode).generate([PROMPT], params) for mode in (False, True)]
    assert outs[0] == outs[1] and len(set(outs[0][0])) == 6


def test_stop_token_ids_stop_even_with_ignore_eos():
    ref = build_engine("ouro-tiny").generate([PROMPT], SamplingParams(max_tokens=8))[0]
    stop = ref[3]
    engine = build_engine("ouro-tiny")
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop]))
    while engine.has_unfinished_requests():
        engine.step()
    req = engine.requests[rid]
    assert req.outputs == ref[: ref.index(stop) + 1] and req.finish_reason == "stop"


# --- logprobs -----------------------------------------------------------------------------------------------
class LogitsLog(Observer):
    wants_logits = True

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}

    def on_logits(self, request_ids, logits) -> None:
        for i, rid in enumerate(request_ids):
            self.rows.setdefault(rid, []).append(logits[i].detach().float().clone())


@pytest.mark.parametrize(
    "settings",
    [
        {},  # coda path
        dict(noise="sequential", scheduler__loop_fusion=True, scheduler__whole_token=True),
        dict(
            noise="sequential",
            scheduler__loop_fusion=True,
            scheduler__whole_token=True,
            scheduler__async_decode=True,
        ),
    ],
    ids=["coda", "whole_token", "async_decode"],
)
@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_logprobs_are_the_log_softmax_of_the_logits_sampled_from(preset, settings):
    log = LogitsLog()
    engine = build_engine(preset, observers=(log,), **settings)
    params = [
        SamplingParams(max_tokens=5, logprobs=3),
        SamplingParams(max_tokens=5, temperature=0.9, seed=4, logprobs=0),
        SamplingParams(max_tokens=5),  # asks for none: gets none
    ]
    ids = [engine.add_request(PROMPT[: 6 + i], p) for i, p in enumerate(params)]
    outs: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    for rid, p in zip(ids, params):
        got = outs[rid]
        assert [o.token_id for o in got] == engine.requests[rid].outputs and len(got) == 5
        if p.logprobs is None:
            assert all(o.logprob is None and o.top_logprobs is None for o in got)
            continue
        for o, logits in zip(got, log.rows[rid]):
            ref = torch.log_softmax(logits, dim=-1)
            assert o.logprob == pytest.approx(ref[o.token_id].item(), abs=1e-5)
            top = ref.topk(p.logprobs)
            assert [t for t, _ in o.top_logprobs] == top.indices.tolist()
            assert [v for _, v in o.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    greedy = outs[ids[0]]
    assert all(o.logprob == pytest.approx(o.top_logprobs[0][1]) for o in greedy)  # greedy: the top token


def test_logprobs_off_changes_no_token():
    with_lp = build_engine("ouro-tiny").generate([PROMPT], SamplingParams(max_tokens=6, logprobs=5))
    without = build_engine("ouro-tiny").generate([PROMPT], SamplingParams(max_tokens=6))
    assert with_lp == without
