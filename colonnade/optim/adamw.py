"""The AdamW update on lists of flat tensors (``torch._foreach_*``), decoupled weight decay.

For step t >= 1, learning rate lr, gradient g = c G (G the main gradient as stored, c the
unscale-and-clip coefficient, applied on the fly so G stays as it was):
    w <- w (1 - lr wd)                       (decayed ranges only)
    m <- beta1 m + (1 - beta1) c G
    v <- beta2 v + (1 - beta2) c^2 G^2
    w <- w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
the update of ``torch.optim.AdamW``; each list entry is one flat range of the master weights
(a whole buffer, or one ZeRO-1 shard of one bucket).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWHyper:
    """Hyper-parameters of one update."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@torch.no_grad()
def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor],
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 decayed: list[torch.Tensor], step: int, hp: AdamWHyper,
                 grad_scale: float = 1.0) -> None:
    """In-place AdamW step ``step`` (1-based) on aligned lists of flat tensors.

    ``decayed`` holds views of ``params`` that weight decay applies to (matrices, not norms or
    biases); shapes of params[i], grads[i], exp_avgs[i], exp_avg_sqs[i] are equal. The
    gradients are read as ``grad_scale * grads`` and left unchanged.
    """
    if not params:
        return
    if hp.weight_decay and decayed:
        torch._foreach_mul_(decayed, 1.0 - hp.lr * hp.weight_decay)
    if grad_scale == 1.0:
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - hp.beta1)
    else:
        torch._foreach_mul_(exp_avgs, hp.beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=(1.0 - hp.beta1) * grad_scale)
    torch._foreach_mul_(exp_avg_sqs, hp.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads,
                            value=(1.0 - hp.beta2) * grad_scale * grad_scale)
    step_size = hp.lr / (1.0 - hp.beta1**step)
    bias2_sqrt = math.sqrt(1.0 - hp.beta2**step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, hp.eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)
