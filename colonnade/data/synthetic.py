"""Synthetic token batches for tests, benchmarks and calibration (uniform ids; no dataset)."""

from __future__ import annotations

import torch

from colonnade.config.sections import Config

Batch = tuple[torch.Tensor, torch.Tensor]  # tokens [b, s], labels [b, s]


def random_batches(config: Config, *, seed: int = 0, count: int | None = None,
                   generator: torch.Generator | None = None) -> list[Batch]:
    """``count`` micro-batches (default training.microbatches) of shape [micro_batch, seq_len].

    Each draws ids [b, s + 1] uniformly from the vocabulary; tokens are ids[:, :-1] and labels
    ids[:, 1:]. Pass ``generator`` to continue one stream across calls.
    """
    tr = config.training
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count if count is not None else tr.microbatches or 1):
        ids = torch.randint(0, config.model.vocab, (tr.micro_batch_size, tr.seq_len + 1),
                            generator=gen)  # [b, s + 1]
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def random_steps(config: Config, steps: int, *, seed: int = 0) -> list[list[Batch]]:
    """``steps`` lists of micro-batches drawn from one seeded stream."""
    gen = torch.Generator().manual_seed(seed)
    return [random_batches(config, generator=gen) for _ in range(steps)]
