"""The zigzag split: every row held exactly once, balanced causal work, helpers consistent."""

from __future__ import annotations

import pytest
import torch

from colonnade.context_parallel.layout import (
    check_divisible,
    local_ranges,
    take_local,
    zigzag_index,
    zigzag_order,
    zigzag_ranges,
)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_rows_partition_the_sequence_with_equal_causal_work(cp: int) -> None:
    s = 8 * cp
    order = zigzag_order(s, cp)
    assert sorted(order.tolist()) == list(range(s))
    work = [int((zigzag_index(s, cp, r) + 1).sum()) for r in range(cp)]  # keys per query row
    assert work == [work[0]] * cp
    assert work[0] * cp == s * (s + 1) // 2


def test_ranges_index_and_take_local_agree() -> None:
    x = torch.arange(2 * 16 * 3).view(2, 16, 3)  # [b, s, h]
    assert zigzag_ranges(16, 4, 1) == [(2, 4), (12, 14)]
    for r in range(4):
        idx = zigzag_index(16, 4, r)
        assert torch.equal(take_local(x, 4, r, dim=1), x[:, idx])
    assert take_local(x, 1, 0, dim=1) is x


def test_local_ranges_of_an_sp_shard() -> None:
    ranges = zigzag_ranges(16, 2, 0)  # [(0, 4), (12, 16)]
    assert local_ranges(ranges, 0, 4) == [(0, 4)]
    assert local_ranges(ranges, 2, 4) == [(2, 4), (12, 14)]
    assert local_ranges(ranges, 4, 4) == [(12, 16)]
    with pytest.raises(ValueError, match="exceed"):
        local_ranges(ranges, 6, 4)


def test_indivisible_sequence_is_refused_with_the_fields_named() -> None:
    with pytest.raises(ValueError, match=r"training\.seq_len or parallel\.cp"):
        check_divisible(18, 2)
    with pytest.raises(ValueError, match="cp rank 2 out of range"):
        zigzag_index(16, 2, 2)
