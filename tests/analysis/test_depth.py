"""`looptrace depth` and looptrace.analysis.depth: q90 table vs an independent computation, Eq. 3/4 against
the paper's numbers, the queue-age controller mapping, and bad input -> one line, exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from looptrace.analysis import depth as D
from looptrace.cli.main import app
from looptrace.train.task import AdditionTask, write_jsonl

runner = CliRunner()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("depth") / "eval.jsonl"
    write_jsonl(AdditionTask(2).eval_items(6), path)
    return path


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], lines[0]


# The q90 table against raw captured states -------------------------------------------------------------
def test_report_q90_matches_independent_distances(prompts_file, monkeypatch):
    raw: list[D.StateCapture] = []

    class Recording(D.StateCapture):
        def __init__(self) -> None:
            super().__init__()
            raw.append(self)

    monkeypatch.setattr(D, "StateCapture", Recording)
    res = runner.invoke(
        app,
        [
            "depth",
            "--model",
            "huginn-tiny",
            "--prompts",
            str(prompts_file),
            "--s-ref",
            "6",
            "--format",
            "json",
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    s_ref = report["s_ref"]
    assert s_ref == 6
    (capture,) = raw
    # Independent: walk the raw (request, loop, position) states; roles from each request's positions.
    pooled: dict[tuple[str, int, int], list[float]] = {}
    items = [json.loads(x) for x in prompts_file.read_text().splitlines()]
    for rid, item in zip(sorted(capture.states, key=lambda r: int(r.rsplit("-", 1)[-1])), items):
        states = capture.states[rid]
        length = max(pos for _, pos in states) + 1
        prompt_len = 1 + len(item["prompt"])  # BOS + characters
        for pos in range(length):
            role = (
                "prompt" if pos < prompt_len - 1 else ("final_prefill" if pos == prompt_len - 1 else "decode")
            )
            for s in range(2, s_ref + 1):
                hs = states[(s - 1, pos)]
                for p in range(1, s):
                    d = float(np.sqrt(((states[(p - 1, pos)] - hs) ** 2).sum()) / np.sqrt((hs**2).sum()))
                    pooled.setdefault((role, s, p), []).append(d)
    assert len(report["q90"]) == s_ref * (s_ref - 1) // 2
    for row in report["q90"]:
        for role in D.ROLES:
            expect = float(np.quantile(pooled[(role, row["S"], row["P"])], 0.9))
            assert row[role] == pytest.approx(expect, rel=1e-5, abs=1e-6), (role, row)
    # The recommendation follows the table.
    rec = report["recommended"]
    ok = [r["P"] for r in report["q90"] if r["S"] == rec["S"] and r["prompt"] <= report["tau"]]
    assert rec["P"] == (min(ok) if ok else rec["S"])


def test_q90_table_pure_function():
    rng = np.random.default_rng(0)
    traj = rng.normal(size=(5, 4, 3))
    roles = ["prompt", "prompt", "final_prefill", "decode"]
    table = D.q90_table([(traj, roles)], 5)
    d = D.distances(traj, 2, 5)
    assert table.get("final_prefill", 5, 2) == pytest.approx(d[2])
    assert table.get("prompt", 5, 2) == pytest.approx(np.quantile(d[:2], 0.9))
    assert np.isnan(table.get("prompt", 3, 3)) and np.isnan(table.get("prompt", 2, 4))


def test_recommend_smallest_p_under_tau():
    table = D.Q90Table(4, 0.9, cells={"prompt": np.full((5, 5), np.nan)})
    table.cells["prompt"][4, 1:4] = [0.5, 0.2, 0.1]
    assert D.recommend(table, 4, 0.24) == 2
    assert D.recommend(table, 4, 0.05) == 4  # nothing meets tau: no split


# Eq. 3 and Eq. 4 against the paper ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("abc", "s", "p", "limit"),
    [((4, 6, 4), 32, 8, 3.57), ((4, 6, 4), 11, 4, 2.31), ((2, 4, 2), 32, 16, 1.94)],
)
def test_r_layer_long_prompt_limit_matches_paper(abc, s, p, limit):
    # "For long prompts with short answers, the ratio approaches c_S / c_P: 3.57, 2.31, 1.94."
    assert D.layer_cost(s, *abc) / D.layer_cost(p, *abc) == pytest.approx(limit, abs=0.005)
    assert D.r_layer(1e7, 1, s, p, *abc) == pytest.approx(limit, abs=0.005)


def test_r_layer_formula_and_chunks():
    # Huginn (32, 16): c_32 = 132, c_16 = 68; L = 100, D = 10: 110*132 / (99*68 + 11*132)
    assert D.r_layer(100, 10, 32, 16, 2, 4, 2) == pytest.approx(110 * 132 / (99 * 68 + 11 * 132))
    # M chunks: L - M and D + M
    assert D.r_layer(100, 10, 32, 16, 2, 4, 2, chunks=3) == pytest.approx(110 * 132 / (97 * 68 + 13 * 132))
    assert D.r_layer(50, 5, 8, 8, 2, 4, 2) == pytest.approx(1.0)  # (S, S) saves nothing
    assert D.r_prefill(100, 32, 16, 2, 4, 2) == pytest.approx(100 * 132 / (99 * 68 + 132))


def test_amdahl():
    assert D.amdahl(0.0, 3.0) == pytest.approx(1.0)
    assert D.amdahl(1.0, 1.94) == pytest.approx(1.94)
    assert D.amdahl(0.5, 1e9) == pytest.approx(2.0, rel=1e-6)  # bounded by 1 / (1 - f)
    # GSM8K in the paper: layer ratios 1.52-2.71 but wall-time 0.98-1.01x: a small f does that
    assert 0.98 <= D.amdahl(0.02, 2.71, eps=0.01) <= 1.01
    with pytest.raises(D.DepthInputError):
        D.amdahl(1.5, 2.0)


# Queue-age controller (the q -> P mapping) -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("q", "expect"),
    [(0.0, 4), (0.25, 4), (0.4, 4), (0.5, 3), (0.7, 3), (0.8, 3), (0.9, 2), (1.0, 2), (5.0, 2)],
)
def test_controller_mapping_olmo(q, expect):
    # OLMo: S = 4, (P_max, P_min) = (4, 2); z = clip((q - 0.25) / 0.75, 0, 1)
    assert D.controller_p(q, 4, 2) == expect


def test_controller_monotone_and_bounds():
    ps = [D.controller_p(q / 100, 16, 8) for q in range(0, 150)]
    assert ps[0] == 16 and ps[-1] == 8
    assert all(a >= b for a, b in zip(ps, ps[1:]))


# Bad input ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tau", ["0", "1", "-0.2", "1.5"])
def test_tau_outside_unit_interval(tau, prompts_file):
    res = runner.invoke(app, ["depth", "--prompts", str(prompts_file), "--tau", tau])
    assert_one_line_error(res, "--tau")


def test_p_greater_than_s(prompts_file):
    res = runner.invoke(
        app, ["depth", "--prompts", str(prompts_file), "--s-ref", "4", "--s", "3", "--p", "4"]
    )
    assert_one_line_error(res, "P <= S")


def test_s_beyond_reference(prompts_file):
    res = runner.invoke(app, ["depth", "--prompts", str(prompts_file), "--s-ref", "4", "--s", "6"])
    assert_one_line_error(res, "S_ref")


def test_prompts_without_needed_fields(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1="}\n')
    assert_one_line_error(runner.invoke(app, ["depth", "--prompts", str(bad)]), "bad.jsonl:1", "prompt")
    no_answer = tmp_path / "noans.jsonl"
    no_answer.write_text('{"prompt": "1+1="}\n')
    res = runner.invoke(app, ["depth", "--prompts", str(no_answer), "--accuracy-by-depth", "1,2"])
    assert_one_line_error(res, "noans.jsonl:1", "answer")
    notjson = tmp_path / "x.jsonl"
    notjson.write_text("nope\n")
    assert_one_line_error(runner.invoke(app, ["depth", "--prompts", str(notjson)]), "x.jsonl:1")
    assert_one_line_error(
        runner.invoke(app, ["depth", "--prompts", str(tmp_path / "missing.jsonl")]), "missing"
    )
