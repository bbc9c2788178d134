"""Deterministic, resumable batch sampler aware of the data-parallel rank, and batch collation.

The sample stream is the concatenation of epoch permutations: position p of the stream is sample
`perm_e[p % n]` with `e = p // n` and `perm_e = default_rng(seed + e).permutation(n)` (identity
when shuffle=False). Step t takes the global batch `stream[c : c + g]` with c = consumed samples
(g = global_batch); dp rank r takes the contiguous slice `[r * g/dp, (r + 1) * g/dp)` of it and
cuts that into g / (dp * micro_batch) micro-batches of `micro_batch` indices. Hence:

* concatenating all ranks' micro-batches in rank order gives exactly the dp=1 global batch, so
  parallel runs see the same data as the single-process reference;
* the whole state is one integer, `consumed_samples` (global, not per rank): resuming from it
  reproduces the uninterrupted run exactly, mid-epoch or across an epoch boundary, and even with a
  different dp size or micro-batch (global batch ramp-up may change g between steps too).

Epochs run into each other without dropping or padding: a global batch may straddle two epochs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from colonnade.data.dataset import SampleDataset
from colonnade.data.errors import DataError
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX


class BatchSampler:
    """Yields, per training step, this dp rank's micro-batches of sample indices."""

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        _check_layout(num_samples, global_batch, micro_batch, dp_rank, dp_size, seed)
        self.num_samples, self.global_batch, self.micro_batch = (
            num_samples,
            global_batch,
            micro_batch,
        )
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.consumed_samples = 0
        self._perm: tuple[int, np.ndarray] | None = None  # (epoch, permutation of num_samples)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each rank: global_batch / (micro_batch * dp_size)."""
        return self.global_batch // (self.micro_batch * self.dp_size)

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be drawn (0-based)."""
        return self.consumed_samples // self.num_samples

    def _epoch_perm(self, epoch: int) -> np.ndarray:
        """Sample order of `epoch`, int64 [num_samples] (cached for the current epoch)."""
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples, dtype=np.int64)
            self._perm = (epoch, order)
        return self._perm[1]

    def stream(self, start: int, count: int) -> list[int]:
        """Stream positions [start, start + count) as sample indices (may span epochs)."""
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            out.extend(self._epoch_perm(epoch)[offset : offset + take].tolist())
            pos += take
        return out

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next step; consumed_samples += global_batch."""
        per_rank = self.global_batch // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        mine = self.stream(start, per_rank)
        self.consumed_samples += self.global_batch
        mb = self.micro_batch
        return [mine[i : i + mb] for i in range(0, per_rank, mb)]

    def state_dict(self) -> dict[str, Any]:
        """Resumable state; `consumed_samples` is global (summed over dp ranks)."""
        return {
            "consumed_samples": self.consumed_samples,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; the sample stream (num_samples, seed, shuffle) must match."""
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; resume with the same data and seed"
                )
        consumed = state.get("consumed_samples")
        if not isinstance(consumed, int) or consumed < 0:
            raise DataError(f"sampler state consumed_samples={consumed!r} must be an int >= 0")
        self.consumed_samples = consumed


def _check_layout(
    num_samples: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int
) -> None:
    """Reject impossible batch layouts with a message naming the fields and a fix."""
    for name, value in (
        ("num_samples", num_samples),
        ("global_batch", global_batch),
        ("micro_batch", micro_batch),
        ("dp_size", dp_size),
    ):
        if value < 1:
            raise DataError(f"{name}={value} must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if seed < 0:
        raise DataError(f"seed={seed} must be >= 0")
    unit = micro_batch * dp_size
    if global_batch % unit:
        lower = max(unit, global_batch - global_batch % unit)
        raise DataError(
            f"global_batch={global_batch} is not divisible by micro_batch*dp_size="
            f"{micro_batch}*{dp_size}={unit}; choose global_batch as a multiple of {unit} "
            f"(e.g. {lower} or {lower + unit}) or change micro_batch"
        )


def collate(dataset: SampleDataset, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples x into (tokens, labels), int64 [b, s]: x[:, :-1] and x[:, 1:].

    Samples with a loss-mask row ([2, s + 1], SFT data) set the label of every position whose
    target token has mask 0 to IGNORE_INDEX (-100); plain samples (and plain samples blended
    with masked ones) keep every label.
    """
    if not indices:
        raise DataError("collate got no indices; a micro-batch needs at least one sample")
    samples = [np.asarray(dataset[int(i)], dtype=np.int64) for i in indices]
    rows = np.stack([x[0] if x.ndim == 2 else x for x in samples])  # [b, s + 1]
    batch = torch.from_numpy(rows)  # [b, s + 1]
    tokens = batch[:, :-1].contiguous()  # [b, s]
    labels = batch[:, 1:].contiguous()  # [b, s]
    if any(x.ndim == 2 for x in samples):
        keep = np.stack([x[1] if x.ndim == 2 else np.ones_like(x) for x in samples])
        labels[torch.from_numpy(keep[:, 1:] == 0)] = IGNORE_INDEX
    return tokens, labels
