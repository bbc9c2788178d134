"""The step plan: what one forward/backward pass needs besides the model and the data.

Loss convention (Megatron's token-level loss): the step's loss is the mean over the VALID
tokens of the whole global batch,

    L = sum over valid tokens of the global batch of CE / N,

N = number of labels that are not ``IGNORE_INDEX`` (-100: padding, SFT prompt tokens) over every
micro-batch of every dp rank, not a mean of per-micro-batch means (which would weight a token of
a mostly-masked micro-batch more). Before the step each rank counts its micro-batches' valid
labels and one tiny all-reduce over dp gives N (``StepPlan.tokens``; :func:`with_tokens`). Each
micro-batch's backward then runs on sum(CE over its valid tokens) * loss_scale * dp / N
(:meth:`StepPlan.loss_multiplier`): the dp gradient reduction averages over the dp ranks (it
pre-scales by 1/dp or uses AVG), so the reduced gradient is exactly that of L. Without masking,
N = b * s * microbatches * dp and L is the old mean, bit for bit up to rounding. Every step, pp = 1
included (the degenerate one-stage 1f1b), runs through the pipeline executor, so pp = 1 and
pp > 1 apply the same multiplier and compute the same thing.

Context parallelism: a cp rank scores only its zigzag rows of each micro-batch's labels
(:func:`~colonnade.models.gpt.local_labels`), so its counts, sums and per-micro-batch means are
over those; counted over dp x cp, N is still the global batch's valid tokens, and the
gradient reduction over dp x cp with multiplier dp x cp / N gives the gradient of L.

These types live in the pipeline package (below ``training/``) because the executor consumes
them; the training step only builds a plan and hands it down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from colonnade.models.gpt import ModelChunk, local_labels, valid_tokens
from colonnade.parallel.groups import ProcessGroups

Batch = tuple[torch.Tensor, torch.Tensor]  # tokens [b, s], labels [b, s]


@dataclass(frozen=True)
class ExecOptions:
    """Executor switches; none of them changes results."""

    overlap: bool = True
    """Post each compute's receives one compute early (``parallel.overlap_p2p``)."""
    deallocate: bool = True
    """Free a sent activation's data (Megatron's output deallocation)."""
    record: bool = False
    """Record a timestamp pair per compute action (benchmarks; synchronises the device)."""
    in_order: bool = False
    """Issue each p2p group only after the previous one completed (``parallel.p2p_in_order``;
    NCCL's rule, which NCCL applies anyway: on gloo it checks the posting is NCCL-safe)."""


@dataclass
class StepPlan:
    """What a forward/backward pass needs besides the model and the data."""

    groups: ProcessGroups
    step: int
    """Optimizer step index (seeds dropout with the micro-batch index)."""
    schedule: str = "1f1b"
    """Pipeline schedule name (pp = vp = 1 always runs the degenerate 1f1b)."""
    loss_scale: float = 1.0
    """Multiplier applied to the loss before backward (fp16 dynamic scaling)."""
    grad_sync: Callable[[int], None] | None = None
    """Called before the backward of micro-batch k; the DP wrapper enables sync on the last."""
    options: ExecOptions = field(default_factory=ExecOptions)
    """Pipeline executor switches (p2p overlap, output deallocation, in-order p2p, recording)."""
    tokens: int | torch.Tensor | None = None
    """Valid tokens (labels not IGNORE_INDEX) of the whole global batch, all dp ranks: the loss
    divisor N, a host int or a 0-d int64 device tensor (what :func:`with_tokens` counts, never
    read on the host). None: counted from the batches by :func:`with_tokens` (one all-reduce
    over dp)."""

    def loss_multiplier(self) -> float | torch.Tensor:
        """Factor on a micro-batch's summed loss before backward: loss_scale * dp / N (the dp
        reduction averages over its group, dp x cp, so the reduced gradient is that of
        sum CE / N). A 0-d float64 device tensor when N is one (no host read): the same IEEE
        division as the host float, (loss_scale * dp) / max(N, 1)."""
        if self.tokens is None:
            raise ValueError("StepPlan.tokens is unset; call with_tokens(plan, batches) first")
        numerator = self.loss_scale * self.groups.dp_cp.size
        if isinstance(self.tokens, torch.Tensor):
            return numerator / self.tokens.clamp(min=1).to(torch.float64)
        return numerator / max(self.tokens, 1)


def count_tokens(batches: list[Batch], groups: ProcessGroups) -> torch.Tensor:
    """Valid tokens of the global batch, a 0-d int64 tensor on the labels' device (no host
    read): this rank's micro-batches (its cp rows of their labels), all-reduced over dp x cp
    (the group that reduces gradients, so the count and the averaging agree; not entered when
    that group is one rank)."""
    if not batches:
        raise ValueError("a step needs at least one micro-batch")
    labels = [local_labels(lab, groups) for _, lab in batches]
    local = torch.stack([valid_tokens(lab) for lab in labels]).sum().reshape(1)  # [1] int64
    if groups.dp_cp.size > 1:
        groups.dp_cp.all_reduce(local, name="loss_tokens")  # the gradient reduction's group
    return local[0]


def with_tokens(plan: StepPlan, batches: list[Batch]) -> StepPlan:
    """``plan`` with ``tokens`` set (counted over dp when unset; unchanged otherwise)."""
    if plan.tokens is not None:
        return plan
    return replace(plan, tokens=count_tokens(batches, plan.groups))


def set_rng_context(chunks: list[ModelChunk], plan: StepPlan, k: int, m: int) -> None:
    """Point dropout at global micro-batch index dp_rank * m + k of this step."""
    rng = chunks[0].ctx.rng
    rng.set_context(plan.step, plan.groups.dp_rank * m + k)


def micro_batch_mean(loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A micro-batch's summed loss as the mean over its valid tokens (0 when none is);
    ``labels``: the rank's labels (:func:`~colonnade.models.gpt.local_labels` under cp)."""
    return loss_sum / valid_tokens(labels).clamp(min=1)


def scaled_loss(loss: torch.Tensor, multiplier: float | torch.Tensor) -> torch.Tensor:
    """``loss * multiplier``, the backward's start; a device multiplier (float64) is cast to
    the loss's dtype (fp32 for a 16-bit loss, the precision a host float is applied in), so
    the gradient is the same as with the host float."""
    if isinstance(multiplier, torch.Tensor):
        wide = loss.dtype if loss.dtype in (torch.float32, torch.float64) else torch.float32
        multiplier = multiplier.to(wide)
    return loss * multiplier


def stack_losses(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per-micro-batch 0-d loss tensors as one [m] device tensor (float64 [0] when there is
    none), not read on the host: the step reads it once with its other values
    (:func:`colonnade.training.step.start_mean_loss`), a ``float(loss)`` per micro-batch would
    stall a GPU's queue m times."""
    if not losses:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack(losses)
