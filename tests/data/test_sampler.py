"""BatchSampler: dp slices reassemble the dp=1 batch, exact resume, epochs, layout errors."""

from __future__ import annotations

import numpy as np
import pytest

from colonnade.data import BatchSampler, DataError

N = 10  # samples per epoch; a global batch of 4 straddles epochs at step 2 (positions 8..11)


def _steps(sampler: BatchSampler, k: int) -> list[list[list[int]]]:
    return [sampler.next_step() for _ in range(k)]


@pytest.mark.parametrize(("dp", "micro"), [(2, 1), (2, 2), (4, 1), (3, 2)])
def test_dp_ranks_concatenate_to_single_process_batch(dp: int, micro: int) -> None:
    g = 12
    ref = BatchSampler(N * 3 + 1, g, micro_batch=g, dp_rank=0, dp_size=1, seed=5)
    ranks = [BatchSampler(N * 3 + 1, g, micro, r, dp, seed=5) for r in range(dp)]
    for _ in range(6):  # 72 samples: crosses two epoch boundaries of 31
        (expected,) = ref.next_step()
        per_rank = [s.next_step() for s in ranks]
        for mbs in per_rank:
            assert len(mbs) == g // (micro * dp) == ranks[0].num_microbatches
            assert all(len(mb) == micro for mb in mbs)
        assert [i for mbs in per_rank for mb in mbs for i in mb] == expected
    assert {s.consumed_samples for s in ranks} == {72}


def test_epochs_are_seeded_permutations() -> None:
    s = BatchSampler(N, 5, 5, 0, 1, seed=3)
    flat = [i for step in _steps(s, 6) for mb in step for i in mb]  # 3 epochs
    epochs = [flat[k : k + N] for k in range(0, 3 * N, N)]
    for e, order in enumerate(epochs):
        assert order == np.random.default_rng(3 + e).permutation(N).tolist()
        assert sorted(order) == list(range(N))
    assert epochs[0] != epochs[1]
    assert s.epoch == 3
    plain = BatchSampler(N, 5, 5, 0, 1, seed=3, shuffle=False)
    assert [i for step in _steps(plain, 3) for mb in step for i in mb] == [*range(N), *range(5)]


@pytest.mark.parametrize("stop", [1, 2, 3, 5])  # mid-epoch, at/after straddling steps
def test_resume_is_exact(stop: int) -> None:
    def make(rank: int = 0, dp: int = 2) -> BatchSampler:
        return BatchSampler(N, 4, 1, rank, dp, seed=11)

    full = _steps(make(), 8)
    first = make()
    _steps(first, stop)
    state = first.state_dict()
    assert state["consumed_samples"] == 4 * stop
    resumed = make()
    resumed.load_state_dict(state)
    assert _steps(resumed, 8 - stop) == full[stop:]


def test_resume_with_different_dp_size_keeps_global_batches() -> None:
    ref = BatchSampler(N, 4, 4, 0, 1, seed=2)
    ref_steps = [step[0] for step in _steps(ref, 5)]
    old = BatchSampler(N, 4, 1, 0, 2, seed=2)
    _steps(old, 2)
    new = [BatchSampler(N, 4, 1, r, 4, seed=2) for r in range(4)]
    for s in new:
        s.load_state_dict(old.state_dict())
    for k in range(2, 5):
        assert [s.next_step()[0][0] for s in new] == ref_steps[k]


def test_layout_and_state_errors() -> None:
    with pytest.raises(DataError) as info:
        BatchSampler(N, 10, micro_batch=2, dp_rank=0, dp_size=2, seed=0)
    msg = str(info.value)
    assert "global_batch=10 is not divisible by micro_batch*dp_size=2*2=4" in msg
    assert "e.g. 8 or 12" in msg
    with pytest.raises(DataError, match=r"dp_rank=2 must be in \[0, dp_size=2\)"):
        BatchSampler(N, 8, 2, 2, 2, seed=0)
    with pytest.raises(DataError, match="micro_batch=0 must be >= 1"):
        BatchSampler(N, 8, 0, 0, 2, seed=0)
    s = BatchSampler(N, 4, 2, 0, 2, seed=0)
    with pytest.raises(DataError, match="seed=1 but this sampler has seed=0"):
        s.load_state_dict({"consumed_samples": 4, "seed": 1})
    with pytest.raises(DataError, match="consumed_samples=-4"):
        s.load_state_dict({"consumed_samples": -4})
