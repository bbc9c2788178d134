"""Numerical guard: a NaN/Inf loss or gradient is caught on the step it happens.

Detection costs nothing extra: the step's loss is already all-reduced over the world
(``mean_loss``) and the optimizer already computes the global gradient norm, which is NaN/Inf
exactly when some gradient entry is (or the sum of squares overflows); it skips the update and
reports ``skipped = 1``. Every rank therefore sees the same verdict on the same step, and only
then does this module pay for a diagnosis: each rank scans its own gradients and parameters for
non-finite entries and the names are gathered over the world, so the message says which
parameter, on which rank, holds how many NaN/Inf entries.

``training.on_nan``:
  'stop'  raise :class:`NonFiniteError` before anything of that step is saved: the parameters
          are untouched (the update was skipped) and the last checkpoint stays the last good one;
  'skip'  drop the step (no update), log it, continue.
With fp16, an overflowing gradient is the dynamic loss scaler's business (it skips the step and
lowers the scale), so it is not an error unless the scale is already at ``optim.min_loss_scale``;
a non-finite *loss* is an error with every precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from colonnade.checkpoint.state import TrainState
from colonnade.models.params import grad_of, unique_params
from colonnade.parallel.groups import ProcessGroups

MAX_NAMED = 8
"""Parameters named in a message (the count of the rest is given)."""


class NonFiniteError(FloatingPointError):
    """A NaN/Inf loss or gradient with ``training.on_nan='stop'``; names step and parameters."""


@dataclass(frozen=True)
class BadTensor:
    """Non-finite entries found in one tensor on one rank."""

    rank: int
    coords: str
    """'tp 1 pp 0 dp 0'."""
    name: str
    """Global parameter name, with ' (grad)' or ' (value)'."""
    nan: int
    inf: int
    numel: int

    def describe(self) -> str:
        """'layers.0.mlp.fc1.weight (grad) on rank 1 (tp 1 pp 0 dp 0): 3 NaN, 0 Inf of 512'."""
        return (f"{self.name} on rank {self.rank} ({self.coords}): {self.nan} NaN, {self.inf} "
                f"Inf of {self.numel}")


def _count(t: torch.Tensor) -> tuple[int, int]:
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return nan, inf


def _shard_pieces(ddp: Any) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]:
    """ZeRO-2/3: (param, owned gradient piece, owned value piece) per owned piece (the full
    gradient, and at stage 3 the full value, exist on no rank)."""
    out = []
    for (lo, hi), grad, values in zip(ddp.owned_ranges(), ddp.owned_grads(),
                                      ddp.owned_params(), strict=True):
        for p, a, b in ddp.buffers.segments(lo, hi):
            out.append((p, grad[a - lo:b - lo], values[a - lo:b - lo]))
    return out


def local_bad_tensors(chunks: list[nn.Module], groups: ProcessGroups,
                      ddp: Any = None) -> list[BadTensor]:
    """This rank's parameters whose gradient or value holds NaN/Inf (the diagnosis; slow path).
    With ZeRO-2/3 (``ddp`` given with sharded gradients) the owned shard pieces are scanned."""
    coords = f"tp {groups.tp.rank} pp {groups.pp.rank} dp {groups.dp.rank}" + (
        f" cp {groups.cp.rank}" if groups.cp.size > 1 else "")
    out = []
    if ddp is not None and getattr(ddp, "grad_shards", None) is not None:
        for p, grad, value in _shard_pieces(ddp):
            key = getattr(getattr(p, "sharding", None), "key", None) or f"param{id(p)}"
            for what, t in (("grad", grad), ("value", value)):
                if not bool(torch.isfinite(t).all()):
                    nan, inf = _count(t)
                    out.append(BadTensor(groups.rank, coords, f"{key} ({what}, shard piece)",
                                         nan, inf, t.numel()))
        return out
    for p in unique_params(chunks):
        key = getattr(getattr(p, "sharding", None), "key", None) or f"param{id(p)}"
        for what, t in (("grad", grad_of(p)), ("value", p.detach())):
            if t is None or bool(torch.isfinite(t).all()):
                continue
            nan, inf = _count(t)
            out.append(BadTensor(groups.rank, coords, f"{key} ({what})", nan, inf, t.numel()))
    return out


def gather_bad_tensors(chunks: list[nn.Module], groups: ProcessGroups,
                       ddp: Any = None) -> list[BadTensor]:
    """Every rank's non-finite tensors, in rank order (collective over the world group)."""
    per_rank = groups.world.all_gather_object(local_bad_tensors(chunks, groups, ddp))
    return [bad for found in per_rank for bad in found]


def describe_bad(bad: list[BadTensor], total_params: int) -> str:
    """A readable list: the first :data:`MAX_NAMED` tensors and a count of the rest."""
    if not bad:
        return "no parameter holds a NaN/Inf (the loss itself overflowed)"
    names = sorted({b.name.split(" (")[0] for b in bad})
    lines = [b.describe() for b in bad[:MAX_NAMED]]
    more = f"; and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else ""
    scope = (f"{len(names)} of {total_params} parameters affected"
             + (" (all: the forward pass already produced it)" if len(names) >= total_params
                else ""))
    return f"{scope}: " + "; ".join(lines) + more


def is_bad_step(metrics: dict[str, float], precision: str, at_min_scale: bool) -> str | None:
    """Why this step is non-finite ('loss' / 'gradient'), or None when it is fine."""
    if not math.isfinite(metrics["loss"]):
        return "loss"
    if metrics.get("skipped", 0.0) > 0 and (precision != "fp16" or at_min_scale):
        return "gradient"
    return None


def check_step(trainer: TrainState, metrics: dict[str, float]) -> None:
    """Apply ``training.on_nan`` to the step just taken (``trainer.step`` already advanced).

    Collective when the step is bad (every rank decides alike: loss and norm are global).
    Raises :class:`NonFiniteError` for 'stop'; prints the skip on rank 0 for 'skip'.
    """
    cfg = trainer.config
    scaler = getattr(trainer.optimizer, "scaler", None)
    at_min = scaler is not None and float(getattr(scaler, "scale", 1.0)) <= cfg.optim.min_loss_scale
    what = is_bad_step(metrics, cfg.training.precision, at_min and cfg.training.precision == "fp16")
    if what is None:
        return
    bad = gather_bad_tensors(trainer.chunks, trainer.groups,
                             getattr(trainer.optimizer, "ddp", None))
    total = len({getattr(p.sharding, "key", id(p)) for p in unique_params(trainer.chunks)})
    where = describe_bad(bad, total)
    step = trainer.step
    head = (f"non-finite {what} at step {step} (loss {metrics['loss']}, gradient norm "
            f"{metrics.get('grad_norm', float('nan'))}): {where}")
    if cfg.training.on_nan == "stop":
        applied = "was not applied" if metrics.get("skipped", 0.0) > 0 else "was applied"
        raise NonFiniteError(
            f"{head}. The update of step {step} {applied} and nothing of it was saved (the last "
            "checkpoint is the last good one). Fix: lower optim.lr, keep optim.clip_grad > 0, use "
            "bf16 instead of fp16, or set training.on_nan='skip' to drop such steps.")
    if trainer.groups.rank == 0:
        print(f"colonnade: skipped step {step} ({head}); training.on_nan='skip'", flush=True)
