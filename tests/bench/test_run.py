"""bench/run.py, the suite's entry point, and the results the docs cite (bench/ is loaded by path)."""

from __future__ import annotations

import importlib.util
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
RESULTS = BENCH / "results"


def load_run():
    spec = importlib.util.spec_from_file_location("bench_run_entry", BENCH / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # registered first, for its dataclass
    spec.loader.exec_module(module)
    return module


run = load_run()
SCRIPT_MODES = sorted(m for m, mode in run.MODES.items() if mode.argv[1] != "-m")
LOOPTRACE_MODES = sorted(m for m, mode in run.MODES.items() if mode.argv[1] == "-m")


@pytest.mark.parametrize("mode", LOOPTRACE_MODES)
def test_looptrace_modes_use_options_the_cli_has(mode, tmp_path):
    """Click parses every option before it acts on --help, so a misspelt option in a mode fails here."""
    from looptrace.cli.main import app

    args = run.command(mode, tmp_path, [])[3:]  # after `python -m looptrace`
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert not any(tmp_path.iterdir())


def test_script_modes_run_scripts_of_the_suite():
    for mode in SCRIPT_MODES:
        script = Path(run.MODES[mode].argv[1])
        assert script.parent == BENCH and script.is_file(), (mode, script)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("mode", [m for m in SCRIPT_MODES if run.MODES[m].device == "cuda"])
def test_gpu_scripts_stop_on_a_cpu_with_one_line(mode, tmp_path, monkeypatch, capsys):
    """Arguments parsed (argparse would print a usage instead), then one line and exit 2, nothing written.
    Run in this process (`runpy`), as `python SCRIPT` would, so torch is imported once for all of them."""
    argv = run.command(mode, tmp_path, [])[1:]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put bench/ first
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(argv[0], run_name="__main__")
    assert exc.value.code == 2
    refusal = f"bench/{Path(argv[0]).name}: needs CUDA (no GPU found)"
    assert capsys.readouterr().err.strip().splitlines() == [refusal]
    assert not any(tmp_path.iterdir())


def test_unknown_mode_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        run.main(["bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown mode 'bogus'" in err[0] and "table2" in err[0]


def test_dry_run_prints_the_command_and_writes_nothing(tmp_path, capsys):
    assert run.main(["fast-cells", "--dry-run", "--out", str(tmp_path / "out"), "--", "--runs", "5"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("python -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32")
    assert line.endswith(f"-o {tmp_path / 'out'}/bench_exactloop_fast_ouro.json --runs 5")
    assert not (tmp_path / "out").exists()


def test_a_run_records_commit_versions_command_and_exit_code(tmp_path, monkeypatch):
    code = "import sys; open(sys.argv[1], 'w').write('x'); sys.exit(3)"
    child = (sys.executable, "-c", code, "{out}/r.txt")
    monkeypatch.setitem(run.MODES, "probe", run.Mode("a child that writes one file", "any", child))
    assert run.main(["probe", "--out", str(tmp_path)]) == 3
    assert (tmp_path / "r.txt").read_text() == "x"
    stamp, shown, code = (tmp_path / "commands.txt").read_text().splitlines()
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ commit [0-9a-f]{7,}(\+dirty)?; python 3\.", stamp)
    assert f"torch {torch.__version__}" in stamp and "device: " in stamp
    assert shown.startswith("  $ python -c ") and shown.endswith(f"{tmp_path}/r.txt")
    assert code == "  exit 3"


def test_readme_and_device_script_name_only_real_modes():
    readme = (BENCH / "README.md").read_text()
    for mode in run.MODES:
        assert f"| `{mode}` |" in readme, mode
    device = (BENCH / "device.sh").read_text()
    used = set(re.findall(r"^\s*measure \d+ ([a-z0-9-]+)", device, flags=re.M))
    assert used and used <= set(run.MODES), used - set(run.MODES)


def cited_results() -> list[tuple[str, str]]:
    """(where, path or glob) for every result file the docs, comments and recipes point at."""
    cites = []
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "recipes").glob("*.yaml"),
                *(REPO / "looptrace").rglob("*.py")]:  # fmt: skip
        # (a path after "git show COMMIT:" names a file in git history, not in the tree)
        for path in re.findall(r"(?<!:)bench/results/[\w./*{},-]*[\w*/]", doc.read_text()):
            cites.append((doc.name, path))
    # the results README names files relative to bench/results/, in backticks
    for path in re.findall(r"`((?:h100|h200|cpu-2core)/[^`\s]+)`", (RESULTS / "README.md").read_text()):
        cites.append(("bench/results/README.md", "bench/results/" + path))
    return cites


def expand(path: str) -> list[str]:
    """`a_{x,y}.md` -> [`a_x.md`, `a_y.md`]."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for alt in match[1].split(",") for p in expand(head + alt + tail)]


def test_every_cited_result_is_committed():
    cites = cited_results()
    assert len(cites) > 20
    missing = [(where, p) for where, cite in cites for p in expand(cite) if not list(REPO.glob(p))]
    assert not missing


def test_results_are_filed_by_card_what_and_call():
    call = r"\d{4}-\d\d-\d\d_[0-9a-f]{7}_[\w.+-]+"  # date_commit_name
    pattern = re.compile(rf"(h100|h200|cpu-2core)/[a-z0-9-]+/({call}|table2_h200\.\w+)")
    files = [p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file()]
    assert "README.md" in files
    assert [f for f in files if f != "README.md" and not pattern.fullmatch(f)] == []
