"""WindowDataset (windows across documents, disjoint splits) and BlendedDataset (greedy blend)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from colonnade.data import (
    BlendedDataset,
    DataError,
    IndexedDataset,
    IndexedDatasetWriter,
    WindowDataset,
    collate,
)

EOD = 0


@pytest.fixture
def indexed(tmp_path: Path) -> IndexedDataset:
    """Docs of lengths 3, 6, 2, 9, ... with distinct ids, each followed by EOD: 103 tokens."""
    rng = np.random.default_rng(0)
    next_id = 1
    with IndexedDatasetWriter(tmp_path / "d", 1000) as writer:
        total = 0
        while total < 103:
            n = min(int(rng.integers(1, 10)), 103 - total - 1)
            writer.add_document([*range(next_id, next_id + n), EOD])
            next_id += n
            total += n + 1
    return IndexedDataset(tmp_path / "d")


def test_windows_cross_document_boundaries(indexed: IndexedDataset) -> None:
    stream = np.asarray(indexed.tokens, dtype=np.int64)
    assert stream.size == 103
    ds = WindowDataset(indexed, seq_len=8, split="train", valid_fraction=0.0)
    assert len(ds) == (103 - 1) // 8 == 12
    for k in range(len(ds)):
        sample = ds[k]
        assert sample.dtype == np.int64 and sample.shape == (9,)
        np.testing.assert_array_equal(sample, stream[8 * k : 8 * k + 9])
    assert sum(int((ds[k][1:-1] == EOD).any()) for k in range(len(ds))) >= 6  # EOD mid-sample
    tokens, labels = collate(ds, [3, 0])
    assert tokens.shape == labels.shape == (2, 8)
    assert tokens[0].tolist() == stream[24:32].tolist()
    assert labels[0].tolist() == stream[25:33].tolist()
    assert labels[1, -1].item() == stream[8]


def test_train_valid_split_is_disjoint_and_deterministic(indexed: IndexedDataset) -> None:
    train = WindowDataset(indexed, seq_len=8, split="train", valid_fraction=0.2)
    valid = WindowDataset(indexed, seq_len=8, split="valid", valid_fraction=0.2)
    # K = 12 windows, blocks of 1 window, every 5th block valid: windows 4 and 9; the train
    # windows next to them (3, 5, 8, 10) are dropped so no token is shared.
    assert valid.windows.tolist() == [4, 9]
    assert train.windows.tolist() == [0, 1, 2, 6, 7, 11]
    train_tokens = {t for k in range(len(train)) for t in range(*train.token_range(k))}
    valid_tokens = {t for k in range(len(valid)) for t in range(*valid.token_range(k))}
    assert not train_tokens & valid_tokens
    stream = np.asarray(indexed.tokens, dtype=np.int64)
    np.testing.assert_array_equal(valid[1], stream[72:81])
    again = WindowDataset(indexed, seq_len=8, split="valid", valid_fraction=0.2)
    assert all((again[k] == valid[k]).all() for k in range(2))


def test_split_errors(indexed: IndexedDataset) -> None:
    with pytest.raises(DataError, match=r"valid split is empty.*positive valid_fraction"):
        WindowDataset(indexed, seq_len=8, split="valid", valid_fraction=0.0)
    with pytest.raises(DataError, match="train split is empty"):
        WindowDataset(indexed, seq_len=60, split="train", valid_fraction=0.5)
    with pytest.raises(DataError, match=r"valid_fraction=1\.0 must be in"):
        WindowDataset(indexed, seq_len=8, valid_fraction=1.0)
    with pytest.raises(IndexError):
        WindowDataset(indexed, seq_len=8, valid_fraction=0.0)[12]


class _Tagged:
    """A fake dataset whose sample j is [tag, j]."""

    def __init__(self, tag: int, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> np.ndarray:
        assert 0 <= j < self.n
        return np.array([self.tag, j], dtype=np.int64)


def test_blending_tracks_weights_in_every_prefix() -> None:
    weights = [5.0, 3.0, 2.0]  # normalised to 0.5, 0.3, 0.2
    blend = BlendedDataset([_Tagged(0, 400), _Tagged(1, 50), _Tagged(2, 1000)], weights, 1000, 7)
    assert len(blend) == 1000
    counts = np.zeros(3)
    for i in range(1000):
        counts[blend.dataset_index[i]] += 1
        assert np.abs(counts - np.array([0.5, 0.3, 0.2]) * (i + 1)).max() <= 1.0
    assert counts.tolist() == [500, 300, 200]
    assert (
        [int(blend[i][0]) for i in range(5)] == blend.dataset_index[:5].tolist() == [0, 1, 2, 0, 0]
    )


def test_blending_is_deterministic_and_reshuffles_each_epoch() -> None:
    def make(seed: int) -> BlendedDataset:
        return BlendedDataset([_Tagged(0, 3), _Tagged(1, 100)], [0.6, 0.4], 30, seed)

    a, b, c = make(1), make(1), make(2)
    rows = [a[i].tolist() for i in range(30)]
    assert rows == [b[i].tolist() for i in range(30)]
    assert rows != [c[i].tolist() for i in range(30)]  # seed changes the order within a dataset
    np.testing.assert_array_equal(a.dataset_index, c.dataset_index)  # but not the mixture
    small = [r[1] for r in rows if r[0] == 0]
    assert len(small) == 18
    epochs = [small[k : k + 3] for k in range(0, 18, 3)]
    assert all(sorted(e) == [0, 1, 2] for e in epochs)  # each epoch is a permutation
    assert len({tuple(e) for e in epochs}) > 1  # and epochs are reshuffled


def test_blending_rejects_bad_weights() -> None:
    with pytest.raises(DataError, match="one weight per dataset"):
        BlendedDataset([_Tagged(0, 3)], [0.5, 0.5], 10, 0)
    with pytest.raises(DataError, match="must all be positive"):
        BlendedDataset([_Tagged(0, 3), _Tagged(1, 3)], [1.0, 0.0], 10, 0)
