"""Cross entropy over vocab-parallel logits without gathering the full logits.

Rank i holds logits z[..., V'/tp] for its vocabulary slice. With m = max over all ranks,

    loss = log sum_j exp(z_j - m) - (z_y - m)

needs three all-reduces of [s, b] tensors (max, the target logit, the exp-sum), never the
[s, b, V] logits. Padded vocabulary columns (index >= V) are masked to -inf: they get zero
probability and zero gradient. With label smoothing eps the target distribution is
(1 - eps) one_hot(y) + eps / V over the real vocabulary. Gradient: softmax - target.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from colonnade.parallel.comm import CommGroup


class VocabParallelCrossEntropy(torch.autograd.Function):
    """loss[s, b] from logits [s, b, V'/tp] and targets [s, b]."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: CommGroup,
                vocab: int, smoothing: float) -> torch.Tensor:
        work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        rows = work.shape[-1]
        start = group.rank * rows
        cols = torch.arange(start, start + rows, device=work.device)
        padded = cols >= vocab  # [V'/tp]
        work = work.masked_fill(padded, float("-inf"))
        gmax = work.max(dim=-1).values  # [s, b]
        group.all_reduce(gmax, op=dist.ReduceOp.MAX, name="ce_max")
        shifted = work - gmax.unsqueeze(-1)  # [s, b, V'/tp]
        local_t = targets - start
        inside = (local_t >= 0) & (local_t < rows)
        picked = shifted.gather(-1, local_t.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(inside, picked, torch.zeros_like(picked))  # [s, b]
        exp = shifted.exp()  # [s, b, V'/tp]
        sum_exp = exp.sum(dim=-1)  # [s, b]
        packed = torch.stack([target_logit, sum_exp])  # [2, s, b]
        if smoothing > 0:
            real_sum = shifted.masked_fill(padded, 0.0).sum(dim=-1)
            packed = torch.cat([packed, real_sum.unsqueeze(0)])
        group.all_reduce(packed, name="ce_sums")
        log_z = packed[1].log()
        loss = log_z - packed[0]
        if smoothing > 0:
            smooth = log_z - packed[2] / vocab
            loss = (1 - smoothing) * loss + smoothing * smooth
        softmax = exp / packed[1].unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, inside, padded)
        ctx.smoothing, ctx.vocab = smoothing, vocab
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_t, inside, padded = ctx.saved_tensors
        grad = softmax.clone()  # [s, b, V'/tp]
        rows = grad.shape[-1]
        hit = torch.nn.functional.one_hot(local_t.clamp(0, rows - 1), rows).to(grad.dtype)
        hit = hit * inside.unsqueeze(-1).to(grad.dtype)
        grad -= (1 - ctx.smoothing) * hit
        if ctx.smoothing > 0:
            grad -= (ctx.smoothing / ctx.vocab) * (~padded).to(grad.dtype)
        grad *= grad_loss.unsqueeze(-1).to(grad.dtype)
        return grad.to(grad_loss.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: CommGroup,
                                 vocab: int, smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [s, b] of vocab-split logits [s, b, V'/tp] against targets [s, b]."""
    return VocabParallelCrossEntropy.apply(logits, targets, group, vocab, smoothing)
