"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from colonnade.config.sections import OptimConfig

SCHEDULE_FIELDS = {"total_steps": "training.steps", "lr": "optim.lr", "min_lr": "optim.min_lr",
                   "warmup_steps": "optim.warmup_steps", "decay": "optim.decay"}
"""What decides the LR of every step, with the config field each comes from."""


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """LR for optimizer step ``step`` (0-based) of ``total_steps``.

    warmup: lr * (step + 1) / warmup_steps; then with progress t in [0, 1]:
    cosine min + (lr - min)(1 + cos(pi t)) / 2, linear lr - (lr - min) t, constant lr.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    if cfg.decay == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * t
    return cfg.lr


def schedule_of(total_steps: int, cfg: OptimConfig) -> dict[str, Any]:
    """The schedule as plain values (what a checkpoint records), keys of SCHEDULE_FIELDS."""
    return {"total_steps": total_steps, "lr": cfg.lr, "min_lr": cfg.min_lr,
            "warmup_steps": cfg.warmup_steps, "decay": cfg.decay}


def with_schedule(cfg: OptimConfig, schedule: dict[str, Any]) -> tuple[int, OptimConfig]:
    """(total steps, ``cfg`` with the LR fields of ``schedule``); missing keys keep ``cfg``'s."""
    fields = {k: schedule[k] for k in ("lr", "min_lr", "warmup_steps", "decay") if k in schedule}
    return int(schedule["total_steps"]), dataclasses.replace(cfg, **fields)
