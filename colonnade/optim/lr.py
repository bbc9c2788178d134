"""Learning-rate schedule: linear warmup, then one of ``optim.decay``
(:data:`colonnade.config.validate.LR_DECAYS` owns the list):

* 'cosine' / 'linear': from lr to min_lr over the steps after warmup;
* 'constant': lr;
* 'wsd' (warmup-stable-decay, MiniCPM / DeepSeek-V3): lr until the last D =
  ``optim.wsd_decay_steps(total)`` steps, then to min_lr along ``optim.decay_shape``
  ('linear' or '1-sqrt', Hagele et al. 2024), reaching min_lr on the last step;
* 'inverse_sqrt' (Megatron's inverse-square-root): lr * sqrt(W / n) at step n (from 1) after
  the W warmup steps, never below min_lr (training.steps does not shape it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from colonnade.config.sections import OptimConfig

SCHEDULE_FIELDS = {"total_steps": "training.steps", "lr": "optim.lr", "min_lr": "optim.min_lr",
                   "warmup_steps": "optim.warmup_steps", "decay": "optim.decay",
                   "decay_fraction": "optim.decay_fraction", "decay_shape": "optim.decay_shape"}
"""What decides the LR of every step, with the config field each comes from."""

WSD_FIELDS = ("decay_fraction", "decay_shape")
"""Schedule fields that only decay='wsd' reads (recorded as None for other decays)."""


def _wsd(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Stable lr, then the final decay: progress t = (step + 1 - start) / D in (0, 1]."""
    span = cfg.wsd_decay_steps(total_steps)
    t = min(1.0, max(0.0, (step + 1 - (total_steps - span)) / span))
    drop = math.sqrt(t) if cfg.decay_shape == "1-sqrt" else t
    return cfg.lr - (cfg.lr - cfg.min_lr) * drop


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """LR for optimizer step ``step`` (0-based) of ``total_steps``.

    warmup: lr * (step + 1) / warmup_steps; then with progress t = (step - warmup) / (total -
    warmup) in [0, 1]: cosine min + (lr - min)(1 + cos(pi t)) / 2, linear lr - (lr - min) t,
    constant lr; wsd and inverse_sqrt as in the module docstring.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "wsd":
        return _wsd(step, total_steps, cfg)
    if cfg.decay == "inverse_sqrt":
        return max(cfg.min_lr, cfg.lr * math.sqrt(max(1, cfg.warmup_steps) / (step + 1)))
    span = max(1, total_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    if cfg.decay == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * t
    return cfg.lr


def schedule_of(total_steps: int, cfg: OptimConfig) -> dict[str, Any]:
    """The schedule as plain values (what a checkpoint records), keys of SCHEDULE_FIELDS; the
    wsd-only fields are None under another decay, so changing them there is no change."""
    wsd = cfg.decay == "wsd"
    return {"total_steps": total_steps, "lr": cfg.lr, "min_lr": cfg.min_lr,
            "warmup_steps": cfg.warmup_steps, "decay": cfg.decay,
            **{k: getattr(cfg, k) if wsd else None for k in WSD_FIELDS}}


def with_schedule(cfg: OptimConfig, schedule: dict[str, Any]) -> tuple[int, OptimConfig]:
    """(total steps, ``cfg`` with the LR fields of ``schedule``); missing or None keys keep
    ``cfg``'s."""
    fields = {k: schedule[k] for k in SCHEDULE_FIELDS
              if k != "total_steps" and schedule.get(k) is not None}
    return int(schedule["total_steps"]), dataclasses.replace(cfg, **fields)
