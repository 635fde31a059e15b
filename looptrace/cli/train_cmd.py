"""`looptrace train-tiny`: retrain a packaged tiny looped model from scratch (CPU, fixed seed)."""

from __future__ import annotations

import enum
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from looptrace.build import SEED_MAX
from looptrace.cli.common import UsageError, friendly_errors, interrupt_exit
from looptrace.cli.options import opt, thread_count
from looptrace.cli.output import output_dir, same_file

META_FILE = "train_meta.json"  # looptrace.train.trainer.META_FILE (not imported: it loads torch)

EPILOG = """
[bold]EXAMPLES[/bold]

  looptrace train-tiny --family huginn                 # writes ./looptrace-tiny-huginn/
  looptrace train-tiny --family ouro --out /tmp/ouro-tiny --steps 200
  looptrace train-tiny --family ouro --replace-shipped  # regenerate the packaged looptrace/assets/ouro-tiny

Task: 2-digit addition, answer most-significant digit first (looptrace/train/task.py). Fixed seed; the
directory gets config.json, model.safetensors, tokenizer.json, tokenizer_config.json, eval.jsonl and
train_meta.json (settings, wall time, teacher-forced exact match by depth). --out is checked before
training: a new or empty directory, or one an earlier train-tiny wrote (it is overwritten).

[bold]EXIT CODES[/bold]  0 ok · 2 bad input · 130 interrupted
"""

TRAIN_SEED_MAX = SEED_MAX - 1  # the evaluation generator is seeded with seed + 1


class Family(str, enum.Enum):
    ouro = "ouro"
    huginn = "huginn"


FamilyOpt = opt(Family, help="Which tiny preset to train.")
OutOpt = opt(Path | None, help="Output directory (default: ./looptrace-tiny-<family>).")
ReplaceShippedOpt = opt(
    bool,
    "--replace-shipped",
    help="Write over the packaged checkpoint (looptrace/assets/<preset>) that the tiny presets load.",
)
StepsOpt = opt(int | None, help="Optimizer steps (default: the shipped run's).")
TrainSeedOpt = opt(int, help="Seed (data, init, Huginn depth and noise).")
TrainThreadsOpt = opt(
    int,
    parser=thread_count,
    help="torch CPU threads (1 is faster on a busy machine; at most 4 x the CPU count).",
)


def train_tiny(
    family: FamilyOpt,
    out: OutOpt = None,
    replace_shipped: ReplaceShippedOpt = False,
    steps: StepsOpt = None,
    seed: TrainSeedOpt = 0,
    threads: TrainThreadsOpt = 2,
) -> None:
    """Train ouro-tiny or huginn-tiny on the addition task and write a loadable checkpoint directory."""
    # deferred: looptrace.assets resolves its directory at import: `looptrace --help` stays light
    from looptrace import assets

    with interrupt_exit("interrupted: no checkpoint written"), friendly_errors():
        preset = f"{family.value}-tiny"
        if steps is not None and steps < 1:
            raise UsageError(f"--steps must be >= 1, got {steps}")
        if not 0 <= seed <= TRAIN_SEED_MAX:
            raise UsageError(f"--seed {seed}: expected an integer from 0 to 2**64-2")
        shipped = assets.ASSETS_DIR / preset
        target = _target(out, replace_shipped, shipped, family.value)
        with output_dir(target, "--out", META_FILE, "train-tiny") as staging:  # checked before training
            meta = _train(family.value, staging, steps, seed, threads)  # swapped in whole when done
    Console(stderr=True, highlight=False).print(
        Text(
            f"wrote {target}  ({meta['wall_time_s']} s on {threads} thread(s); teacher-forced exact match by "
            f"depth {meta['dense_exact_by_depth']})"
        )
    )


def _target(out: Path | None, replace_shipped: bool, shipped: Path, family: str) -> Path:
    """Where to write: --out, the packaged checkpoint only with --replace-shipped, else a new directory."""
    if replace_shipped:
        if out is not None:
            raise UsageError("--replace-shipped writes the packaged checkpoint: leave out --out")
        return shipped
    target = out if out is not None else Path(f"looptrace-tiny-{family}")
    if target.exists() and same_file(target, shipped):
        raise UsageError(
            f"--out {target}: is the packaged checkpoint the tiny presets load; pass --replace-shipped "
            "(without --out) to replace it"
        )
    return target


def _train(family: str, target: Path, steps: int | None, seed: int, threads: int) -> dict:
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.train.trainer import DEFAULTS, train

    cfg = DEFAULTS[family]
    cfg = replace(cfg, steps=steps or cfg.steps, seed=seed, threads=threads)
    console = Console(stderr=True, highlight=False)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}  exact {task.fields[exact]:.2f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(f"train {cfg.preset}", total=cfg.steps, loss=0.0, exact=0.0)

        def on_step(step: int, metrics: dict) -> None:
            progress.update(task, completed=step, loss=metrics["loss"], exact=metrics["train_exact"])

        return train(cfg, target, on_step)
