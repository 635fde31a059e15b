"""Where the persistent Ouro loop faults: each launch shape alone in a child process (a CUDA fault ends the
process that hit it, so each gets its own), then the engine with the launch at several rows.

    python bench/persistent_loop_faults.py --out DIR [--layers 24] [--arms "p:8:2 p:5:1 ..."]
        [--engine-rows 8] [--engine-layers N]

An arm is FORM:ROWS:LOOKAHEAD[:j] (FORM p persistent, s staged; j `joint_rows`), run once eagerly at
Ouro-1.4B's shapes (`--layers` layers, contexts of 512+ keys) and synchronized: OK with the barrier waits that
gave up, or the error's first line. The engine arm runs `fast` with `kernels.persistent_loop` on Ouro-1.4B's
shapes (random weights; `--engine-layers` core layers, default all) at `--engine-rows` concurrent requests,
with `PersistentLoop.max_rows` raised to 8 so those rows take the launch, eagerly under
`CUDA_LAUNCH_BLOCKING=1` (the error is raised by the launch that caused it) and with CUDA graphs. Writes
DIR/persistent_loop_faults.md. CUDA only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_ARMS = "p:1:1 p:8:1 p:8:2 p:8:3 p:5:1 p:3:1 p:8:1:j p:8:2:j p:1:1:j s:8:2"
HEADS, HIDDEN, INTER = (16, 16, 128), 2048, 5632


def run_arm(spec: str, layers: int) -> None:
    """The child: one eager launch of one arm, synchronized."""
    import torch

    from looptrace.engine.kernels import persistent_loop as pl
    from tests.engine.kernels.test_persistent_loop import make_case

    form, rows, look, *flag = spec.split(":")
    gen = torch.Generator(device="cuda").manual_seed(11)
    ctx = [512 + 37 * i for i in range(int(rows))]
    case = make_case(gen, HEADS, HIDDEN, INTER, layers, ctx, page=16, device="cuda")
    tiles = pl.LoopTiles(lookahead=int(look), joint_rows=flag == ["j"])
    fn = pl.loop_persistent if form == "p" else pl.loop_staged
    out = fn(*case.args(), tiles=tiles)
    torch.cuda.synchronize()
    print(f"OK finite={bool(out.float().isfinite().all())} barrier_timeouts={pl.barrier_timeouts()}")


def run_engine(rows: int, graphs: bool, layers: int | None) -> None:
    """The child: `fast` + the persistent loop at `rows` concurrent requests."""
    from looptrace.engine import LLMEngine, SamplingParams
    from looptrace.engine.kernels import persistent_loop as pl
    from looptrace.engine.model_config import resolve_preset, with_overrides
    from looptrace.engine.models.ouro import PersistentLoop
    from looptrace.recipes import load_recipe

    PersistentLoop.max_rows = pl.MAX_ROWS  # every row count the kernel takes
    spec = resolve_preset("ouro-1.4b", "cuda")
    spec = spec if layers is None else with_overrides(spec, n_core=layers)
    sets = ["kernels.persistent_loop=true", f"cuda_graphs.enabled={str(graphs).lower()}"]
    engine = LLMEngine.from_spec(spec, load_recipe("fast", sets).config, device="cuda", seed=1)
    prompts = [[3 + (7 * i + j) % 1000 for j in range(512)] for i in range(rows)]
    engine.generate(prompts, SamplingParams(max_tokens=16))
    print(f"OK barrier_timeouts={pl.barrier_timeouts()}")


def child(args: list[str], env: dict | None = None, timeout: int = 120) -> str:
    """Runs this script as a child; its verdict line, or the error's first line."""
    try:
        done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=REPO)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"TIMEOUT after {timeout} s"
    lines = (done.stdout + done.stderr).splitlines()
    verdict = [line for line in lines if line.startswith("OK")]
    if verdict and done.returncode == 0:
        return verdict[-1]
    errors = [line for line in lines if "Error" in line or "error" in line]
    where = [line.strip() for line in lines if line.strip().startswith('File "' + str(REPO))]
    return f"FAULT rc={done.returncode}: {errors[0] if errors else lines[-1:]} (last frame: {where[-1:]})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--arms", default=DEFAULT_ARMS)
    ap.add_argument("--engine-rows", type=int, default=8)
    ap.add_argument("--engine-layers", type=int, default=None)
    ap.add_argument("--child-arm", help=argparse.SUPPRESS)
    ap.add_argument("--child-engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_arm:
        run_arm(args.child_arm, args.layers)
        return 0
    if args.child_engine:
        rows, graphs = args.child_engine.split(":")
        run_engine(int(rows), graphs == "graphs", args.engine_layers)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/persistent_loop_faults.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    if args.out is None:
        print("bench/persistent_loop_faults.py: --out DIR is required", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Persistent loop faults, {torch.cuda.get_device_name()}, {args.layers} layers", ""]
    lines += ["| arm (form:rows:lookahead[:j]) | verdict |", "|---|---|"]
    for spec in args.arms.split():
        verdict = child(["--child-arm", spec, "--layers", str(args.layers)])
        print(spec, verdict, flush=True)
        lines.append(f"| {spec} | {verdict} |")
    blocking = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for name, env, mode in (
        ("eager, CUDA_LAUNCH_BLOCKING=1", blocking, "eager"),
        ("CUDA graphs", None, "graphs"),
    ):
        layers = [] if args.engine_layers is None else ["--engine-layers", str(args.engine_layers)]
        verdict = child(["--child-engine", f"{args.engine_rows}:{mode}", *layers], env=env, timeout=240)
        print("engine", name, verdict, flush=True)
        lines.append(f"| engine fast, {args.engine_rows} requests, {name} | {verdict} |")
    (args.out / "persistent_loop_faults.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
