"""`looptrace profile` roofline columns on ouro-tiny (CPU): rows, calls per token, device override."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from looptrace.cli.main import app

FAST = ["--model", "ouro", "--prompt-len", "16", "--decode-steps", "24"]  # 4 tokens of ouro-tiny
runner = CliRunner()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KINETO_LOG_LEVEL", "5")
        out = tmp_path_factory.mktemp("roof") / "p.json"
        result = runner.invoke(app, ["profile", *FAST, "--roofline-device", "h200", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_json_roofline_rows(profiled):
    block = profiled["windows"]["decode"]["roofline"]
    assert block["device"]["name"] == "NVIDIA H200 SXM" and block["dtype"] == "fp32"
    assert block["rows_per_call"] == 1.0 and block["context_tokens"] > 16  # prompt + generated tokens
    rows = {(r["op"], r["role"]): r for r in block["rows"]}
    # ouro-tiny: 4 layers x 4 loops; 4 norms per layer, the final norm and the exit gate once per loop
    assert rows[("attention", "core")]["calls_per_token"] == 16
    assert rows[("paged_attention", "core")]["calls_per_token"] == 16
    assert rows[("norm", "core")]["calls_per_token"] == 64
    assert rows[("norm", "-")]["calls_per_token"] == 4 and rows[("head", "-")]["calls_per_token"] == 1
    mlp = rows[("mlp", "core")]
    assert mlp["bytes_per_call"] == (3 * 64 * 176 + 2 * 64) * 4  # fp32 weights and rows of ouro-tiny
    assert mlp["floor_us_per_call"] == pytest.approx(mlp["bytes_per_call"] / 4.8e6)
    assert mlp["pct_of_peak"] == pytest.approx(100 * mlp["floor_us_per_call"] / mlp["us_per_call"])
    assert rows[("sample", "-")]["bytes_per_call"] is None  # not priced: n/a, not zero
    # every row of the profile's op x role breakdown is there, with the same time
    by_op_role = profiled["windows"]["decode"]["breakdown"]["by_op_role"]
    assert {(r["op"], r["role"]) for r in by_op_role} == set(rows)


def test_table_has_roofline_columns_and_cpu_default_is_na():
    result = runner.invoke(app, ["profile", *FAST])
    assert result.exit_code == 0, result.output
    assert "Decode roofline per op (device peaks n/a" in result.stdout
    assert "% of roofline" in result.stdout


def test_unknown_roofline_device_is_one_line_exit_2():
    result = runner.invoke(app, ["profile", *FAST, "--roofline-device", "tpu-v9"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "unknown device" in lines[0]
