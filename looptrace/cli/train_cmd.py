"""`looptrace train-tiny`: retrain a packaged tiny looped model from scratch (CPU, fixed seed)."""

from __future__ import annotations

import enum
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from looptrace.cli.common import fail

EPILOG = """
[bold]EXAMPLES[/bold]

  looptrace train-tiny --family huginn                 # rewrites looptrace/assets/huginn-tiny
  looptrace train-tiny --family ouro --out /tmp/ouro-tiny --steps 200

Task: 2-digit addition, answer most-significant digit first (looptrace/train/task.py). Fixed seed; the
directory gets config.json, model.safetensors, tokenizer.json, tokenizer_config.json, eval.jsonl and
train_meta.json (settings, wall time, teacher-forced exact match by depth).

[bold]EXIT CODES[/bold]  0 ok · 2 bad input
"""


class Family(str, enum.Enum):
    ouro = "ouro"
    huginn = "huginn"


def train_tiny(
    family: Annotated[Family, typer.Option(help="Which tiny preset to train.")],
    out: Annotated[
        Path | None, typer.Option(help="Output directory (default: the packaged looptrace/assets/<preset>).")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (default: the shipped run's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed (data, init, Huginn depth and noise).")] = 0,
    threads: Annotated[int, typer.Option(help="torch CPU threads (1 is faster on a busy machine).")] = 2,
) -> None:
    """Train ouro-tiny or huginn-tiny on the addition task and write a loadable checkpoint directory."""
    from looptrace.assets import ASSETS_DIR
    from looptrace.train.trainer import DEFAULTS, train

    cfg = DEFAULTS[family.value]
    if steps is not None and steps < 1:
        raise fail(f"--steps must be >= 1, got {steps}")
    if threads < 1:
        raise fail(f"--threads must be >= 1, got {threads}")
    cfg = replace(cfg, steps=steps or cfg.steps, seed=seed, threads=threads)
    target = out or ASSETS_DIR / cfg.preset
    if target.exists() and not target.is_dir():
        raise fail(f"--out {target}: exists and is not a directory")
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

        meta = train(cfg, target, on_step)
    console.print(
        f"wrote {target}  ({meta['wall_time_s']} s on {threads} thread(s); teacher-forced exact match by "
        f"depth {meta['dense_exact_by_depth']})"
    )
