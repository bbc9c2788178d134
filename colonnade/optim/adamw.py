"""The AdamW update on lists of flat tensors, decoupled weight decay.

For step t >= 1, learning rate lr, gradient g = c G (G the main gradient as stored, c the
unscale-and-clip coefficient):
    w <- w (1 - lr wd)                       (decayed ranges only)
    m <- beta1 m + (1 - beta1) g
    v <- beta2 v + (1 - beta2) g^2
    w <- w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
the update of ``torch.optim.AdamW``; each list entry is one flat range of the master weights
(a whole buffer, one ZeRO-1 shard of one bucket, or a piece of one: see :class:`FlatAdamW`).

Two kernels compute it, chosen once per optimizer (:func:`fused_supported`, probed on the
compute dtype: the gradients', fp32, or fp64 for fp64 runs):
  * ``torch._fused_adamw_``: one pass over w, g, m, v (the kernel of ``torch.optim.AdamW(
    fused=True)``), on CPU for fp32 and fp64 and on CUDA; two calls per step (decayed and
    non-decayed pieces: the kernel takes one weight decay per call);
  * :func:`adamw_update`: the ``torch._foreach_*`` form, which remains only where the kernel
    is missing for the device and compute dtype (the probe fails: e.g. a device or a torch
    build without it; CPU has no bf16 kernel, but bf16 storage never reaches a kernel, see
    below) or when a caller asks for it (``fused=False``, tests).
Both agree with ``torch.optim.AdamW`` to the last bit or two (float64 relative error < 1e-15;
tests/optim/test_adamw.py bounds fused against foreach per dtype).
With c != 1 the fused path first multiplies the gradients in place by c in their own dtype (as
``torch.nn.utils.clip_grad_norm_`` does): the kernel's ``grad_scale`` is a float32 tensor, which
would round c for fp64 runs, so it is never passed, and fp64 parity stays exact.
Precision-aware states (``optim.state_dtype`` / ``master_dtype`` = 'bf16'): masters or moments
stored in bf16 are upcast chunk by chunk (2^20 elements) into fp32 workspaces, the same kernel
runs on them, and the results are rounded to nearest back into bf16
(:mod:`colonnade.optim.chunked`), so the update always computes in fp32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from colonnade.data_parallel.buffer import is_expert_param
from colonnade.optim.chunked import ChunkedCompute


def decays(param: torch.nn.Parameter) -> bool:
    """Whether weight decay applies to ``param``: a matrix (2-D, or a stack of routed experts'
    matrices [E, a, b]), not a vector (norms, biases, sinks, a stack of experts' biases
    [E, f]), as Megatron-Core and ``transformers``' trainers split them."""
    return param.ndim - (1 if is_expert_param(param) else 0) > 1


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
    decay per call. ``compute`` is the dtype the update computes in (the gradients': fp32, or
    fp64 for fp64 runs); masters or moments stored in another dtype (bf16: ``optim.
    master_dtype`` / ``state_dtype``) are updated through :class:`~colonnade.optim.chunked.
    ChunkedCompute` (fp32 chunks of 2^20 elements, rounded back to nearest).
    """

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 decayed: list[torch.Tensor], groups: list[AdamWGroup],
                 fused: bool | None = None, compute: torch.dtype | None = None) -> None:
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = params, grads, exp_avgs, \
            exp_avg_sqs
        self.decayed, self.groups = decayed, [g for g in groups if g.params]
        device = params[0].device if params else torch.device("cpu")
        if compute is None:
            compute = grads[0].dtype if grads else torch.float32
        if fused is None:
            fused = bool(params) and fused_supported(device.type, compute)
        self.fused = fused
        """Whether :meth:`update` calls ``torch._fused_adamw_`` (else the foreach form)."""
        stored = [t[0].dtype if t else compute for t in (params, exp_avgs, exp_avg_sqs)]
        self.chunked: ChunkedCompute | None = None
        """The fp32 chunk runner when masters or moments are stored narrower than ``compute``."""
        if any(dt != compute for dt in stored):
            sizes = [[v.numel() for v in g.params] for g in self.groups]
            self.chunked = ChunkedCompute(sizes, [stored[0], compute, stored[1], stored[2]],
                                          compute, device)
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
        if self.fused and grad_scale != 1.0:
            torch._foreach_mul_(self.grads, grad_scale)
            grad_scale = 1.0
        self._step.fill_(float(step))
        if self.chunked is not None:
            def fn(g: int, v: list[list[torch.Tensor]]) -> None:
                self._kernel(v[0], v[1], v[2], v[3], self.groups[g].decay, step, hp, grad_scale)
            self.chunked.run([[g.params, g.grads, g.exp_avgs, g.exp_avg_sqs]
                              for g in self.groups], (0, 2, 3), fn)
        elif not self.fused:
            adamw_update(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.decayed,
                         step, hp, grad_scale=grad_scale)
        else:
            for g in self.groups:
                self._kernel(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.decay, step, hp, 1.0)

    def _kernel(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], decay: bool,
                step: int, hp: AdamWHyper, grad_scale: float) -> None:
        """One kernel call on aligned views sharing one weight decay (``grad_scale`` is 1 on
        the fused path: the gradients were pre-multiplied)."""
        if self.fused:
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [],
                                [self._step] * len(params), lr=hp.lr, beta1=hp.beta1,
                                beta2=hp.beta2, weight_decay=hp.weight_decay if decay else 0.0,
                                eps=hp.eps, amsgrad=False, maximize=False)
        else:
            adamw_update(params, grads, exp_avgs, exp_avg_sqs, params if decay else [], step,
                         hp, grad_scale=grad_scale)
