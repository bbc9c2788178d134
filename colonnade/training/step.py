"""One training step: forward/backward of every micro-batch, gradient reductions, update.

The loss convention (token-level mean over the global batch's valid tokens, N counted over dp)
and the plan types are in :mod:`colonnade.pipeline.plan`; every micro-batch's backward runs on
its summed loss times ``StepPlan.loss_multiplier()`` = loss_scale * dp / N in the pipeline
executor, which every step goes through (pp = 1 is its degenerate one-stage 1f1b). Reported
losses (per micro-batch: mean over its valid tokens; per step: :func:`mean_loss` weighted by
valid tokens) are the same token-weighted mean on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colonnade.config.sections import DataConfig
from colonnade.models.blocks import DocReset
from colonnade.models.gpt import ModelChunk, local_labels, valid_tokens
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.executor import execute, run_pipeline_forward
from colonnade.pipeline.plan import Batch, StepPlan
from colonnade.reliability.interrupt import STOP_SIGNALS, agreed_signal, signal_votes


def forward_backward(chunks: list[ModelChunk], batches: list[Batch],
                     plan: StepPlan) -> list[float]:
    """:func:`step_losses` read on the host (tests and tools; the Trainer keeps them on the
    device and reads them once with the step's other values)."""
    return step_losses(chunks, batches, plan).tolist()


def step_losses(chunks: list[ModelChunk], batches: list[Batch], plan: StepPlan) -> torch.Tensor:
    """Run every micro-batch forward and backward; returns per-micro-batch losses [m] on the
    device (no host read).

    One call into the pipeline executor, which runs the action lists of ``plan.schedule``;
    pp = 1 is its degenerate case (1f1b on one stage: F0 B0 F1 B1 ..., plain gradient
    accumulation, no p2p). Each backward runs on the micro-batch's summed loss times
    ``plan.loss_multiplier()`` (``plan.tokens`` counted first when unset, on the device).
    The losses are each micro-batch's mean over its valid tokens, known only on the stage
    holding the last virtual stage (pp - 1; stage 0 under zbv; others return [0]).
    """
    return execute(chunks, batches, plan).loss_values


@torch.no_grad()
def forward_only(chunks: list[ModelChunk], batches: list[Batch], plan: StepPlan) -> list[float]:
    """Evaluation: forward every micro-batch through the executor (pp = 1 included), no
    gradients; per-micro-batch means over valid tokens on the loss stage."""
    return run_pipeline_forward(chunks, batches, plan)


def mean_loss(losses: list[float] | torch.Tensor, groups: ProcessGroups, device: torch.device,
              batches: list[Batch] | None = None) -> float:
    """Mean loss of the step over dp, made known on every rank (the loss stage contributes);
    reduced on ``device`` (NCCL reduces only device tensors). With ``batches`` (the step's
    micro-batches of this rank) each micro-batch's mean weighs by its valid tokens, giving
    the global token mean (0 when no label of the global batch is valid, rather than a NaN
    that would stop the run); without, every micro-batch weighs the same. Under cp a rank's
    losses are means over its rows of the labels (:func:`~colonnade.models.gpt.local_labels`)
    and weigh by their valid count, so the world reduction still gives the global mean.
    One host read (evaluation and tests)."""
    return start_mean_loss(losses, groups, device, batches)()[0]


@dataclass
class PendingLoss:
    """The step's loss reduction in flight: ``values`` = [sum of weighted means, sum of
    weights, *signal votes] (float64 [2 + V] on the device), all-reduced (sum) over the world
    by ``handle`` (None: one rank, nothing to reduce). Nothing here reads the device: the
    caller reads :meth:`ready` once, alone (``pending()``) or with the step's other values
    (the optimizer's gradient-norm read, :meth:`DistributedOptimizer.step`'s ``riders``), and
    hands the floats to :meth:`result`."""

    values: torch.Tensor
    handle: Any
    empty: float
    """The mean when no label is valid: 0.0 with token weights, NaN without."""

    def ready(self) -> torch.Tensor:
        """``values`` once reduced (waits for the all-reduce: on NCCL this orders streams only,
        the host does not block)."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        return self.values

    def result(self, host: list[float]) -> tuple[float, int]:
        """(mean loss, agreed stop signal) from the host copy of :meth:`ready`'s values."""
        total, count, *votes = host
        return (total / count if count > 0 else self.empty), agreed_signal(votes)

    def __call__(self) -> tuple[float, int]:
        """:meth:`result` of a read of its own (one device-to-host copy)."""
        return self.result(self.ready().tolist())


def start_mean_loss(losses: list[float] | torch.Tensor, groups: ProcessGroups,
                    device: torch.device, batches: list[Batch] | None = None,
                    signum: int = 0) -> PendingLoss:
    """:func:`mean_loss` in two halves, with the ranks' stop-signal agreement on board.

    This call computes, on the device, ``[sum_k w_k l_k, sum_k w_k, *signal_votes(signum)]``
    (w_k: micro-batch k's valid tokens, or 1 without ``batches``; l_k its mean loss; the sums
    taken in micro-batch order in float64, as the host sum did) and starts its world
    all-reduce (sum) asynchronously; the returned :class:`PendingLoss` gives, once read,
    ``(mean loss, agreed stop signal)``, the signal being the largest any rank passed in
    (:func:`~colonnade.reliability.interrupt.agreed_signal`; 0 for none). A training step
    starts it right after the pipeline and reads it with the optimizer's gradient norm (one
    host read for both), so the reduction completes while the gradient sync runs, and the
    Ctrl-C / SIGTERM agreement costs no collective of its own. Every rank must read it (in
    the order its other collectives were entered). No host read here: the token weights stay
    on the device."""
    values = torch.zeros(2 + len(STOP_SIGNALS), dtype=torch.float64, device=device)
    means = torch.as_tensor(losses, dtype=torch.float64).to(device)  # [m]
    if len(means):
        if batches is not None:
            weights = torch.stack([valid_tokens(local_labels(lab, groups))
                                   for _, lab in batches]).to(device, torch.float64)  # [m]
        else:
            weights = torch.ones(len(means), dtype=torch.float64, device=device)
        products = means * weights  # [m]
        total, count = products[0], weights[0]
        for k in range(1, len(means)):  # in order: the same float64 sums as on the host
            total, count = total + products[k], count + weights[k]
        values[0], values[1] = total, count
    for i, vote in enumerate(signal_votes(signum)):
        if vote:
            values[2 + i] = vote  # a fill, no host-to-device copy
    handle = None
    if groups.world.size > 1:
        handle = groups.world.all_reduce(values, name="log_loss", async_op=True)
        assert handle is not None
    return PendingLoss(values, handle, 0.0 if batches is not None else float("nan"))


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
    """train() / eval() on every chunk not already in that mode (``Module.train`` walks every
    submodule: ~0.4 ms a step for a 4-layer model, paid only when the mode changes)."""
    for chunk in chunks:
        if chunk.training != training:
            chunk.train(training)
