"""`looptrace diff` with endpoints as arms: real `looptrace serve` apps on 127.0.0.1 (uvicorn on a thread,
tiny Ouro on CPU, as tests/serve/conftest.py starts them), the real HTTP API, no mocks. The rules of the
verdict are also checked on hand-made streams (pure functions)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

pytest.importorskip("fastapi")

from looptrace.analysis import stream_diff as sd  # noqa: E402
from looptrace.analysis.endpoint_arm import (  # noqa: E402
    EndpointError,
    Position,
    Served,
    discover,
    served_recipe,
)
from looptrace.analysis.endpoint_diff import EndpointDiffRequest, execute  # noqa: E402
from tests.helpers import loopback_server  # noqa: E402

RECURRENT_PLACE = "recurrent:1:core0:mlp"  # decode steps only: the prefill (position 0) is untouched
PREFILL_PLACE = "prefill:0:core0:mlp"
ARMS = {
    "base": [],
    "recurrent": [f"debug.perturb={RECURRENT_PLACE}"],
    "prefill": [f"debug.perturb={PREFILL_PLACE}"],
    "early_exit": ["exit.threshold=0.5"],  # R3: changes tokens
    # A planted fault: every decode step's MLP outputs 2**20 ulps (about 12 %) too large, prefill untouched
    "planted": ["debug.perturb=recurrent:*:*:mlp", "debug.perturb_ulps=1048576"],
}
SMALL = dict(num_requests=4, prompt_len=12, max_tokens=6, concurrency=1)


@pytest.fixture(scope="module")
def urls():
    """One server per recipe variant, started once for the module."""
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(served_recipe("base", sets, model="ouro", device="cpu"))[0].url
            for name, sets in ARMS.items()
        }


def run(a: str, b: str, **options):
    return execute(EndpointDiffRequest(arm_a=a, arm_b=b, **{**SMALL, **options}), lambda *_: None)


def raw_tokens(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """A plain completion request, for an independent look at what the server generates."""
    body = dict(model="ouro", prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    r = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}, timeout=30)
    return r.json()["choices"][0]["token_ids"]


# Real servers --------------------------------------------------------------------------------------------
def test_base_endpoint_vs_exactloop_recipe_is_identical_at_batch_1(urls) -> None:
    data, ok = run(urls["base"], "exactloop", model="ouro", device="cpu", expect="identical")
    assert ok and data["verdict"]["overall"] == sd.IDENTICAL
    assert [r["verdict"] for r in data["requests"]] == [sd.IDENTICAL] * 4
    b = data["header"]["arms"]["b"]
    assert b["recipe"] == "exactloop" and b["dtype"] == "float32" and b["preset"] == "ouro-tiny"
    # The URL arm's dtype is not reported by the server: bfloat16 unless --served-dtype says otherwise;
    # the noisier arm's margin is the one used.
    noise = data["header"]["noise"]
    assert noise["dtypes"] == {"a": "bfloat16", "b": "float32"} and noise["dtype"] == "bfloat16"
    assert noise["margin"] == sd.NOISE_MARGIN["bfloat16"] and noise["source"] == "dtype"


def test_served_dtype_names_the_url_arms_dtype(urls) -> None:
    data, _ = run(urls["base"], urls["base"], served_dtype="float32", num_requests=1)
    noise = data["header"]["noise"]
    assert (
        noise["dtypes"] == {"a": "float32", "b": "float32"} and noise["margin"] == sd.NOISE_MARGIN["float32"]
    )


@pytest.mark.parametrize("arm, planted_position", [("recurrent", 1), ("prefill", 0)])
def test_perturbed_arm_moves_logprobs_first_at_the_planted_step(urls, arm, planted_position) -> None:
    """One ulp in a decode-only op moves no logprob of the prefill's token (position 0) and some of the first
    decode step's (position 1); in a prefill op it moves position 0 already. Tokens stay the same."""
    data, ok = run(urls["base"], urls[arm], expect="identical")
    assert ok and data["summary"]["identical"] == 4
    moved = [r["logprobs_first_differ"] for r in data["requests"] if r["logprobs_first_differ"] is not None]
    assert moved and min(moved) == planted_position
    assert all(r["max_logprob_delta"] > 0 for r in data["requests"] if r["logprobs_first_differ"] is not None)


def test_changed_tokens_are_located_and_graded_by_the_margin(urls) -> None:
    data, ok = run(urls["base"], urls["early_exit"], expect="noise")
    changed = [r for r in data["requests"] if r["verdict"] != sd.IDENTICAL]
    assert changed and not ok and data["verdict"]["violations"] == [r["id"] for r in changed]
    prompts = _prompts()
    for r in data["requests"]:
        a, b = (raw_tokens(u, prompts[r["id"]], 6) for u in (urls["base"], urls["early_exit"]))
        assert r["first_divergence"] == sd.first_divergence(a, b)
        if r["first_divergence"] is not None:
            fd = r["first_divergence"]
            assert (r["token_a"], r["token_b"]) == (a[fd], b[fd])
            assert r["later_differ"] == sum(x != y for x, y in zip(a[fd + 1 :], b[fd + 1 :]))
    # The near-tie rule on the real margins: a margin just above both makes the change noise, just below not.
    judged = [r for r in changed if r["margin_a"] is not None and r["margin_b"] is not None]
    assert judged, "no divergence with both tokens in both top-k lists"
    widest = max(max(r["margin_a"], r["margin_b"]) for r in judged)
    for margin, verdict in ((widest * 1.01, sd.WITHIN_NOISE), (widest * 0.99, sd.BEYOND_NOISE)):
        data, _ = run(urls["base"], urls["early_exit"], noise_margin=margin)
        by_id = {r["id"]: r["verdict"] for r in data["requests"]}
        widest_id = next(r["id"] for r in judged if max(r["margin_a"], r["margin_b"]) == widest)
        assert by_id[widest_id] == verdict
        assert data["header"]["noise"]["source"] == "--noise-margin"


def _prompts() -> dict[str, list[int]]:
    """The random prompts the diff sends between two URLs (ids below 256, seed 0, SMALL's sizes)."""
    from looptrace.drive.workloads import BurstWorkload

    items = BurstWorkload(concurrency=4, prompt_len=12, max_tokens=6, seed=0, vocab_size=256).initial_items()
    return {f"r{i}": list(it.prompt) for i, it in enumerate(items)}


def test_a_request_the_server_rejects_is_reported_and_the_rest_compared(urls, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [5, 6, 99999]}, {"prompt": "ab"}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    data, ok = run(urls["base"], urls["base"], prompts=prompts, expect="identical")
    verdicts = [r["verdict"] for r in data["requests"]]
    assert verdicts == [sd.IDENTICAL, sd.FAILED, sd.IDENTICAL]
    assert "HTTP 400" in data["requests"][1]["error"] and "99999" in data["requests"][1]["error"]
    assert not ok and data["verdict"]["failed"] == ["r1"]


@contextmanager
def hung_endpoint() -> Iterator[str]:
    """A real HTTP server that lists a model at once and never answers a completion (a hung engine)."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            body = json.dumps({"object": "list", "data": [{"id": "ouro", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            release.wait(30)  # until the test ends: the client's timeout must fire first

        def log_message(self, *args) -> None:
            pass

    with loopback_server(Handler) as url:
        try:
            yield url
        finally:
            release.set()  # before the server shuts down: no handler is left waiting


def test_timeouts_are_retried_then_reported_per_request(urls) -> None:
    """Arm B never answers: each request times out, is retried once, and is reported on its own."""
    with hung_endpoint() as hung:
        data, ok = run(urls["base"], hung, timeout=0.5, retries=1, num_requests=2, expect="noise")
    assert not ok and [r["verdict"] for r in data["requests"]] == [sd.FAILED, sd.FAILED]
    for r in data["requests"]:
        assert r["error"].startswith("B: ") and "timed out" in r["error"], r["error"]
        assert r["error"].endswith("(after 2 attempts)") and r["tokens_a"] == 6 and r["tokens_b"] == 0


def test_batch_probe_sends_each_prompt_alone_and_in_a_crowd(urls) -> None:
    again, _ = run(urls["base"], urls["base"])  # one at a time, twice: bit for bit the same
    assert all(r["logprobs_first_differ"] is None for r in again["requests"])
    data, _ = run(urls["base"], urls["recurrent"], batch_probe=True)
    for arm in ("A", "B"):
        probe = data["batch_probe"][arm]
        assert probe["crowd"] == 4 and len(probe["requests"]) == 4
        assert sum(probe["counts"].values()) == 4 and probe["counts"]["error"] == 0
        # Alone, a request's logprobs repeat exactly; batched with others they move (the base engine's
        # batch dependence on this CPU): a crowd that was really served as one shows it.
        assert any(r["logprobs_first_differ"] is not None for r in probe["requests"])


def test_a_server_that_refuses_is_retried_then_reported(urls) -> None:
    """A draining server answers 503: retried, then reported on each request; exit 1 under a claim."""
    from looptrace.serve.server import build_server
    from tests.helpers import build_setup

    engine = build_setup("ouro").engine
    srv = build_server(engine, port=0, model_name="ouro").start()
    try:
        srv.loop.begin_drain(60.0)  # refuses new requests with 503 from now on
        data, ok = run(urls["base"], srv.url, retries=2, num_requests=2, expect="noise")
    finally:
        srv.stop()
    assert not ok and data["verdict"]["failed"] == ["r0", "r1"]
    for r in data["requests"]:
        assert r["verdict"] == sd.FAILED and r["tokens_a"] == 6 and r["tokens_b"] == 0
        assert r["error"].startswith("B: HTTP 503") and r["error"].endswith("(after 3 attempts)")


def test_api_key_is_sent_as_a_bearer_token() -> None:
    from looptrace.serve.server import build_server
    from tests.helpers import build_setup

    engine = build_setup("ouro").engine
    srv = build_server(engine, port=0, model_name="ouro", api_key="sesame").start()
    try:
        with pytest.raises(EndpointError, match="HTTP 401"):
            discover(srv.url, None)
        data, ok = run(srv.url, srv.url, api_key="sesame", num_requests=1, expect="identical")
        assert ok and data["requests"][0]["verdict"] == sd.IDENTICAL
    finally:
        srv.stop()


def test_unreachable_endpoint_and_unknown_model_are_endpoint_errors(urls) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    with pytest.raises(EndpointError, match="cannot reach"):
        discover(f"http://127.0.0.1:{port}", None, timeout=2)
    with pytest.raises(EndpointError, match="no model 'llama'"):
        discover(urls["base"] + "/v1", "llama")
    assert discover(urls["base"] + "/v1/", None).model == "ouro"


# The verdict rules on hand-made streams -------------------------------------------------------------------
def _served(*positions: tuple[int, str, float, dict[str, float]]) -> Served:
    return Served("r0", [Position(t, text, lp, top) for t, text, lp, top in positions])


def test_near_tie_needs_both_margins_within_the_noise() -> None:
    same = (1, "a", -0.1, {"a": -0.1})
    a = _served(same, (2, "x", -0.50, {"x": -0.50, "y": -0.55}))
    b = _served(same, (3, "y", -0.52, {"y": -0.52, "x": -0.60}))
    d = sd.compare(a, b, 0.1)
    assert (d.first_divergence, d.token_a, d.token_b) == (1, 2, 3)
    assert d.margin_a == pytest.approx(0.05) and d.margin_b == pytest.approx(0.08)
    assert d.verdict == sd.WITHIN_NOISE
    assert sd.compare(a, b, 0.06).verdict == sd.BEYOND_NOISE
    unlisted = _served(same, (3, "y", -0.52, {"y": -0.52}))  # A's token is not in B's top-k
    assert sd.compare(a, unlisted, 10.0).verdict == sd.BEYOND_NOISE
    alike = _served(same, (4, "x", -0.5, {"x": -0.5}))  # prints like A's token: cannot be weighed
    assert sd.margin(a.positions[1], alike.positions[1]) is None


def test_sampled_streams_are_same_distribution_when_the_top_k_agree() -> None:
    a = _served((1, "a", -0.7, {"a": -0.7, "b": -0.9}), (2, "c", -1.0, {"c": -1.0}))
    b = _served((5, "b", -0.9, {"a": -0.71, "b": -0.88}), (6, "d", -1.0, {"d": -1.0}))
    assert sd.compare(a, b, 0.05, greedy=False).verdict == sd.SAME_DISTRIBUTION
    assert sd.compare(a, b, 0.01, greedy=False).verdict == sd.BEYOND_NOISE


def test_claims_and_overall() -> None:
    diffs = [sd.StreamDiff("r0", sd.IDENTICAL), sd.StreamDiff("r1", sd.WITHIN_NOISE)]
    assert sd.violations(diffs, "noise") == [] and sd.violations(diffs, "identical") == ["r1"]
    assert sd.violations(diffs, None) == [] and sd.overall(diffs) == sd.WITHIN_NOISE
    assert sd.overall([sd.StreamDiff("r0", sd.FAILED)]) == sd.FAILED


# The reference as judge ----------------------------------------------------------------------------------
def test_reference_blames_the_early_exit_arm_at_each_divergence(urls) -> None:
    """Arm A is the base engine in float32 on this CPU, the same model as the reference: its token is the
    reference's argmax, with the logprob A served; arm B (early exit) leaves it, and is blamed."""
    data, _ = run(urls["base"], urls["early_exit"], reference="ouro")
    ref = data["reference"]
    assert (ref["preset"], ref["dtype"], ref["device"]) == ("ouro-tiny", "float32", "cpu")
    noise = ref["noise"]
    assert noise["positions"] == 4 * 6 and noise["margin"] == 2 * noise["max_abs_dlogprob"] > 0
    changed = [r for r in data["requests"] if r["first_divergence"] is not None]
    assert changed and ref["blame_counts"] == {"arm A": 0, "arm B": len(changed), "near tie": 0}
    for r in data["requests"]:
        j = r["judge"]
        if r["first_divergence"] is None:
            assert j is None
            continue
        assert j["ref_argmax"] == r["token_a"] and j["ref_argmax_logprob"] == j["ref_logprob_a"]
        assert abs(j["ref_logprob_a"] - r["logprob_a"]) <= 1e-5
        assert j["ref_margin"] == j["ref_logprob_a"] - j["ref_logprob_b"] > noise["margin"]
        assert j["blame"] == "arm B"


def test_reference_finds_nothing_to_blame_when_base_and_exactloop_agree(urls) -> None:
    data, ok = run(
        urls["base"], "exactloop", model="ouro", device="cpu", expect="identical", reference="ouro"
    )
    assert ok and data["summary"]["identical"] == 4
    assert [r["judge"] for r in data["requests"]] == [None] * 4
    # Both arms are the reference's own model in float32 on this CPU: every served token is its argmax.
    for agree in data["reference"]["agreement"].values():
        assert agree["positions"] == 24 and agree["argmax_agree"] == 24 and agree["max_abs_dlogprob"] <= 1e-5
    assert data["reference"]["blame_counts"] == {"arm A": 0, "arm B": 0, "near tie": 0}
    assert data["reference"]["noise"]["positions"] == 4 * 6


def test_reference_pool_holds_one_stream_of_the_longest_length() -> None:
    """Sized to the stream it scores, not to the free memory: on a GPU shared with the server it judges,
    a pool sized on what was left held 16 positions and refused a 160-token stream."""
    from looptrace.analysis.reference_judge import ReferenceSpec, open_reference

    ref = open_reference(ReferenceSpec("ouro"), longest=40)
    for engine in (ref.engine, ref.noise_engine):
        kv = engine.snapshot().kv
        assert kv.num_blocks == 3 * kv.blocks_per_page  # ceil(40 / 16) blocks in every plane of a page
        assert engine.snapshot().limits.max_model_len >= 40


def test_blame_rule_on_the_reference_margin() -> None:
    from looptrace.analysis.reference_judge import NEAR_TIE, blame

    assert [blame(m, 0.05) for m in (0.02, -0.05, 0.0)] == [NEAR_TIE] * 3
    assert blame(0.051, 0.05) == "arm B" and blame(-0.051, 0.05) == "arm A"  # B's / A's token ranked lower


def test_a_planted_decode_fault_is_found_after_the_prefill_and_blamed_on_its_arm(urls) -> None:
    """The planted arm changes tokens only where decode steps made them (position >= 1; position 0 is the
    prefill's token), and the reference blames it, not the base arm, at every divergence."""
    data, ok = run(urls["base"], urls["planted"], expect="identical", reference="ouro")
    changed = [r for r in data["requests"] if r["first_divergence"] is not None]
    assert changed and not ok and data["verdict"]["violations"] == [r["id"] for r in changed]
    assert all(r["first_divergence"] >= 1 for r in changed)
    assert data["reference"]["blame_counts"] == {"arm A": 0, "arm B": len(changed), "near tie": 0}
    for r in changed:
        j = r["judge"]
        assert j["blame"] == "arm B" and j["ref_argmax"] == r["token_a"]
        assert j["ref_margin"] > data["reference"]["noise"]["margin"]


def test_a_one_ulp_perturbation_gives_the_judge_nothing_to_blame(urls) -> None:
    """One ulp in a decode op moves logprobs by ~1e-7 to 1e-6 and no token: the reference (whose own
    prefill-vs-decode difference is of the same size) sees every served token as its argmax on both arms."""
    data, ok = run(urls["base"], urls["recurrent"], expect="identical", reference="ouro")
    assert ok and data["reference"]["blame_counts"] == {"arm A": 0, "arm B": 0, "near tie": 0}
    for agree in data["reference"]["agreement"].values():
        assert agree["argmax_agree"] == agree["positions"] == 24 and agree["max_abs_dlogprob"] <= 1e-5
