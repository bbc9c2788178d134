"""One training step: forward/backward of every micro-batch, gradient reductions, update.

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
N = b * s * microbatches * dp and L is the old mean, bit for bit up to rounding. The same
multiplier is applied by the pipeline executor on the last stage, so pp = 1 and pp > 1 compute
the same thing. Reported losses (per micro-batch: mean over its valid tokens; per step:
:func:`mean_loss` weighted by valid tokens) are the same token-weighted mean on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from colonnade.config.sections import DataConfig
from colonnade.models.blocks import DocReset
from colonnade.models.gpt import ModelChunk, valid_tokens
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
    tokens: int | None = None
    """Valid tokens (labels not IGNORE_INDEX) of the whole global batch, all dp ranks: the loss
    divisor N. None: counted from the batches by :func:`with_tokens` (one all-reduce over dp)."""

    def loss_multiplier(self) -> float:
        """Factor on a micro-batch's summed loss before backward: loss_scale * dp / N (the dp
        reduction averages over its group, dp x cp, so the reduced gradient is that of
        sum CE / N)."""
        if self.tokens is None:
            raise ValueError("StepPlan.tokens is unset; call with_tokens(plan, batches) first")
        return self.loss_scale * self.groups.dp_cp.size / max(self.tokens, 1)


def count_tokens(batches: list[Batch], groups: ProcessGroups) -> int:
    """Valid tokens of the global batch: this rank's micro-batches, all-reduced over dp (the
    dp x cp group that reduces gradients, so the count and the averaging agree)."""
    if not batches:
        raise ValueError("a step needs at least one micro-batch")
    labels = [lab for _, lab in batches]
    local = torch.stack([valid_tokens(lab) for lab in labels]).sum().reshape(1)  # [1] int64
    groups.dp_cp.all_reduce(local, name="loss_tokens")  # the gradient reduction's group
    return int(local.item())


def with_tokens(plan: StepPlan, batches: list[Batch]) -> StepPlan:
    """``plan`` with ``tokens`` set (counted over dp when unset; unchanged otherwise)."""
    if plan.tokens is not None:
        return plan
    return replace(plan, tokens=count_tokens(batches, plan.groups))


def set_rng_context(chunks: list[ModelChunk], plan: StepPlan, k: int, m: int) -> None:
    """Point dropout at global micro-batch index dp_rank * m + k of this step."""
    rng = chunks[0].ctx.rng
    rng.set_context(plan.step, plan.groups.dp_rank * m + k)


def forward_backward(chunks: list[ModelChunk], batches: list[Batch],
                     plan: StepPlan) -> list[float]:
    """Run every micro-batch forward and backward; returns per-micro-batch losses.

    pp = 1: a plain gradient-accumulation loop. pp > 1: the pipeline executor runs the action
    lists of ``plan.schedule``. Each backward runs on the micro-batch's summed loss times
    ``plan.loss_multiplier()`` (``plan.tokens`` counted first when unset). Returned losses are
    each micro-batch's mean over its valid tokens, known only on the last pipeline stage
    (others return an empty list).
    """
    plan = with_tokens(plan, batches)
    if plan.groups.pp.size > 1:
        from colonnade.pipeline.executor import run_pipeline

        return run_pipeline(chunks, batches, plan)
    (chunk,) = chunks
    m, losses, scale = len(batches), [], plan.loss_multiplier()
    for k, (tokens, labels) in enumerate(batches):
        set_rng_context(chunks, plan, k, m)
        if plan.grad_sync is not None:
            plan.grad_sync(k)
        loss = chunk(tokens, labels, reduction="sum")
        (loss * scale).backward()
        losses.append(micro_batch_mean(loss.detach(), labels))
    return host_losses(losses)


def micro_batch_mean(loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A micro-batch's summed loss as the mean over its valid tokens (0 when none is)."""
    return loss_sum / valid_tokens(labels).clamp(min=1)


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
    return host_losses([chunk(tokens, labels) for tokens, labels in batches])  # valid-token means


def mean_loss(losses: list[float], groups: ProcessGroups, device: torch.device,
              batches: list[Batch] | None = None) -> float:
    """Mean loss of the step over dp, made known on every rank (last stage contributes);
    reduced on ``device`` (NCCL reduces only device tensors). With ``batches`` (the step's
    micro-batches of this rank) each micro-batch's mean weighs by its valid tokens, giving
    the global token mean (0 when no label of the global batch is valid, rather than a NaN
    that would stop the run); without, every micro-batch weighs the same."""
    weights = [1.0] * len(losses)
    if batches is not None and losses:  # one device-to-host copy
        weights = torch.stack([valid_tokens(lab) for _, lab in batches]).double().tolist()
    total = sum(w * v for w, v in zip(weights, losses, strict=True))
    t = torch.tensor([total, sum(weights)], dtype=torch.float64, device=device)
    groups.world.all_reduce(t, name="log_loss")
    if t[1] > 0:
        return float(t[0] / t[1])
    # every label of the global batch masked: nothing is trained on (zero gradients), loss 0
    return 0.0 if batches is not None else float("nan")


def install_doc_reset(chunks: list[ModelChunk], data: DataConfig, tokenizer: Path) -> None:
    """Turn data.reset_position_ids / reset_attention_mask on in every chunk, with the EOD id
    of the run's tokenizer (a no-op when both are off)."""
    if not (data.reset_position_ids or data.reset_attention_mask):
        return
    from colonnade.data import eod_id, load_tokenizer

    reset = DocReset(eod_id(load_tokenizer(tokenizer)), positions=data.reset_position_ids,
                     attention=data.reset_attention_mask)
    for chunk in chunks:
        chunk.doc_reset = reset


def set_train_mode(chunks: list[nn.Module], training: bool) -> None:
    """train() / eval() on every chunk."""
    for chunk in chunks:
        chunk.train(training)
