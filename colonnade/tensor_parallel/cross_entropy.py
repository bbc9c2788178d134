"""Cross entropy over vocab-parallel logits without gathering the full logits.

Rank i holds logits z[..., V'/tp] for its vocabulary slice. With m = max over all ranks,

    loss = log sum_j exp(z_j - m) - (z_y - m)

needs three all-reduces of [s, b] tensors (max, the target logit, the exp-sum), never the
[s, b, V] logits. Padded vocabulary columns (index >= V) are masked to -inf: they get zero
probability and zero gradient. With label smoothing eps the target distribution is
(1 - eps) one_hot(y) + eps / V over the real vocabulary. Gradient: softmax - target.

Loss mask: a target equal to ``IGNORE_INDEX`` (-100, PyTorch's and Hugging Face's convention;
padding and SFT prompt tokens) gets loss 0 and gradient 0, label smoothing included. The caller
divides the sum by the number of valid targets (see :mod:`colonnade.training.step`).

:func:`cross_entropy` is the one place that picks the path: with one tp rank and an unpadded
vocabulary (V' = V) nothing needs to cross ranks, and PyTorch's fused
``F.cross_entropy(reduction='none', ignore_index=IGNORE_INDEX, label_smoothing=eps)`` computes
the same per-token loss (log-softmax + gather, the same formula with smoothing; equal to
~1e-15 in float64) with fewer kernels and no custom autograd node; otherwise the vocab-parallel
function above.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from colonnade.parallel.comm import CommGroup

IGNORE_INDEX = -100
"""A label with this value is masked out of the loss (no loss, no gradient)."""


class VocabParallelCrossEntropy(torch.autograd.Function):
    """loss[s, b] from logits [s, b, V'/tp] and targets [s, b]; the loss is fp32 when the
    logits are bf16/fp16 (as in Megatron-Core: a half-precision loss loses the small per-token
    differences once summed), and the gradient flows back in the logits' dtype.

    Hot path (every step): besides the max and the sums, the forward makes one [s, b, V'/tp]
    tensor (shifted logits, turned into the softmax in place) and the backward one (the
    gradient); padded columns are only touched on a rank that holds some.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: CommGroup,
                vocab: int, smoothing: float) -> torch.Tensor:
        work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        rows = work.shape[-1]
        start = group.rank * rows
        real = min(rows, max(0, vocab - start))  # columns [real, rows) are vocabulary padding
        if real < rows:
            work = work.clone()
            work[..., real:] = float("-inf")
        gmax = work.max(dim=-1).values  # [s, b]
        group.all_reduce(gmax, op=dist.ReduceOp.MAX, name="ce_max")
        shifted = work - gmax.unsqueeze(-1)  # [s, b, V'/tp] (a new tensor: logits untouched)
        local_t = targets - start
        inside = (local_t >= 0) & (local_t < rows)
        index = local_t.clamp(0, rows - 1)  # [s, b]
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(inside, picked, torch.zeros_like(picked))  # [s, b]
        sums = [target_logit]
        if smoothing > 0:
            real_sum = shifted[..., :real].sum(dim=-1)  # [s, b]
        exp = shifted.exp_()  # [s, b, V'/tp], in place
        sums.append(exp.sum(dim=-1))  # [s, b]
        if smoothing > 0:
            sums.append(real_sum)
        packed = torch.stack(sums)  # [2 or 3, s, b]
        group.all_reduce(packed, name="ce_sums")
        log_z = packed[1].log()
        loss = log_z - packed[0]
        if smoothing > 0:
            smooth = log_z - packed[2] / vocab
            loss = (1 - smoothing) * loss + smoothing * smooth
        valid = targets != IGNORE_INDEX  # [s, b]
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        softmax = exp.div_(packed[1].unsqueeze(-1))  # [s, b, V'/tp], in place
        ctx.save_for_backward(softmax, index, inside, valid)
        ctx.smoothing, ctx.vocab, ctx.real, ctx.dtype = smoothing, vocab, real, logits.dtype
        return loss  # [s, b] in fp32 for bf16/fp16 logits (sums of it stay exact enough)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """d loss / d z = g * (softmax - (1 - eps) one_hot(y) - eps / V on real columns);
        zero where the target is IGNORE_INDEX."""
        softmax, index, inside, valid = ctx.saved_tensors
        g = grad_loss.to(softmax.dtype) * valid.to(softmax.dtype)  # [s, b]
        grad = softmax * g.unsqueeze(-1)  # [s, b, V'/tp]
        hit = -(1 - ctx.smoothing) * g * inside.to(g.dtype)  # [s, b]
        grad.scatter_add_(-1, index.unsqueeze(-1), hit.unsqueeze(-1))
        if ctx.smoothing > 0:
            grad[..., :ctx.real] -= (ctx.smoothing / ctx.vocab) * g.unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None  # in the logits' dtype


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: CommGroup,
                                 vocab: int, smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [s, b] of vocab-split logits [s, b, V'/tp] against targets [s, b]
    (0 where the target is IGNORE_INDEX)."""
    return VocabParallelCrossEntropy.apply(logits, targets, group, vocab, smoothing)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: CommGroup, vocab: int,
                  smoothing: float = 0.0, reduction: str = "none") -> torch.Tensor:
    """Per-token loss [s, b] of vocab-split logits [s, b, V'/tp] against targets [s, b]
    (0 where the target is IGNORE_INDEX), or its sum (``reduction='sum'``, a scalar); fp32 for
    bf16/fp16 logits, gradient in the logits' dtype. One tp rank and V' = V:
    ``F.cross_entropy`` over the [s b, V] view (see the module docstring), reducing inside
    the kernel when summing (~8% faster forward + backward than summing its per-token output
    on issue 19's [2048, 1024] logits); else :func:`vocab_parallel_cross_entropy`."""
    if reduction not in ("none", "sum"):
        raise ValueError(f"reduction={reduction!r} must be 'none' or 'sum'")
    if group.size > 1 or logits.shape[-1] != vocab:
        loss = vocab_parallel_cross_entropy(logits, targets, group, vocab, smoothing)
        return loss.sum() if reduction == "sum" else loss
    work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    loss = F.cross_entropy(work.reshape(-1, vocab), targets.reshape(-1), reduction=reduction,
                           ignore_index=IGNORE_INDEX, label_smoothing=smoothing)  # [s b] or []
    return loss if reduction == "sum" else loss.view(targets.shape)  # [s, b]
