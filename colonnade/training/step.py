"""One training step: forward/backward of every micro-batch, gradient reductions, update.

The loss convention (token-level mean over the global batch's valid tokens, N counted over dp)
and the plan types are in :mod:`colonnade.pipeline.plan`; every micro-batch's backward runs on
its summed loss times ``StepPlan.loss_multiplier()`` = loss_scale * dp / N in the pipeline
executor, which every step goes through (pp = 1 is its degenerate one-stage 1f1b). Reported
losses (per micro-batch: mean over its valid tokens; per step: :func:`mean_loss` weighted by
valid tokens) are the same token-weighted mean on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from colonnade.config.sections import DataConfig
from colonnade.models.blocks import DocReset
from colonnade.models.gpt import ModelChunk, local_labels, valid_tokens
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.executor import run_pipeline, run_pipeline_forward
from colonnade.pipeline.plan import Batch, StepPlan
from colonnade.reliability.interrupt import agreed_signal, signal_votes


def forward_backward(chunks: list[ModelChunk], batches: list[Batch],
                     plan: StepPlan) -> list[float]:
    """Run every micro-batch forward and backward; returns per-micro-batch losses.

    One call into the pipeline executor, which runs the action lists of ``plan.schedule``;
    pp = 1 is its degenerate case (1f1b on one stage: F0 B0 F1 B1 ..., plain gradient
    accumulation, no p2p). Each backward runs on the micro-batch's summed loss times
    ``plan.loss_multiplier()`` (``plan.tokens`` counted first when unset). Returned losses are
    each micro-batch's mean over its valid tokens, known only on the stage holding the last
    virtual stage (pp - 1; stage 0 under zbv; others return an empty list).
    """
    return run_pipeline(chunks, batches, plan)


@torch.no_grad()
def forward_only(chunks: list[ModelChunk], batches: list[Batch], plan: StepPlan) -> list[float]:
    """Evaluation: forward every micro-batch through the executor (pp = 1 included), no
    gradients; per-micro-batch means over valid tokens on the loss stage."""
    return run_pipeline_forward(chunks, batches, plan)


def mean_loss(losses: list[float], groups: ProcessGroups, device: torch.device,
              batches: list[Batch] | None = None) -> float:
    """Mean loss of the step over dp, made known on every rank (the loss stage contributes);
    reduced on ``device`` (NCCL reduces only device tensors). With ``batches`` (the step's
    micro-batches of this rank) each micro-batch's mean weighs by its valid tokens, giving
    the global token mean (0 when no label of the global batch is valid, rather than a NaN
    that would stop the run); without, every micro-batch weighs the same. Under cp a rank's
    losses are means over its rows of the labels (:func:`~colonnade.models.gpt.local_labels`)
    and weigh by their valid count, so the world reduction still gives the global mean."""
    return start_mean_loss(losses, groups, device, batches)()[0]


def start_mean_loss(losses: list[float], groups: ProcessGroups, device: torch.device,
                    batches: list[Batch] | None = None,
                    signum: int = 0) -> Callable[[], tuple[float, int]]:
    """:func:`mean_loss` in two halves, with the ranks' stop-signal agreement on board.

    This call starts the world all-reduce (sum) of ``[sum of weighted means, sum of weights,
    *signal_votes(signum)]`` asynchronously; the returned function waits for it and gives
    ``(mean loss, agreed stop signal)``, the signal being the largest any rank of the world
    passed in (:func:`~colonnade.reliability.interrupt.agreed_signal`; 0 for none). A
    training step starts it right after the pipeline and reads it after the update, so the
    reduction completes while the gradient sync and the optimizer run, and the Ctrl-C /
    SIGTERM agreement costs no collective of its own. Every rank must call the returned
    function (in the order its other collectives were entered)."""
    weights = [1.0] * len(losses)
    if batches is not None and losses:  # one device-to-host copy
        weights = torch.stack([valid_tokens(local_labels(lab, groups))
                               for _, lab in batches]).double().tolist()
    total, count = sum(w * v for w, v in zip(weights, losses, strict=True)), sum(weights)
    empty = 0.0 if batches is not None else float("nan")
    # every label of the global batch masked: nothing is trained on (zero gradients), loss 0

    def divide(total: float, count: float) -> float:
        return total / count if count > 0 else empty

    votes = signal_votes(signum)
    if groups.world.size == 1:  # one rank: the same float64 division, no tensor, no collective
        return lambda: (divide(total, count), agreed_signal(votes))
    t = torch.tensor([total, count, *votes], dtype=torch.float64, device=device)
    handle = groups.world.all_reduce(t, name="log_loss", async_op=True)
    assert handle is not None

    def finish() -> tuple[float, int]:
        handle.wait()
        reduced_total, reduced_count, *reduced_votes = t.tolist()
        return divide(reduced_total, reduced_count), agreed_signal(reduced_votes)

    return finish


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
