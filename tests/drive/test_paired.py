"""`looptrace.drive.paired`: cells, the interleaved schedule, dropped warm-ups, statistics and ratios."""

from __future__ import annotations

import math
import statistics
import weakref

import pytest

from looptrace.drive import paired
from looptrace.drive.paired import (
    GIB,
    BenchInputError,
    Cell,
    CellResult,
    RunResult,
    Spread,
    arm_overrides,
    interleave,
    kv_bytes_per_arm,
    parse_cell,
    parse_cells,
    run_paired,
)


# --- cells ----------------------------------------------------------------------------------------------
def test_parse_cell_forms() -> None:
    assert parse_cell("ouro-tiny:16/4@2", "huginn") == [Cell("ouro-tiny", 16, 4, 2)]
    assert parse_cell("16/4@2", "huginn") == [Cell("huginn", 16, 4, 2)]  # MODEL defaults to --model
    assert parse_cell(" ouro-1.4b:512/128@1,8,32 ", "ouro") == [
        Cell("ouro-1.4b", 512, 128, 1),
        Cell("ouro-1.4b", 512, 128, 8),
        Cell("ouro-1.4b", 512, 128, 32),
    ]
    cell = Cell("ouro-1.4b", 2048, 64, 8)
    assert cell.label == "ouro-1.4b:2048/64@8"
    assert parse_cell(cell.label, "x") == [cell]  # labels round-trip
    assert cell.shape == "ouro-1.4b 2048/64"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("ouro-tiny:16/4", "expected [MODEL:]PROMPT/OUTPUT@C"),
        ("ouro-tiny:16x4@2", "expected"),
        ("ouro-tiny:16/4@", "expected"),
        ("ouro-tiny:16/4@2,", "expected"),
        ("ouro-tiny:-1/4@2", "expected"),
        (":16/4@2", "expected"),
        ("", "expected"),
        ("ouro-tiny:0/4@2", "PROMPT must be >= 1"),
        ("ouro-tiny:16/1@2", "OUTPUT must be >= 2"),
        ("ouro-tiny:16/4@0", "C (concurrent requests) must be >= 1"),
        ("ouro-tiny:16/4@2,0", "must be >= 1, got 0"),
    ],
)
def test_bad_cells_are_one_line_errors(text: str, needle: str) -> None:
    with pytest.raises(BenchInputError) as exc:
        parse_cell(text, "ouro")
    message = str(exc.value)
    assert needle in message and "\n" not in message
    assert message.startswith(f"--cell {text.strip()!r}")


def test_duplicate_cells_rejected() -> None:
    with pytest.raises(BenchInputError, match="ouro-tiny:16/4@2 is given twice"):
        parse_cells(["ouro-tiny:16/4@1,2", "ouro-tiny:16/4@2"], "ouro")
    with pytest.raises(BenchInputError, match="given twice"):
        paired.check_unique([Cell("ouro-tiny", 16, 4, 2), Cell("ouro-tiny", 16, 4, 2)])
    assert parse_cells(["16/4@1", "ouro-tiny:16/4@2"], "ouro-tiny") == [
        Cell("ouro-tiny", 16, 4, 1),
        Cell("ouro-tiny", 16, 4, 2),
    ]


def test_table2_cells_and_references() -> None:
    cells = paired.expand_cell_set("table2")
    assert [c.label for c in cells] == [
        "ouro-1.4b:512/128@1",
        "ouro-1.4b:512/128@8",
        "ouro-1.4b:512/128@32",
        "ouro-1.4b:512/128@64",
        "ouro-1.4b:2048/64@8",
        "ouro-1.4b:2048/64@32",
        "huginn-0125:512/64@1",
        "huginn-0125:512/64@8",
        "huginn-0125:512/64@32",
        "huginn-0125:512/64@64",
    ]
    ref = paired.reference_for(Cell("huginn-0125", 512, 64, 64))
    assert (ref.base_tok_s, ref.exactloop_tok_s, ref.ratio) == (65.0, 205.3, 3.16)
    d = ref.to_dict()
    assert d["ttft_p50_ms"] == {"a": pytest.approx(22660.0), "b": pytest.approx(3950.0)}
    assert d["tpot_p50_ms"] == {"a": 270.1, "b": 121.0}
    for c in cells:  # the paper's rounded ratio agrees with its own throughputs
        r = paired.reference_for(c)
        assert r.exactloop_tok_s / r.base_tok_s == pytest.approx(r.ratio, abs=0.011)
    assert paired.reference_for(Cell("ouro-tiny", 512, 128, 8)) is None
    assert paired.reference_for(Cell("ouro-1.4b", 512, 64, 8)) is None  # output length matters
    with pytest.raises(BenchInputError, match="--cells 'table3': expected one of table2"):
        paired.expand_cell_set("table3")
    # One model's rows (the full set is longer than one 10-minute GPU job).
    assert paired.expand_cell_set("table2:huginn") == cells[6:]
    assert paired.expand_cell_set("table2:ouro-1.4b") == cells[:6]
    with pytest.raises(
        BenchInputError, match="no row of table2 is for 'olmo'; models: huginn-0125, ouro-1.4b"
    ):
        paired.expand_cell_set("table2:olmo")


# --- settings -------------------------------------------------------------------------------------------
def test_arm_overrides_order_user_wins() -> None:
    cell = Cell("ouro-tiny", 16, 4, 8)
    items = arm_overrides(cell, ["kv.block_size=32"], ["scheduler.max_num_seqs=1"], ["kv.num_blocks=64"])
    # The cell defaults first, so the user's own scheduler.max_num_seqs (applied later) wins.
    assert items == [
        "scheduler.max_num_seqs=8",
        "scheduler.max_num_batched_tokens=128",
        "scheduler.prefill_chunk_size=16",
        "kv.num_blocks=64",
        "kv.block_size=32",
        "scheduler.max_num_seqs=1",
    ]
    assert paired.sets_key(items, "kv.num_blocks")
    assert not paired.sets_key(items, "kv.num")
    assert paired.sets_key([" kv.gpu_memory_utilization =0.5"], "kv.gpu_memory_utilization")


def test_cell_defaults_prefill_the_burst_as_one_batch() -> None:
    """--prefill-batch whole (the paper's harness): C x PROMPT tokens in one prefill step, whole prompts
    per request; recipe: only the admission default, so the recipe's 128-token chunks stay."""
    from looptrace.engine.llm_engine import LLMEngine
    from looptrace.engine.request import SamplingParams
    from looptrace.recipes import load_recipe

    cell = Cell("ouro-tiny", 40, 2, 3)
    assert paired.cell_defaults(cell) == [
        "scheduler.max_num_seqs=3",
        "scheduler.max_num_batched_tokens=128",  # 3 x 40 = 120, never under vllm-rlt's 128
        "scheduler.prefill_chunk_size=40",
    ]
    assert paired.cell_defaults(Cell("ouro-1.4b", 512, 128, 64))[1:] == [
        "scheduler.max_num_batched_tokens=32768",
        "scheduler.prefill_chunk_size=512",
    ]
    assert paired.cell_defaults(cell, "recipe") == ["scheduler.max_num_seqs=3"]
    with pytest.raises(BenchInputError, match="--prefill-batch 'chunks': expected one of whole, recipe"):
        paired.cell_defaults(cell, "chunks")
    # On the engine: three 100-token prompts prefill in one step (whole) or in three steps of the
    # recipe's 128-token budget (recipe).
    long = Cell("ouro-tiny", 100, 1, 3)
    for mode, expected_steps in (("whole", 1), ("recipe", 3)):
        cfg = load_recipe("base", arm_overrides(long, [], [], (), mode)).config
        engine = LLMEngine.from_preset("ouro-tiny", cfg, device="cpu")
        for i in range(3):
            engine.add_request([1 + i] * 100, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats.steps_by_stage["prefill"] == expected_steps, mode


def test_kv_bytes_split_evenly() -> None:
    # 100 GiB free of 140, utilization 0.9: 14 GiB stay free; 2 x 3 GiB of weights; 1 GiB reserve per arm.
    per_arm = kv_bytes_per_arm(100 * GIB, 140 * GIB, 0.9, 6 * GIB)
    assert per_arm == pytest.approx((100 - 14 - 6 - 2) / 2 * GIB, abs=1)
    assert kv_bytes_per_arm(10 * GIB, 140 * GIB, 0.9, 6 * GIB) == 0  # never negative


# --- schedule and statistics ----------------------------------------------------------------------------
def test_interleave_order() -> None:
    assert interleave(3) == [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert interleave(2) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    for bad in (1, 0, -3):
        with pytest.raises(BenchInputError, match=f"--runs must be >= 2 .*got {bad}"):
            interleave(bad)


def test_spread_of_fixed_numbers() -> None:
    s = Spread.of([100.0, 110.0, 120.0])
    assert (s.mean, s.min, s.max, s.n) == (110.0, 100.0, 120.0, 3)
    assert s.std == pytest.approx(10.0)  # sample std (n - 1)
    assert Spread.of([5.0]).std == 0.0
    empty = Spread.of([])
    assert empty.n == 0 and math.isnan(empty.mean)
    assert s.to_dict() == {"mean": 110.0, "spread": {"min": 100.0, "max": 120.0, "std": s.std}, "n": 3}


def _metrics(tok: float, ttft: float = 10.0, tpot: float = 2.0) -> dict:
    return {"output_tok_s": tok, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot}


# Round 0 holds outliers (a warm-up): dropping it must leave them out of every statistic.
FIXED = {
    (0, "a"): _metrics(1000.0, 999.0, 99.0),
    (0, "b"): _metrics(5.0, 1.0, 1.0),
    (1, "a"): _metrics(100.0, 20.0, 4.0),
    (1, "b"): _metrics(200.0, 10.0, 2.0),
    (2, "a"): _metrics(110.0, 30.0, 6.0),
    (2, "b"): _metrics(230.0, 12.0, 2.0),
}


def test_first_run_dropped_mean_spread_ratio() -> None:
    cell = Cell("ouro-tiny", 16, 4, 2)
    result = CellResult(cell, [RunResult(r, arm, FIXED[r, arm]) for r, arm in interleave(3)])
    assert [r.dropped for r in result.runs] == [True, True, False, False, False, False]
    st = result.stats()
    a, b = st["a"]["output_tok_s"], st["b"]["output_tok_s"]
    assert (a.mean, a.min, a.max, a.n) == (105.0, 100.0, 110.0, 2)
    assert a.std == pytest.approx(statistics.stdev([100.0, 110.0]))
    assert (b.mean, b.min, b.max) == (215.0, 200.0, 230.0)
    assert st["a"]["ttft_p50_ms"].mean == 25.0
    ratio = result.ratios()
    assert ratio["output_tok_s"]["mean"] == pytest.approx(215.0 / 105.0)
    # Per-round ratios B_r / A_r of the kept rounds: 2.0 and 230/110.
    assert ratio["output_tok_s"]["min"] == pytest.approx(2.0)
    assert ratio["output_tok_s"]["max"] == pytest.approx(230.0 / 110.0)
    assert ratio["ttft_p50_ms"]["mean"] == pytest.approx(11.0 / 25.0)
    d = result.to_dict()
    assert d["cell"] == "ouro-tiny:16/4@2" and d["reference"] is None
    assert [(r["round"], r["arm"], r["dropped"]) for r in d["runs"]][:3] == [
        (0, "a", True),
        (0, "b", True),
        (1, "a", False),
    ]
    assert d["stats"]["b"]["output_tok_s"]["spread"] == {"min": 200.0, "max": 230.0, "std": b.std}


def test_zero_baseline_gives_nan_ratio_not_error() -> None:
    runs = [RunResult(r, arm, _metrics(0.0 if arm == "a" else 5.0)) for r, arm in interleave(2)]
    ratio = CellResult(Cell("m", 1, 2, 1), runs).ratios()["output_tok_s"]
    assert math.isnan(ratio["mean"]) and math.isnan(ratio["min"])


# --- orchestration through a fake backend --------------------------------------------------------------
class Handle:
    def __init__(self, cell: Cell, arm: str) -> None:
        self.cell, self.arm = cell, arm


class FakeBackend:
    """Records every call; hands out weakly-tracked handles to check they are freed between cells."""

    def __init__(self, interrupt_at: tuple[int, int, str] | None = None) -> None:
        self.log: list[tuple] = []
        self.refs: list[weakref.ref] = []
        self.interrupt_at = interrupt_at
        self.live_at_release: list[int] = []

    def build(self, cell: Cell, arm: str) -> Handle:
        self.log.append(("build", cell.concurrency, arm))
        h = Handle(cell, arm)
        self.refs.append(weakref.ref(h))
        return h

    def describe(self, handle: Handle) -> dict:
        return {"arm": handle.arm}

    def run(self, handle: Handle, cell: Cell, arm: str, round: int) -> dict:
        assert handle.arm == arm and handle.cell == cell  # each arm runs on its own engine
        self.log.append(("run", cell.concurrency, round, arm))
        if self.interrupt_at == (cell.concurrency, round, arm):
            raise KeyboardInterrupt
        return FIXED[round, arm]

    def release(self) -> None:  # handles hold no cycles: refcounting alone must have freed them
        self.live_at_release.append(sum(r() is not None for r in self.refs))
        self.log.append(("release",))


def test_run_paired_interleaves_and_frees_between_cells() -> None:
    backend = FakeBackend()
    events: list = []
    cells = [Cell("ouro-tiny", 16, 4, 1), Cell("ouro-tiny", 16, 4, 2)]
    results = list(run_paired(cells, 3, backend, lambda c, r, a, m: events.append((c.concurrency, r, a, m))))
    one_cell = lambda c: [  # noqa: E731
        ("build", c, "a"),
        ("build", c, "b"),
        *[("run", c, r, arm) for r in range(3) for arm in ("a", "b")],
        ("release",),
    ]
    assert backend.log == one_cell(1) + one_cell(2)
    assert backend.live_at_release == [0, 0]  # both engines gone before the next cell is built
    assert [r.cell for r in results] == cells
    assert results[0].arms == {"a": {"arm": "a"}, "b": {"arm": "b"}}
    assert results[1].stats()["a"]["output_tok_s"].mean == 105.0
    # on_run: a start (metrics None) and an end per run, in schedule order
    assert [(c, r, a) for c, r, a, m in events if m is None] == [
        (c, r, a) for c in (1, 2) for r in range(3) for a in ("a", "b")
    ]
    assert len(events) == 2 * 2 * 6


def test_interrupt_keeps_completed_cells_and_releases() -> None:
    backend = FakeBackend(interrupt_at=(2, 1, "b"))
    cells = [Cell("m", 16, 4, 1), Cell("m", 16, 4, 2), Cell("m", 16, 4, 3)]
    done = []
    with pytest.raises(KeyboardInterrupt):
        for result in run_paired(cells, 3, backend):
            done.append(result)
    assert [r.cell.concurrency for r in done] == [1]
    # release ran for the interrupted cell too (its handles may live on in the traceback's frames until
    # the caller handles the interrupt: the process is ending then anyway)
    assert backend.log[-1] == ("release",) and len(backend.live_at_release) == 2
    assert backend.live_at_release[0] == 0
    assert ("build", 3, "a") not in backend.log  # nothing after the interrupt
