"""AdamW over fp32 master weights with global-norm clipping.

Model parameters may be bf16/fp16; the optimizer keeps an fp32 master copy of each (fp64 runs
and fp32 runs use the parameters themselves) and Adam moments in the master dtype:
4 (master) + 4 + 4 (moments) = 12 bytes per parameter for mixed precision.
Step: grads -> master grads; norm over every group (:mod:`colonnade.optim.clip`); scale by the
clip coefficient; AdamW update with the scheduled LR; copy masters back into the model.
Weight decay skips 1-D parameters (norms, biases).

This is the plain per-tensor optimizer (no buckets, no dp sharding; gradients from ``.grad`` or
``main_grad``) kept for single-process use and tests. Training uses
:class:`colonnade.optim.distributed.DistributedOptimizer` over the flat data-parallel buffers
(DDP or ZeRO-1, fp16 loss scaling).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colonnade.config.sections import OptimConfig
from colonnade.optim.clip import clip_coefficient, global_norm, owns_grad
from colonnade.optim.lr import lr_at
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.grads import grad_of, unique_params


class AdamWOptimizer:
    """Mixed-precision AdamW for this rank's parameters (not sharded across dp)."""

    def __init__(self, chunks: list[nn.Module], cfg: OptimConfig, groups: ProcessGroups,
                 total_steps: int) -> None:
        self.cfg, self.groups, self.total_steps = cfg, groups, total_steps
        self.params = unique_params(chunks)
        self.masters = [p if p.dtype in (torch.float32, torch.float64)
                        else nn.Parameter(p.detach().float().clone()) for p in self.params]
        decay = [m for m, p in zip(self.masters, self.params, strict=True) if p.ndim > 1]
        no_decay = [m for m, p in zip(self.masters, self.params, strict=True) if p.ndim <= 1]
        self.inner = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        self.step_count = 0

    def zero_grad(self) -> None:
        """Drop all gradients (model and master)."""
        for p, m in zip(self.params, self.masters, strict=True):
            p.grad = None
            m.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient over the whole model."""
        tp_rank = self.groups.tp.rank
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            g = grad_of(p)
            if g is not None and owns_grad(p, tp_rank):
                sq += g.detach().to(torch.float64).pow(2).sum()
        return global_norm(sq, [self.groups.tp, self.groups.pp])

    def step(self) -> dict[str, float]:
        """One update; returns grad_norm and lr."""
        norm = self.grad_norm()
        coef = clip_coefficient(norm, self.cfg.clip_grad)
        for p, m in zip(self.params, self.masters, strict=True):
            g = grad_of(p)
            if g is None:
                continue
            m.grad = g.to(m.dtype) * coef if (coef != 1.0 or m is not p) else g
        lr = lr_at(self.step_count, self.total_steps, self.cfg)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                if m is not p:
                    p.copy_(m)
        self.step_count += 1
        return {"grad_norm": float(norm), "lr": lr}

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state plus the step counter."""
        return {"inner": self.inner.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.inner.load_state_dict(state["inner"])
        self.step_count = int(state["step_count"])
