"""Train a tiny looped model on the addition task (CPU, fixed seed, a few minutes) and write a checkpoint
directory the engine loads: config.json + model.safetensors + tokenizer.json (+ tokenizer_config.json),
plus the built-in evaluation set and a `train_meta.json` with the run's settings and measurements.

- Ouro: fixed depth (total_ut_steps = 4), cross-entropy after *every* loop (weighted toward the last) so
  earlier exits are usable, and the exit gate trained (BCE, detached target) to fire once the loop's
  prediction is already right.
- Huginn: randomized recurrence depth as in Huginn-0125: tau ~ N(log(r) - s^2/2, s), loops ~ Poisson(e^tau)
  + 1 (truncated to [1, 3r]), loss after the last loop only, backprop through the last k loops, random
  trunc-normal initial state (the engine's). Its state therefore converges with depth.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from looptrace.engine.model_config import PRESETS, ModelSpec, with_overrides
from looptrace.engine.models import LoopedModel, build_model
from looptrace.engine.weights import init_random
from looptrace.train.dense import forward_loops, make_dense
from looptrace.train.task import BOS, EOS, PAD, AdditionTask, eval_pairs, write_jsonl, write_tokenizer

EVAL_FILE = "eval.jsonl"
META_FILE = "train_meta.json"
EVAL_ITEMS = 500


@dataclass
class TrainConfig:
    family: str
    preset: str
    steps: int
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 100
    seed: int = 0
    digits: int = 2
    mean_loops: int = 4  # Ouro: the fixed depth; Huginn: the mean of the sampled depth
    grad_loops: int | None = None  # Huginn: truncated backprop through the last k loops
    depth_sigma: float = 0.5
    ouro_loss: str = "linear"  # Ouro: per-loop CE weights `linear` (1..T, normalised) or `final` (last only)
    device: str = "cpu"  # the shipped weights are trained on CPU; `cuda` is for quick sweeps
    threads: int = 2  # brief default; `--threads 1` is faster when other processes share the cores


DEFAULTS: dict[str, TrainConfig] = {
    "ouro": TrainConfig(family="ouro", preset="ouro-tiny", steps=2000, lr=1e-3, mean_loops=4),
    "huginn": TrainConfig(family="huginn", preset="huginn-tiny", steps=700, mean_loops=8, grad_loops=4),
}


def trained_spec(cfg: TrainConfig) -> ModelSpec:
    """The tiny preset's shape (so a shipped checkpoint is a drop-in for it) plus the task's special ids."""
    return with_overrides(PRESETS[cfg.preset], bos_token_id=BOS, eos_token_ids=(EOS,), pad_token_id=PAD)


def sample_depth(rng: np.random.Generator, mean: int, sigma: float) -> int:
    tau = rng.normal(math.log(mean) - 0.5 * sigma**2, sigma)
    return int(min(max(rng.poisson(math.exp(tau)) + 1, 1), 3 * mean))


def _loss(cfg: TrainConfig, model: LoopedModel, batch: torch.Tensor, loss_from: int, rng, gen):
    inputs, targets = batch[:, :-1], batch[:, loss_from + 1 :]
    if cfg.family == "ouro":
        logits, gates = forward_loops(
            model, inputs, cfg.mean_loops, every_loop=True, gen=gen, logits_from=loss_from
        )
        weights = torch.arange(1, len(logits) + 1, dtype=torch.float32)
        if cfg.ouro_loss == "final":
            weights = (weights == len(logits)).float()
        weights = weights / weights.sum()
        loss = 0.0
        for w, lg, gate in zip(weights, logits, gates):
            loss = loss + w * F.cross_entropy(lg.reshape(-1, lg.shape[-1]), targets.reshape(-1))
            right = (lg.argmax(-1) == targets).float()
            loss = loss + 0.1 * w * F.binary_cross_entropy_with_logits(gate[:, loss_from:], right)
        final = logits[-1]
        return loss, final, cfg.mean_loops
    loops = sample_depth(rng, cfg.mean_loops, cfg.depth_sigma)
    (logits,), _ = forward_loops(
        model, inputs, loops, grad_loops=cfg.grad_loops, gen=gen, logits_from=loss_from
    )
    final = logits
    return F.cross_entropy(final.reshape(-1, final.shape[-1]), targets.reshape(-1)), final, loops


def train(cfg: TrainConfig, out: Path, progress: Callable[[int, dict], None] | None = None) -> dict:
    """Train from scratch and write the checkpoint directory `out`; returns the metadata written."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    task = AdditionTask(cfg.digits)
    items = task.eval_items(EVAL_ITEMS)
    exclude = eval_pairs(items)
    spec = trained_spec(cfg)
    dev = torch.device(cfg.device)
    model = build_model(spec)
    init_random(model, cfg.seed)  # on CPU: the same initial weights whatever device trains
    model.to(dev)
    make_dense(model.train())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    loss_from = task.prompt_len - 1  # the "=" position predicts the first answer digit
    t0 = time.perf_counter()
    ema_loss, ema_acc = None, 0.0
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        batch = torch.from_numpy(task.batch(rng, cfg.batch_size, exclude)).to(dev)
        loss, final, loops = _loss(cfg, model, batch, loss_from, rng, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            exact = (final.argmax(-1) == batch[:, loss_from + 1 :]).all(-1).float().mean().item()
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        ema_acc = 0.95 * ema_acc + 0.05 * exact
        if progress is not None:
            progress(step + 1, {"loss": ema_loss, "train_exact": ema_acc, "loops": loops})
    wall = time.perf_counter() - t0
    model.eval()
    meta_extra = {"dense_exact_by_depth": dense_exact_by_depth(model, cfg, items)}
    return save_trained(model.cpu(), cfg, out, items, wall, ema_loss or 0.0, ema_acc, meta_extra)


@torch.no_grad()
def dense_exact_by_depth(model: LoopedModel, cfg: TrainConfig, items, depths=(1, 2, 4, 8, 16)) -> dict:
    """Teacher-forced exact match on the eval set (every answer token the argmax <=> greedy exact match)."""
    task = AdditionTask(cfg.digits)
    dev = next(model.parameters()).device
    rows = [task.encode_prompt(it["prompt"]) + task.encode_answer(it["answer"]) for it in items]
    batch = torch.tensor(rows, device=dev)
    loss_from = task.prompt_len - 1
    gen = torch.Generator(device=dev).manual_seed(cfg.seed + 1)
    out = {}
    for d in depths:
        (logits,), _ = forward_loops(model, batch[:, :-1], d, gen=gen, logits_from=loss_from)
        out[d] = round((logits.argmax(-1) == batch[:, loss_from + 1 :]).all(-1).float().mean().item(), 4)
    return out


def save_trained(
    model: LoopedModel, cfg: TrainConfig, out: Path, items, wall: float, loss, acc, extra: dict
) -> dict:
    # deferred: loads torch
    from looptrace.engine.checkpoint import save_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    model.requires_grad_(False)
    save_checkpoint(model, out)
    write_tokenizer(out)
    write_jsonl(items, out / EVAL_FILE)
    meta = {
        "task": f"addition, {cfg.digits} digits, answer most-significant digit first",
        "train_config": asdict(cfg),
        "wall_time_s": round(wall, 1),
        "torch_threads": cfg.threads,
        "final_train_loss_ema": round(float(loss), 4),
        "final_train_exact_ema": round(float(acc), 4),
        "torch": torch.__version__,
        **extra,
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    for path in out.iterdir():  # safetensors writes 0600; package data should be world-readable
        path.chmod(0o644)
    return meta
