"""Training samples: fixed-length windows over the token stream, and weighted blending.

`WindowDataset` treats the indexed dataset as one flat stream of N tokens (documents already end
with EOD, so the model sees the separator and learns across document boundaries, like nanoGPT and
Megatron's GPTDataset). Sample k of a split covers seq_len + 1 consecutive tokens starting at
`base + k * seq_len`: input = sample[:-1], label = sample[1:], and neighbouring samples share one
token (the label of the last position is the first input of the next sample).

Split (deterministic, no shuffling; `_split_windows`): the K = (N - 1) // seq_len windows of the
stream are grouped in blocks of `VALID_BLOCK` consecutive windows (smaller blocks for tiny data:
min(VALID_BLOCK, K // (2 k)), at least 1), and every k-th block, k = max(2, round(1 /
valid_fraction)), is validation (blocks k - 1, 2k - 1, ...; the last window when no block
qualifies), so both splits sample the whole corpus rather than validation measuring only its
last files. Training takes the other windows except the one just before and the one just after
each validation block (neighbouring windows share a token), so the two splits share no token.
valid_fraction=0 holds nothing out: every window is training, and the valid split is empty
(asking for it is an error; train builds no validation set then).

Loss mask (SFT data, :mod:`colonnade.data.sft`): when the indexed dataset's directory also holds
`mask.bin/.idx` (one 0/1 per token, same documents), a sample is int64 [2, seq_len + 1]: row 0
the tokens, row 1 the mask of the same positions (1: the token is trained on as a label), and
:func:`colonnade.data.sampler.collate` turns labels whose mask is 0 into IGNORE_INDEX.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from colonnade.data.errors import DataError
from colonnade.data.indexed import IndexedDataset

Split = Literal["train", "valid"]


MASK_NAME = "mask"
"""Prefix, in a prepared dir, of the loss-mask dataset written beside `data` (SFT)."""


def load_loss_mask(indexed: IndexedDataset) -> IndexedDataset | None:
    """The loss mask beside ``indexed`` (`mask.*` in its directory), checked against it
    document for document; None when there is none (every token is trained on)."""
    prefix = Path(indexed.prefix).parent / MASK_NAME
    if not prefix.with_suffix(".idx").exists():
        return None
    mask = IndexedDataset(prefix)
    if mask.num_tokens != indexed.num_tokens or not np.array_equal(mask.doc_lengths,
                                                                   indexed.doc_lengths):
        raise DataError(f"{prefix}.idx ({mask.num_tokens} tokens, {len(mask)} documents) does "
                        f"not match {indexed.prefix}.idx ({indexed.num_tokens} tokens, "
                        f"{len(indexed)} documents); re-run `colonnade prepare "
                        "--data.format=sft` into this directory, or delete the stale mask.*")
    return mask


class SampleDataset(Protocol):
    """Anything that yields int64 samples of seq_len + 1 tokens by index ([s + 1], or
    [2, s + 1] with a loss-mask row)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


VALID_BLOCK = 16
"""Windows per block of the train/valid split."""


def _split_windows(total: int, valid_fraction: float, split: Split) -> np.ndarray:
    """Window ids of one split: the stream is cut into blocks of VALID_BLOCK windows and every
    k-th block (k = round(1 / valid_fraction)) is validation, so both splits sample the whole
    corpus (a tail split would measure only the last files). Window w covers tokens
    [w s, (w + 1) s + 1): it shares its last token with window w + 1, so the train windows just
    before and just after each valid block are dropped to keep the splits token-disjoint."""
    ids = np.arange(total, dtype=np.int64)
    if valid_fraction <= 0:
        return ids if split == "train" else ids[:0]
    period = max(2, round(1.0 / valid_fraction))
    size = max(1, min(VALID_BLOCK, total // (2 * period)))  # smaller blocks for tiny data
    valid = ((ids // size) % period) == period - 1
    if total and not valid.any():
        valid[-1] = True
    if split == "valid":
        return ids[valid]
    neighbour = np.zeros_like(valid)
    neighbour[:-1] |= valid[1:]
    neighbour[1:] |= valid[:-1]
    return ids[~valid & ~neighbour]


class WindowDataset:
    """Fixed-length samples of `seq_len + 1` tokens cut from the flat token stream of `indexed`."""

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_len: int,
        split: Split = "train",
        valid_fraction: float = 0.05,
    ) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be >= 1")
        if split not in ("train", "valid"):
            raise DataError(f"split={split!r} must be 'train' or 'valid'")
        if not 0.0 <= valid_fraction < 1.0:
            raise DataError(f"valid_fraction={valid_fraction} must be in [0, 1)")
        self.indexed, self.seq_len, self.split = indexed, seq_len, split
        self.tokens = indexed.tokens  # [N] flat memmap
        mask = load_loss_mask(indexed)
        self.loss_mask = None if mask is None else mask.tokens  # [N] 0/1 memmap, or None
        n_tokens = indexed.num_tokens
        total = max((n_tokens - 1) // seq_len, 0)
        self.windows = _split_windows(total, valid_fraction, split)  # window ids, ascending
        self.num_samples = len(self.windows)
        if self.num_samples == 0:
            raise DataError(
                f"{indexed.prefix}: the {split} split is empty ({n_tokens} tokens, "
                f"seq_len={seq_len}, "
                f"valid_fraction={valid_fraction}); use more data, a shorter seq_len, or a "
                f"{'smaller' if split == 'train' else 'positive'} valid_fraction"
            )

    def __len__(self) -> int:
        return self.num_samples

    def token_range(self, i: int) -> tuple[int, int]:
        """[start, end) of sample `i` in the flat token stream (end - start = seq_len + 1)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} {self.split} samples")
        start = int(self.windows[i]) * self.seq_len
        return start, start + self.seq_len + 1

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample `i`: int64 [seq_len + 1]; input = [:-1], label = [1:]. With a loss mask,
        [2, seq_len + 1]: the tokens and their 0/1 mask."""
        start, end = self.token_range(int(i))
        tokens = np.asarray(self.tokens[start:end], dtype=np.int64)  # [s + 1]
        if self.loss_mask is None:
            return tokens
        return np.stack([tokens, np.asarray(self.loss_mask[start:end], dtype=np.int64)])


class BlendedDataset:
    """Deterministic mixture of datasets in proportion to `weights`, `size` samples long.

    Megatron's error-minimising greedy: for blended sample i (0-based) pick the dataset d that
    maximises `w_d * (i + 1) - c_d`, where `c_d` is how many samples d has supplied so far (ties go
    to the lower index), so every prefix of the blend tracks the weights within one sample per
    dataset. Dataset d's samples are taken in the order of a permutation drawn from `seed`, redrawn
    each time d is exhausted (its epochs), so repeated data is not repeated in the same order.
    """

    def __init__(
        self, datasets: Sequence[SampleDataset], weights: Sequence[float], size: int, seed: int
    ) -> None:
        if not datasets or len(datasets) != len(weights):
            raise DataError(
                f"BlendedDataset needs one weight per dataset, got {len(datasets)} datasets and "
                f"{len(weights)} weights"
            )
        if any(not w > 0 for w in weights):
            raise DataError(f"weights={list(weights)} must all be positive")
        if any(len(d) == 0 for d in datasets):
            raise DataError("every blended dataset must hold at least one sample")
        if size < 1:
            raise DataError(f"size={size} must be >= 1")
        if seed < 0:
            raise DataError(f"seed={seed} must be >= 0")
        self.datasets, self.size, self.seed = list(datasets), size, seed
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.dataset_index, self.sample_index = self._build()
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # dataset -> (epoch, permutation)

    def _build(self) -> tuple[np.ndarray, np.ndarray]:
        """Greedy assignment: dataset id [size] and per-dataset running count [size], both int64."""
        weights = self.weights
        counts = [0] * len(weights)
        dataset_index = np.empty(self.size, dtype=np.int64)
        sample_index = np.empty(self.size, dtype=np.int64)
        for i in range(self.size):
            errors = [w * (i + 1) - c for w, c in zip(weights, counts, strict=True)]
            d = max(range(len(errors)), key=errors.__getitem__)
            dataset_index[i], sample_index[i] = d, counts[d]
            counts[d] += 1
        return dataset_index, sample_index

    def _local_index(self, d: int, k: int) -> int:
        """Index into dataset d of its k-th draw: epoch k // len, position k % len of its perm."""
        n = len(self.datasets[d])
        epoch, pos = divmod(k, n)
        cached = self._perms.get(d)
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, d, epoch]).permutation(n))
            self._perms[d] = cached
        return int(cached[1][pos])

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range for blended size {self.size}")
        d, k = int(self.dataset_index[i]), int(self.sample_index[i])
        return self.datasets[d][self._local_index(d, k)]
