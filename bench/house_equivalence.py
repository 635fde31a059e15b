"""Behaviour of one tree, recorded so that two trees (before and after a refactor of the engine) can be
compared: tokens, counters, rung grades and inactive settings on CPU, nothing timed.

    python bench/house_equivalence.py record --root DIR --out FILE.json   # DIR: a looptrace checkout
    python bench/house_equivalence.py compare BEFORE.json AFTER.json      # exit 1 on any difference
        [--new-setting SECTION.KEY]   # a setting added between the trees: left out of AFTER's configs

`record` runs, each in a subprocess with PYTHONPATH=DIR (so DIR's package is the one measured):
- `looptrace diff base exactloop` and `diff exactloop fast` (the latter with every fused GEMV form the
  recipe leaves off switched on, `--b-set`), JSON, for each model family;
- `looptrace diff base R` for every other recipe R x model family (tokens batched and alone, rung
  grades, and the settings R leaves inactive on this device);
- `looptrace run -r R` (counters: steps, submissions, stages, KV, graphs) for every recipe x family;
- `looptrace bench --a exactloop --b fast` on two cells (tokens and counters of each arm);
- the engine's `inactive_settings` and `checked_rungs` for every recipe x family, built through build.py.
Timings, paths and versions are dropped (`normalise`); what is left must be identical, except the rows of
settings whose result reads the wall clock (`WALL_CLOCK_SETTINGS`: LoopDuet's queue-age controller picks
P from how long requests have waited), which `compare` leaves out and counts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

FAMILIES = ("ouro", "huginn", "olmo")
RECIPES = ("base", "exactloop", "exactloop-cache", "fast", "loopduet")
FAST_FORMS_OFF = ("kernels.gemv_silu=true", "kernels.gemv_norm=true", "kernels.gemv_norm_out=true")
BENCH_CELLS = ("ouro-tiny:16/4@2", "huginn-tiny:16/4@1")
WALL_CLOCK_SETTINGS = ("depth.controller",)  # P from queue ages in seconds: differs run to run
# Keys whose values depend on the clock, the machine or the checkout's path.
VOLATILE = re.compile(
    r"(^|_)(s|ms|duration|elapsed|throughput|goodput|per_s|ttft|tpot|itl|e2el|time|seconds|spread|"
    r"speedup|ratio|weights|source|file|versions|device|command|recipe_source|wall|host)($|_)"
)

ENGINE_PROBE = r"""
import json, sys
try:
    from looptrace.build import BuildRequest, build
    def engine(recipe, family):
        return build(BuildRequest(model=family, recipe=recipe, device="cpu", dtype="float32")).engine
except ImportError:  # a tree from before build(): its two-step builder
    from looptrace.build import build_engine, preset_model
    def engine(recipe, family):
        return build_engine(preset_model(family, "cpu"), recipe=recipe, sets=[], device="cpu",
                            dtype="float32", seed=0, threads=1).engine
out = {}
for recipe in sys.argv[1].split(","):
    for family in sys.argv[2].split(","):
        e = engine(recipe, family)
        out[f"{recipe} x {family}"] = {"inactive": list(e.inactive_settings.items()),
                                       "rungs": dict(e.checked_rungs)}
print(json.dumps(out))
"""


def normalise(value, root: str):
    """The JSON with volatile keys dropped (recursively) and the checkout's path in strings replaced by
    `<root>`; lists keep their order."""
    if isinstance(value, dict):
        return {k: normalise(v, root) for k, v in value.items() if not VOLATILE.search(k.lower())}
    if isinstance(value, list):
        return [normalise(v, root) for v in value]
    return value.replace(root, "<root>") if isinstance(value, str) else value


def _run(root: Path, args: list[str]) -> object:
    env = {**os.environ, "PYTHONPATH": str(root), "TQDM_DISABLE": "1"}
    done = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: a diff found a difference, which is a recorded outcome
        return {"exit": done.returncode, "stderr": done.stderr.strip().splitlines()[-1:]}
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"exit": done.returncode, "stdout": done.stdout.strip().splitlines()[-3:]}


def _cli(root: Path, *args: str) -> object:
    return _run(root, [sys.executable, "-m", "looptrace", *args, "--device", "cpu", "-f", "json"])


def record(root: Path) -> dict:
    out: dict[str, object] = {}
    for family in FAMILIES:
        out[f"diff base exactloop -m {family}"] = _cli(root, "diff", "base", "exactloop", "-m", family)
        b_sets = [a for s in FAST_FORMS_OFF for a in ("--b-set", s)]
        out[f"diff exactloop fast -m {family} (forms on)"] = _cli(
            root, "diff", "exactloop", "fast", "-m", family, *b_sets
        )
        for recipe in RECIPES:
            if recipe not in ("base", "exactloop"):  # diff base exactloop is above
                out[f"diff base {recipe} -m {family}"] = _cli(root, "diff", "base", recipe, "-m", family)
            out[f"run -r {recipe} -m {family}"] = _cli(
                root, "run", "-r", recipe, "-m", family, "-c", "2", "--max-tokens", "4", "--no-progress"
            )
    cells = [a for c in BENCH_CELLS for a in ("--cell", c)]
    out["bench exactloop fast"] = _cli(
        root, "bench", "--a", "exactloop", "--b", "fast", *cells, "--runs", "2"
    )
    probe = [sys.executable, "-c", ENGINE_PROBE, ",".join(RECIPES), ",".join(FAMILIES)]
    out["engine inactive settings and checked rungs"] = _run(root, probe)
    return normalise(out, str(root))


def _without_wall_clock(value, skipped: list[str], where: str = ""):
    """`value` without the diff rows (toggles, accuracy by setting) of WALL_CLOCK_SETTINGS."""
    if isinstance(value, dict):
        return {k: _without_wall_clock(v, skipped, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        kept = []
        for item in value:
            setting = item.get("path", item.get("setting")) if isinstance(item, dict) else None
            if setting in WALL_CLOCK_SETTINGS:
                skipped.append(f"{where}: {setting}")
                continue
            kept.append(_without_wall_clock(item, skipped, where))
        return kept
    return value


def _without_keys(value, keys: set[str], dropped: list[str]):
    """The JSON without the named keys (a setting added between the trees appears in every recorded
    config with its default; `--new-setting` names it so the rest can be compared)."""
    if isinstance(value, dict):
        dropped += [k for k in value if k in keys]
        return {k: _without_keys(v, keys, dropped) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [_without_keys(v, keys, dropped) for v in value]
    return value


def compare(before: dict, after: dict, new_settings: tuple[str, ...] = ()) -> list[str]:
    """One line per differing entry (missing entries included)."""
    lines, skipped = [], []
    before, after = _without_wall_clock(before, skipped), _without_wall_clock(after, [])
    if skipped:
        print(f"left out (wall-clock settings {', '.join(WALL_CLOCK_SETTINGS)}): {len(skipped)} rows")
    if new_settings:
        dropped: list[str] = []
        after = _without_keys(after, {s.split(".")[-1] for s in new_settings}, dropped)
        print(f"left out (settings new in AFTER {', '.join(new_settings)}): {len(dropped)} values")
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a != b:
            lines.append(f"DIFFERS: {name}\n  before: {json.dumps(a)[:400]}\n  after:  {json.dumps(b)[:400]}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    rec.add_argument("--out", type=Path, required=True)
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    cmp_.add_argument(
        "--new-setting", action="append", default=[], help="SECTION.KEY added between the trees"
    )
    args = parser.parse_args()
    if args.command == "record":
        recorded = record(args.root.resolve())
        args.out.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        failed = [name for name, v in recorded.items() if isinstance(v, dict) and "exit" in v]
        for name in failed:  # a command that did not run is no evidence: say so
            print(f"FAILED: {name}: {recorded[name]}", file=sys.stderr)
        return 1 if failed else 0
    before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    lines = compare(before, after, tuple(args.new_setting))
    print("\n".join(lines) if lines else f"identical: {len(before)} entries")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
