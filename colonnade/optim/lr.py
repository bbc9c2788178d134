"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr."""

from __future__ import annotations

import math

from colonnade.config.sections import OptimConfig


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
