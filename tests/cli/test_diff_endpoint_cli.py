"""`looptrace diff` with endpoint arms, end to end through the CLI: real `looptrace serve` apps on
127.0.0.1 (tiny Ouro on CPU), formats, the claim's exit code, the accuracy check, bad input."""

from __future__ import annotations

import csv
import io
import json
import socket
from contextlib import ExitStack

import pytest
from typer.testing import CliRunner

pytest.importorskip("fastapi")

from looptrace.analysis.endpoint_arm import served_recipe  # noqa: E402
from looptrace.assets import shipped_weights  # noqa: E402
from looptrace.cli.main import app  # noqa: E402

FAST = ["-c", "1", "--num-requests", "3", "--prompt-len", "8", "--max-tokens", "4", "--no-progress"]
runner = CliRunner()


@pytest.fixture(scope="module")
def urls():
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(served_recipe("base", sets, model="ouro", device="cpu"))[0].url
            for name, sets in {"base": [], "early_exit": ["exit.threshold=0.5"]}.items()
        }


def invoke(*args: str):
    return runner.invoke(app, ["diff", *FAST, *map(str, args)])


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == "" and "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_endpoint_vs_recipe_table_and_claim_holds(urls) -> None:
    r = invoke(urls["base"], "exactloop", "--model", "ouro", "--device", "cpu", "--expect", "identical")
    assert r.exit_code == 0, r.output
    assert "looptrace diff (endpoints)" in r.stdout and "recipe exactloop (in-process)" in r.stdout
    assert "A vs B: 3/3 identical" in r.stdout and "claim 'identical' holds" in r.stdout


def test_changed_streams_json_exit_1_and_csv(urls, tmp_path) -> None:
    r = invoke(urls["base"], urls["early_exit"], "--expect", "noise", "-f", "json")
    assert r.exit_code == 1, r.output
    data = json.loads(r.stdout)
    assert data["schema"] == "looptrace.diff-endpoints/1" and not data["verdict"]["ok"]
    changed = [x["id"] for x in data["requests"] if x["verdict"] == "changed-beyond-noise"]
    assert changed and data["verdict"]["violations"] == changed
    out = tmp_path / "d.csv"
    r = invoke(urls["base"], urls["early_exit"], "-o", out)
    assert r.exit_code == 0, r.output  # no claim: report only
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [row["id"] for row in rows] == ["r0", "r1", "r2"]
    assert [row["id"] for row in rows if row["first_divergence"]] == changed


def test_accuracy_per_arm_with_the_one_point_rule(urls, tmp_path) -> None:
    eval_set = tmp_path / "eval.jsonl"
    lines = (shipped_weights("ouro-tiny") / "eval.jsonl").read_text().splitlines()[:8]
    eval_set.write_text("\n".join(lines) + "\n")
    r = invoke(urls["base"], urls["base"], "--accuracy", eval_set, "-f", "json")
    assert r.exit_code == 0, r.output
    acc = json.loads(r.stdout)["accuracy"]
    assert acc["n"] == 8 and acc["a_accuracy"] == acc["b_accuracy"] >= 0.75  # the trained tiny model
    assert acc["diff_points"] == 0 and acc["holds"]


def test_bad_inputs_are_one_line_exit_2(urls) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one_line_error(invoke(f"http://127.0.0.1:{port}", urls["base"]), "cannot reach the endpoint")
    one_line_error(invoke(urls["base"], "--served-model", "llama"), "no model 'llama'")
    one_line_error(invoke(urls["base"], "base", "--a-set", "exit.policy=fixed"), "--a-set", "endpoint")
    one_line_error(invoke(urls["base"], urls["base"], "--bisect"), "--bisect needs two recipes")
    one_line_error(invoke(urls["base"], urls["base"], "--expect", "same"), "--expect same")
    one_line_error(invoke("base", "exactloop", "--expect", "noise"), "--expect applies when an arm")
    one_line_error(invoke("base", "exactloop", "--temperature", "0.7"), "--temperature applies when an arm")
    one_line_error(invoke(urls["base"], "--prompts", "/nonexistent/p.jsonl"), "--prompts", "no such file")
    one_line_error(invoke(urls["base"], "nosuchrecipe"), "nosuchrecipe")


def test_reference_judge_in_the_table_and_bad_references(urls, tmp_path) -> None:
    r = invoke(urls["base"], urls["early_exit"], "--reference", "ouro")
    assert r.exit_code == 0, r.output
    assert "reference ouro-tiny (float32, cpu): noise bfloat16 vs float32 over 12 positions" in r.stdout
    assert "Reference judge (first divergence)" in r.stdout and "arm B" in r.stdout
    one_line_error(invoke(urls["base"], "--reference", "llama"), "--reference llama", "unknown model")
    missing = tmp_path / "no-such-checkpoint"
    one_line_error(invoke(urls["base"], "--reference", str(missing)), "no such checkpoint directory")
    one_line_error(invoke(urls["base"], "--reference-device", "tpu"), "--reference-device tpu")
