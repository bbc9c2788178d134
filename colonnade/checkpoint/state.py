"""The train-state protocol: what checkpoints and reliability read of a run, never the Trainer.

``checkpoint/`` and ``reliability/`` sit below ``training/`` and must not import it, so they
take any object with these attributes (the Trainer is one, a test's namespace another).
Optional attributes they look up with ``getattr`` when present: ``ddp`` (the data-parallel
wrapper; its parameter gathers are finished before a save), ``data`` (the sampler's position),
``scaler`` (else ``optimizer.scaler``), ``checkpoint_stager`` (pinned host buffers reused by
every asynchronous save, set on first use) and ``elapsed_s`` (seconds of training of the whole
run, recorded by a save and restored by a resume; 0 when absent).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from colonnade.config.sections import Config
from colonnade.models.gpt import ModelChunk
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.groups import ProcessGroups


@runtime_checkable
class TrainState(Protocol):
    """One rank's training state as checkpoints and the NaN guard see it."""

    config: Config
    """The run's validated config."""
    groups: ProcessGroups
    """This rank's process groups."""
    chunks: list[ModelChunk]
    """This rank's model chunks (vp of them)."""
    optimizer: DistributedOptimizer
    """The optimizer over this rank's parameters (its ``scaler`` when fp16)."""
    step: int
    """Optimizer steps taken (the step a checkpoint records)."""

