"""One training step: forward/backward of every micro-batch, gradient reductions, update.

Loss convention: each micro-batch's loss is the mean over its b x s tokens; the step's loss is
the mean over the microbatches x dp micro-batches, so backward runs on loss / microbatches and
the dp reduction averages. All micro-batches hold the same token count, so this equals the mean
over every token of the global batch: the single-process reference computes the same number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from colonnade.models.gpt import ModelChunk
from colonnade.parallel.groups import ProcessGroups

Batch = tuple[torch.Tensor, torch.Tensor]  # tokens [b, s], labels [b, s]


@dataclass
class StepPlan:
    """What a forward/backward pass needs besides the model and the data."""

    groups: ProcessGroups
    step: int
    """Optimizer step index (seeds dropout with the micro-batch index)."""
    schedule: str = "1f1b"
    """Pipeline schedule name (ignored when pp = 1)."""
    loss_scale: float = 1.0
    """Multiplier applied to the loss before backward (fp16 dynamic scaling)."""
    grad_sync: Callable[[int], None] | None = None
    """Called before the backward of micro-batch k; the DP wrapper enables sync on the last."""
    extra: dict[str, object] = field(default_factory=dict)
    """Executor options (e.g. overlap_p2p)."""


def set_rng_context(chunks: list[ModelChunk], plan: StepPlan, k: int, m: int) -> None:
    """Point dropout at global micro-batch index dp_rank * m + k of this step."""
    rng = chunks[0].ctx.rng
    rng.set_context(plan.step, plan.groups.dp_rank * m + k)


def forward_backward(chunks: list[ModelChunk], batches: list[Batch],
                     plan: StepPlan) -> list[float]:
    """Run every micro-batch forward and backward; returns per-micro-batch losses.

    pp = 1: a plain gradient-accumulation loop. pp > 1: the pipeline executor runs the action
    lists of ``plan.schedule``. Losses are only known on the last pipeline stage (others
    return an empty list).
    """
    if plan.groups.pp.size > 1:
        from colonnade.pipeline.executor import run_pipeline

        return run_pipeline(chunks, batches, plan)
    (chunk,) = chunks
    m, losses = len(batches), []
    for k, (tokens, labels) in enumerate(batches):
        set_rng_context(chunks, plan, k, m)
        if plan.grad_sync is not None:
            plan.grad_sync(k)
        loss = chunk(tokens, labels)
        (loss * (plan.loss_scale / m)).backward()
        losses.append(loss.detach())
    return host_losses(losses)


def host_losses(losses: list[torch.Tensor]) -> list[float]:
    """Per-micro-batch 0-d loss tensors as floats with one device-to-host copy for the step
    (a ``float(loss)`` per micro-batch would stall a GPU's queue m times)."""
    return torch.stack(losses).tolist() if losses else []


@torch.no_grad()
def forward_only(chunks: list[ModelChunk], batches: list[Batch], plan: StepPlan) -> list[float]:
    """Evaluation: forward every micro-batch (pipelined when pp > 1), no gradients."""
    if plan.groups.pp.size > 1:
        from colonnade.pipeline.executor import run_pipeline_forward

        return run_pipeline_forward(chunks, batches, plan)
    (chunk,) = chunks
    return host_losses([chunk(tokens, labels) for tokens, labels in batches])


def mean_loss(losses: list[float], groups: ProcessGroups, device: torch.device) -> float:
    """Mean loss of the step over dp, made known on every rank (last stage contributes);
    reduced on ``device`` (NCCL reduces only device tensors)."""
    t = torch.tensor([sum(losses), float(len(losses))], dtype=torch.float64, device=device)
    groups.world.all_reduce(t, name="log_loss")
    return float(t[0] / t[1]) if t[1] > 0 else float("nan")


def set_train_mode(chunks: list[nn.Module], training: bool) -> None:
    """train() / eval() on every chunk."""
    for chunk in chunks:
        chunk.train(training)
