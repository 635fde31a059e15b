"""`looptrace bench`: a real paired run on the tiny CPU preset, bad input, table2 on CPU, Ctrl-C."""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looptrace.cli.main import app
from looptrace.cli.options import OutputFormat
from looptrace.drive import bench_report, bench_run, benchmark
from tests.cli.test_run_cli import assert_one_line_error

runner = CliRunner()
TINY = ["--cell", "ouro-tiny:16/4@2", "--runs", "3", "--a", "base", "--b", "base"]
TINY += ["--b-set", "scheduler.max_num_seqs=1", "--no-progress"]


def invoke(*args):
    return runner.invoke(app, ["bench", *map(str, args)])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One real run: arm B admits one request at a time. Every run_workload call is recorded (which
    engine, its max_num_seqs) to check the interleaving on the real engines."""
    out = tmp_path_factory.mktemp("bench")
    calls: list[tuple[int, int]] = []
    real = benchmark.run_workload

    def recording(engine, workload, **kw):
        calls.append((id(engine), engine.cfg.scheduler.max_num_seqs))
        return real(engine, workload, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(benchmark, "run_workload", recording)
        result = invoke(*TINY, "-o", out / "bench.json", "--plot", out / "speedup.svg")
    assert result.exit_code == 0, result.output
    return result, json.loads((out / "bench.json").read_text()), out, calls


def test_real_run_interleaves_the_two_engines(tiny_run) -> None:
    _, data, _, calls = tiny_run
    # A (max_num_seqs = C = 2), B (1), A, B, A, B: two engines, each built once, used alternately.
    assert [seqs for _, seqs in calls] == [2, 1, 2, 1, 2, 1]
    engine_a, engine_b = calls[0][0], calls[1][0]
    assert engine_a != engine_b
    assert [e for e, _ in calls] == [engine_a, engine_b] * 3
    assert [(r["round"], r["arm"]) for r in data["cells"][0]["runs"]] == [
        (0, "a"),
        (0, "b"),
        (1, "a"),
        (1, "b"),
        (2, "a"),
        (2, "b"),
    ]


def test_real_run_json(tiny_run) -> None:
    result, data, _, _ = tiny_run
    assert "{" not in result.stdout  # -o .json: JSON in the file, the table on the terminal
    assert "ouro-tiny" in result.stdout and result.stdout.rstrip().endswith(" lines)")
    assert data["schema"] == "looptrace.bench/1"
    h = data["header"]
    assert h["models"] == ["ouro-tiny"] and h["device"].startswith("CPU")
    assert h["arms"]["a"]["recipe"] == "base" and h["arms"]["a"]["overrides"] == []
    assert h["arms"]["b"]["overrides"] == ["scheduler.max_num_seqs=1"]
    assert {"looptrace", "torch", "python"} <= set(h["versions"])
    assert h["command"].startswith("looptrace") and (h["runs"], h["dropped_runs_per_arm"]) == (3, 1)
    assert h["interrupted"] is False
    [cell] = data["cells"]
    assert (cell["cell"], cell["prompt_len"], cell["output_len"], cell["concurrency"]) == (
        "ouro-tiny:16/4@2",
        16,
        4,
        2,
    )
    assert cell["arms"]["a"]["max_num_seqs"] == 2 and cell["arms"]["b"]["max_num_seqs"] == 1
    # The cell defaults (the burst admitted and prefilled whole), then the arm's own --b-set.
    assert cell["arms"]["b"]["overrides"] == [
        "scheduler.max_num_seqs=2",
        "scheduler.max_num_batched_tokens=128",
        "scheduler.prefill_chunk_size=16",
        "scheduler.max_num_seqs=1",
    ]
    assert h["cell_defaults"][:3] == [
        "scheduler.max_num_seqs=C",
        "scheduler.max_num_batched_tokens=max(128, C*PROMPT)",
        "scheduler.prefill_chunk_size=PROMPT",
    ]
    for run in cell["runs"]:
        assert run["dropped"] == (run["round"] == 0)
        assert (run["completed"], run["failed"], run["output_tokens"]) == (2, 0, 8)
        assert run["output_tok_s"] > 0 and run["ttft_p50_ms"] > 0 and run["tpot_p50_ms"] > 0
        # The override took effect: one request at a time costs twice the engine steps per token.
        assert run["steps_per_output_token"] == (2.5 if run["arm"] == "a" else 5.0)
    for arm in ("a", "b"):
        kept = [r for r in cell["runs"] if r["arm"] == arm and not r["dropped"]]
        for name in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms"):
            vals = [r[name] for r in kept]
            s = cell["stats"][arm][name]
            assert s["n"] == 2 and s["mean"] == pytest.approx(statistics.fmean(vals))
            assert s["spread"] == {
                "min": min(vals),
                "max": max(vals),
                "std": pytest.approx(statistics.stdev(vals)),
            }
    tok = cell["stats"]
    assert cell["ratio"]["output_tok_s"]["mean"] == pytest.approx(
        tok["b"]["output_tok_s"]["mean"] / tok["a"]["output_tok_s"]["mean"]
    )
    assert cell["reference"] is None


def test_real_run_plot_and_renderings(tiny_run) -> None:
    _, data, out, _ = tiny_run
    svg = (out / "speedup.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "ouro-tiny 16/4 measured" in svg  # the series label
    assert not [p for p in out.iterdir() if p.name.startswith(".looptrace-")]  # no temp files left
    table = bench_report.render(data, OutputFormat.table)
    assert "ouro-tiny:16/4@2" in table and "B/A [per round]" in table and "mean [min-max]" in table
    rows = list(csv.DictReader(io.StringIO(bench_report.render(data, OutputFormat.csv))))
    assert [r["metric"] for r in rows] == ["output_tok_s", "ttft_p50_ms", "tpot_p50_ms"]
    assert float(rows[0]["a_mean"]) == pytest.approx(data["cells"][0]["stats"]["a"]["output_tok_s"]["mean"])
    assert rows[0]["kept_runs"] == "2" and rows[0]["paper_ratio"] == ""


# --- bad input: one line, exit 2, before any engine is built --------------------------------------------
@pytest.mark.parametrize(
    "args, needles",
    [
        (["--cell", "ouro-tiny:16/4"], ["--cell 'ouro-tiny:16/4'", "PROMPT/OUTPUT@C"]),
        (["--cell", "ouro-tiny:16/1@2"], ["OUTPUT must be >= 2"]),
        (["--cell", "ouro-tiny:16/4@0"], ["must be >= 1"]),
        (["--cell", "nosuch:16/4@2"], ["--cell nosuch:16/4@2", "unknown model 'nosuch'"]),
        (["--cell", "ouro:16/4@2", "--cell", "ouro-tiny:16/4@2"], ["ouro-tiny:16/4@2 is given twice"]),
        (["--cell", "ouro-tiny:4000/200@1"], ["exceed ouro-tiny's 4096"]),
        (["--cell", "ouro-tiny:16/4@2", "--runs", "1"], ["--runs must be >= 2"]),
        ([], ["no cells", "--cell"]),
        (["--cells", "table2", "--cell", "ouro-tiny:16/4@2"], ["either --cells"]),
        (["--cells", "table9"], ["--cells 'table9'"]),
        (["--cell", "ouro-tiny:16/4@2", "--a", "nosuch"], ["unknown recipe 'nosuch'"]),
        (["--cell", "ouro-tiny:16/4@2", "--b-set", "bogus.key=1"], ["bogus"]),
        (["--cell", "ouro-tiny:16/4@2", "--plot", "speedup.txt"], ["--plot speedup.txt", ".svg"]),
        (["--cell", "ouro-tiny:16/4@2", "--seed", "-1"], ["--seed"]),
        (
            ["--cell", "ouro-tiny:16/4@2", "--prefill-batch", "chunks"],
            ["--prefill-batch 'chunks'", "whole, recipe"],
        ),
    ],
)
def test_bad_input(args, needles) -> None:
    assert_one_line_error(invoke(*args, "--device", "cpu", "--no-progress"), 2, *needles)


@pytest.mark.parametrize("name", ["table2", "table2:huginn"])
def test_table2_on_cpu_refused(name: str) -> None:
    line = assert_one_line_error(invoke("--cells", name, "--device", "cpu"), 2, f"--cells {name}")
    assert "CUDA" in line and "--cell ouro-tiny:" in line


def test_same_file_for_output_and_plot(tmp_path: Path) -> None:
    f = tmp_path / "x.svg"
    assert_one_line_error(invoke("--cell", "ouro-tiny:16/4@2", "-o", f, "--plot", f), 2, "same file")


# --- Ctrl-C and reference rows, with a fake engine side (no engines built) ------------------------------
class FakeBackend:
    def __init__(self, plan, interrupt_cell: int | None = None, fail_cell: int | None = None) -> None:
        self.interrupt_cell, self.fail_cell = interrupt_cell, fail_cell
        self.built = 0

    def build(self, cell, arm):
        if arm == "a":
            self.built += 1
        if self.built == self.interrupt_cell:
            raise KeyboardInterrupt
        return arm

    def describe(self, handle):
        return {"recipe": handle}

    def run(self, handle, cell, arm, round):
        if self.built == self.fail_cell and arm == "b":
            raise RuntimeError("Triton Error [CUDA]: invalid argument\nsecond line")
        tok = 100.0 if arm == "a" else 200.0 + round
        return {"output_tok_s": tok, "ttft_p50_ms": 50.0, "tpot_p50_ms": 5.0, "failed": 0}

    def release(self):
        pass


def test_interrupt_writes_completed_cells(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(bench_run, "EngineBackend", lambda plan: FakeBackend(plan, interrupt_cell=2))
    out = tmp_path / "partial.json"
    result = invoke(
        "--cell", "ouro-tiny:16/4@1,2,4", "--device", "cpu", "-o", out, "--plot", tmp_path / "p.png"
    )
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.stderr and "Traceback" not in result.output
    data = json.loads(out.read_text())
    assert data["header"]["interrupted"] is True
    assert data["header"]["cells_planned"] == ["ouro-tiny:16/4@1", "ouro-tiny:16/4@2", "ouro-tiny:16/4@4"]
    assert [c["cell"] for c in data["cells"]] == ["ouro-tiny:16/4@1"]
    assert data["cells"][0]["ratio"]["output_tok_s"]["mean"] == pytest.approx(201.5 / 100.0)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_cell_keeps_the_completed_cells_and_exits_1_without_a_traceback(
    tmp_path: Path, monkeypatch
):
    """H200, Table 2: Ouro 2048/64 C=32 raised inside a step; the bench printed a traceback and wrote
    none of the four cells completed before it."""
    monkeypatch.setattr(bench_run, "EngineBackend", lambda plan: FakeBackend(plan, fail_cell=2))
    out = tmp_path / "partial.json"
    result = invoke("--cell", "ouro-tiny:16/4@1,2,4", "--device", "cpu", "-o", out)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "second line" not in result.stderr
    assert (
        "cell ouro-tiny:16/4@2 failed: RuntimeError: Triton Error [CUDA]: invalid argument" in result.stderr
    )
    data = json.loads(out.read_text())
    assert [c["cell"] for c in data["cells"]] == ["ouro-tiny:16/4@1"]
    assert data["header"]["failed_cell"]["cell"] == "ouro-tiny:16/4@2"
    assert data["header"]["interrupted"] is False


def test_interrupt_before_any_cell_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(bench_run, "EngineBackend", lambda plan: FakeBackend(plan, interrupt_cell=1))
    out = tmp_path / "none.json"
    result = invoke("--cell", "ouro-tiny:16/4@1", "--device", "cpu", "-o", out)
    assert result.exit_code == 130 and "nothing written" in result.stderr
    assert not out.exists() and result.stdout == ""


def test_paper_numbers_beside_table2_cells(monkeypatch) -> None:
    # A Table 2 shape given as --cell (allowed on CPU; the fake backend builds nothing).
    monkeypatch.setattr(bench_run, "EngineBackend", lambda plan: FakeBackend(plan))
    result = invoke("--cell", "ouro-1.4b:512/128@8", "--device", "cpu", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "paper 339.9" in result.stdout and "paper 657.4" in result.stdout and "paper 1.93" in result.stdout
    assert "real-shape preset(s) ouro-1.4b on CPU" in result.stderr
    result = invoke("--cell", "ouro-1.4b:512/128@8", "--device", "cpu", "--no-progress", "-f", "json")
    ref = json.loads(result.stdout)["cells"][0]["reference"]
    assert ref["output_tok_s"] == {"a": 339.9, "b": 657.4, "ratio": 1.93}


# --- CUDA KV split, with the free-memory query faked (runs on CPU) --------------------------------------
def _cuda_plan(b_sets: list[str]):
    import torch

    from looptrace.drive.paired import Cell

    return bench_run.Plan(
        cells=[Cell("ouro-1.4b", 512, 128, 8)],
        runs=3,
        recipes={"a": "base", "b": "exactloop"},
        loaded={},
        shared=[],
        arm_sets={"a": [], "b": b_sets},
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        seed=0,
        threads=1,
        random_weights=False,
    )


def test_cuda_arms_get_equal_kv_bytes(monkeypatch) -> None:
    import torch

    from looptrace.drive.paired import GIB, kv_bytes_per_arm
    from looptrace.engine.kv_cache import LAYOUTS
    from looptrace.engine.model_config import PRESETS

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (130 * GIB, 140 * GIB))
    plan = _cuda_plan([])
    sets = bench_run.EngineBackend(plan)._pool_sets(plan.cells[0])
    spec = PRESETS["ouro-1.4b"]
    block_bytes = 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim * 2  # block 16, bf16
    weights = 2 * 2 * 1_434_652_673  # two arms' bf16 weights (parameter count of ouro-1.4b)
    budget = kv_bytes_per_arm(130 * GIB, 140 * GIB, 0.9, weights)
    blocks = {arm: int(items[0].split("=")[1]) for arm, items in sets.items()}
    assert set(sets) == {"a", "b"} and all(items[0].startswith("kv.num_blocks=") for items in sets.values())
    for arm, layout in (("a", "planes"), ("b", "packed")):
        per_page = LAYOUTS[layout](spec, spec.default_loops).blocks_per_page
        assert blocks[arm] % per_page == 0
        assert 0 <= budget - blocks[arm] * block_bytes < per_page * block_bytes  # equal bytes, to a page
    # An arm that sizes its own pool keeps it.
    plan = _cuda_plan(["kv.gpu_memory_utilization=0.4"])
    assert set(bench_run.EngineBackend(plan)._pool_sets(plan.cells[0])) == {"a"}


def test_cuda_without_room_for_two_arms(monkeypatch) -> None:
    import torch

    from looptrace.drive.paired import GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * GIB, 140 * GIB))
    plan = _cuda_plan([])
    from looptrace.drive.paired import BenchInputError

    with pytest.raises(BenchInputError, match="leave no KV memory"):
        bench_run.EngineBackend(plan)._pool_sets(plan.cells[0])


# --- --from: render a saved run, measure nothing ----------------------------------------------------------
def test_from_renders_a_saved_run_without_measuring(tiny_run, tmp_path: Path, monkeypatch) -> None:
    _, data, out, _ = tiny_run

    def no_engines(plan):
        raise AssertionError("--from must not build an engine")

    monkeypatch.setattr(bench_run, "EngineBackend", no_engines)
    result = invoke(
        "--from", out / "bench.json", "-o", tmp_path / "again.csv", "--plot", tmp_path / "again.svg"
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "again.csv").read_text() == bench_report.render(data, OutputFormat.csv) + "\n"
    assert "ouro-tiny 16/4 measured" in (tmp_path / "again.svg").read_text()
    table = invoke("--from", out / "bench.json")
    assert table.exit_code == 0 and "ouro-tiny:16/4@2" in table.stdout


@pytest.mark.parametrize(
    "content, needle",
    [(None, "no such file"), ("not json", "not a JSON file"), ('{"schema": "other"}', "looptrace.bench/1")],
)
def test_from_bad_file(tmp_path: Path, content, needle) -> None:
    path = tmp_path / "saved.json"
    if content is not None:
        path.write_text(content)
    assert_one_line_error(invoke("--from", path), 2, f"--from {path}", needle)


def test_table2_cells_run_both_arms_with_64_graphs(monkeypatch) -> None:
    # The paper's Table 2 setting; the device is faked (prepare builds no engine), --set still wins.
    import torch

    monkeypatch.setattr(bench_run, "resolve_device", lambda device: torch.device("cuda"))
    args = dict(a_sets=None, b_sets=None, model="ouro", cell=None, runs=3, device="cuda", dtype="auto")
    args.update(seed=0, threads=1, random_weights=False, output=None, plot=None)
    plan = bench_run.prepare(
        bench_run.BenchRequest("base", "exactloop", sets=None, cells="table2:ouro", **args)
    )
    assert plan.shared == ["cuda_graphs.max_graphs=64"]
    assert {arm: rec.config.cuda_graphs.max_graphs for arm, rec in plan.loaded.items()} == {"a": 64, "b": 64}
    plan = bench_run.prepare(
        bench_run.BenchRequest("base", "exactloop", sets=["cuda_graphs.max_graphs=8"], cells="table2", **args)
    )
    assert plan.loaded["a"].config.cuda_graphs.max_graphs == 8


def test_from_merges_runs_split_across_jobs(tiny_run, tmp_path: Path) -> None:
    _, data, out, _ = tiny_run
    second = json.loads(json.dumps(data))
    second["header"]["command"] = "looptrace bench --cell ouro-tiny:16/4@3 ..."
    second["header"]["cells_planned"] = ["ouro-tiny:16/4@3"]
    second["cells"][0]["cell"] = "ouro-tiny:16/4@3"
    second["cells"][0]["concurrency"] = 3
    (tmp_path / "second.json").write_text(json.dumps(second))
    result = invoke(
        "--from", out / "bench.json", "--from", tmp_path / "second.json", "-o", tmp_path / "all.json"
    )
    assert result.exit_code == 0, result.output
    merged = json.loads((tmp_path / "all.json").read_text())
    assert [c["cell"] for c in merged["cells"]] == ["ouro-tiny:16/4@2", "ouro-tiny:16/4@3"]
    assert merged["header"]["commands"] == [data["header"]["command"], second["header"]["command"]]
    table = invoke("--from", out / "bench.json", "--from", tmp_path / "second.json").stdout
    assert "ouro-tiny:16/4@3" in table and "ouro-tiny:16/4@3 ..." in table
    # the same cell twice, or another comparison, cannot be merged
    line = assert_one_line_error(invoke("--from", out / "bench.json", "--from", out / "bench.json"), 2)
    assert "ouro-tiny:16/4@2 is also in" in line
    second["header"]["arms"]["b"]["recipe"] = "exactloop"
    (tmp_path / "other.json").write_text(json.dumps(second))
    line = assert_one_line_error(invoke("--from", out / "bench.json", "--from", tmp_path / "other.json"), 2)
    assert "arms differ" in line


def test_runs_report_graph_fallbacks_by_graph_and_reason() -> None:
    """A run's record names which graph fell back and why, as deltas over the run (a whole-burst prefill
    step over cuda_graphs.max_batch_size counts `prefill/oversized_batch`)."""
    from types import SimpleNamespace

    from looptrace.drive.bench_run import _graph_totals

    counters = {
        "whole_token": {"captures": 1, "replays": 9, "fallbacks": 0, "fallback_reasons": {}},
        "prefill": {"captures": 0, "replays": 0, "fallbacks": 2, "fallback_reasons": {"oversized_batch": 2}},
    }
    totals = _graph_totals(SimpleNamespace(graph_counters=lambda: counters))
    assert totals == {"captures": 1, "replays": 9, "fallbacks": 2, "reasons": {"prefill/oversized_batch": 2}}
