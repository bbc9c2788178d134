"""The AdamW update on lists of flat tensors, decoupled weight decay.

For step t >= 1, learning rate lr, gradient g = c G (G the main gradient as stored, c the
unscale-and-clip coefficient):
    w <- w (1 - lr wd)                       (decayed ranges only)
    m <- beta1 m + (1 - beta1) g
    v <- beta2 v + (1 - beta2) g^2
    w <- w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
the update of ``torch.optim.AdamW``; each list entry is one flat range of the master weights
(a whole buffer, one ZeRO-1 shard of one bucket, or a piece of one: see :class:`FlatAdamW`).

Two kernels compute it, chosen in one place (:func:`fused_supported`):
  * ``torch._fused_adamw_``: one pass over w, g, m, v (the kernel of ``torch.optim.AdamW(
    fused=True)``), when it supports the device and dtype (fp32 and fp64 on CPU; CUDA);
  * :func:`adamw_update`: the ``torch._foreach_*`` form, everywhere else.
Both agree with ``torch.optim.AdamW`` to the last bit or two (float64 relative error < 1e-15).
With c != 1 the fused path first multiplies the gradients in place by c in their own dtype (as
``torch.nn.utils.clip_grad_norm_`` does): the kernel's ``grad_scale`` is a float32 tensor, which
would round c for fp64 runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWHyper:
    """Hyper-parameters of one update."""

    lr: float
    """Learning rate of this step."""
    beta1: float
    """First-moment decay."""
    beta2: float
    """Second-moment decay."""
    eps: float
    """Added to sqrt(v_hat) in the denominator."""
    weight_decay: float
    """Decoupled decay factor (applied to the decayed ranges only)."""


@torch.no_grad()
def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor],
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 decayed: list[torch.Tensor], step: int, hp: AdamWHyper,
                 grad_scale: float = 1.0) -> None:
    """In-place AdamW step ``step`` (1-based) on aligned lists of flat tensors (foreach form).

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


@functools.cache
def fused_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._fused_adamw_`` runs on ``device_type`` for ``dtype`` (probed once on two
    elements and checked against the foreach form; False when the kernel is missing)."""
    fused = getattr(torch, "_fused_adamw_", None)
    if fused is None:
        return False
    device = torch.device(device_type)
    hp = AdamWHyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.5)
    try:
        w, g = (torch.tensor(v, dtype=dtype, device=device) for v in ([1.0, -2.0], [0.5, 3.0]))
        ref = [t.clone() for t in (w, g, torch.zeros_like(w), torch.zeros_like(w))]
        state = [w, g, torch.zeros_like(w), torch.zeros_like(w)]
        step = torch.ones((), dtype=torch.float32, device=device)
        fused([state[0]], [state[1]], [state[2]], [state[3]], [], [step], lr=hp.lr,
              beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
              amsgrad=False, maximize=False)
        adamw_update([ref[0]], [ref[1]], [ref[2]], [ref[3]], [ref[0]], 1, hp)
        return bool(torch.allclose(state[0], ref[0], rtol=1e-5, atol=0))
    except (RuntimeError, NotImplementedError):
        return False


@dataclass
class AdamWGroup:
    """Aligned views (master weights, main gradients, m, v) sharing one weight decay."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    decay: bool
    """Whether weight decay applies to these views."""


class FlatAdamW:
    """AdamW over flat ranges, with the kernel chosen once (:func:`fused_supported`).

    ``params[i]`` etc. are whole ranges (the foreach path's lists); ``groups`` split the same
    memory into decayed and non-decayed pieces for the fused kernel, which takes one weight
    decay per call.
    """

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 decayed: list[torch.Tensor], groups: list[AdamWGroup],
                 fused: bool | None = None) -> None:
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = params, grads, exp_avgs, \
            exp_avg_sqs
        self.decayed, self.groups = decayed, [g for g in groups if g.params]
        if fused is None:
            fused = bool(params) and fused_supported(params[0].device.type, params[0].dtype)
        self.fused = fused
        """Whether :meth:`update` calls ``torch._fused_adamw_`` (else the foreach form)."""
        device = params[0].device if params else torch.device("cpu")
        self._step = torch.zeros((), dtype=torch.float32, device=device)  # read by the kernel

    @torch.no_grad()
    def update(self, step: int, hp: AdamWHyper, grad_scale: float = 1.0) -> None:
        """AdamW step ``step`` (1-based) with gradients ``grad_scale * G``.

        Fused path: G is multiplied in place by ``grad_scale`` first when it is not 1 (the
        main gradients then hold the unscaled, clipped gradient, as after torch's
        ``clip_grad_norm_``); the foreach path reads it on the fly and leaves G unchanged.
        """
        if not self.params:
            return
        if not self.fused:
            adamw_update(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.decayed,
                         step, hp, grad_scale=grad_scale)
            return
        if grad_scale != 1.0:
            torch._foreach_mul_(self.grads, grad_scale)
        self._step.fill_(float(step))
        for g in self.groups:
            torch._fused_adamw_(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, [],
                                [self._step] * len(g.params), lr=hp.lr, beta1=hp.beta1,
                                beta2=hp.beta2, weight_decay=hp.weight_decay if g.decay else 0.0,
                                eps=hp.eps, amsgrad=False, maximize=False)
