"""Rank <-> coordinate maths and group partitions of :class:`ParallelDims` (pure arithmetic)."""

from __future__ import annotations

import itertools

import pytest

from colonnade.config.choices import AXES
from colonnade.config.sections import ParallelConfig
from colonnade.parallel.dims import ParallelDims

ORDERS = ["tp-cp-dp-pp", "dp-tp-pp-cp", "pp-dp-tp-cp", "tp-pp-dp-cp", "cp-pp-dp-tp"]
DEGREES = [dict(tp=2, dp=3, pp=2), dict(tp=2, cp=2, ep=1, dp=2, pp=2), dict(tp=4, pp=1, dp=1),
           dict(tp=1, pp=3, dp=1), dict(tp=2, cp=3, ep=3, dp=1, pp=1)]


def _name(degrees: dict[str, int]) -> str:
    return "-".join(f"{k}{v}" for k, v in degrees.items())


def _dims(order: str, degrees: dict[str, int]) -> ParallelDims:
    return ParallelDims(order=tuple(order.split("-")), **degrees)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("degrees", DEGREES, ids=_name)
def test_coords_rank_inverse_and_strides(order: str, degrees: dict[str, int]) -> None:
    dims = _dims(order, degrees)
    world = dims.world_size
    assert world == (degrees.get("tp", 1) * degrees.get("cp", 1) * degrees.get("dp", 1)
                     * degrees.get("pp", 1))  # ep folds inside: it does not multiply the world
    seen = set()
    for rank in range(world):
        c = dims.coords(rank)
        assert set(c) == set(AXES)
        assert dims.rank(**c) == rank
        seen.add(tuple(c[a] for a in AXES))
        # explicit mixed-radix formula: first axis of the order varies fastest
        expect, stride = 0, 1
        for axis in dims.order:
            expect += c[axis] * stride
            stride *= dims.degree(axis)
        assert expect == rank
    assert len(seen) == world  # a bijection onto the coordinate grid
    first = dims.order[0]
    if dims.degree(first) > 1:
        assert dims.coords(1)[first] == 1  # rank 1 is the next index of the fastest axis


def test_default_order_matches_megatron_formula() -> None:
    dims = ParallelDims(tp=2, dp=2, pp=2)
    for tp, dp, pp in itertools.product(range(2), range(2), range(2)):
        assert dims.rank(tp=tp, dp=dp, pp=pp) == tp + 2 * (dp + 2 * pp)
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_ranks(("tp", "pp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_pp_first_order_puts_stages_on_consecutive_ranks() -> None:
    dims = ParallelDims(tp=2, dp=1, pp=4, order=("pp", "tp", "cp", "dp"))
    assert dims.group_ranks("pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.group_ranks("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coords(5) == {"pp": 1, "tp": 1, "cp": 0, "dp": 0}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("degrees", DEGREES, ids=_name)
@pytest.mark.parametrize("axes", [("tp",), ("dp",), ("pp",), ("cp",), ("dp", "cp"), ("tp", "pp"),
                                  ("tp", "cp", "dp", "pp")])
def test_group_partitions_are_disjoint_and_cover(order: str, degrees: dict[str, int],
                                                 axes: tuple[str, ...]) -> None:
    dims = _dims(order, degrees)
    groups = dims.group_ranks(axes)
    size = 1
    for a in axes:
        size *= dims.degree(a)
    assert all(len(g) == size for g in groups)
    assert len(groups) == dims.world_size // size
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(dims.world_size))  # disjoint and covering
    for g in groups:
        coords = [dims.coords(r) for r in g]
        for axis in AXES:
            values = {c[axis] for c in coords}
            if axis in axes:
                assert len(values) == dims.degree(axis)  # varies along the group's axes
            else:
                assert len(values) == 1  # fixed elsewhere
        for r in g:
            assert dims.group_of(r, axes) == g


def test_from_config_derives_dp_and_checks_world() -> None:
    cfg = ParallelConfig(tp=2, pp=2, order="dp-tp-pp-cp")
    dims = ParallelDims.from_config(cfg, 8)
    assert (dims.tp, dims.pp, dims.dp, dims.order) == (2, 2, 2, ("dp", "tp", "pp", "cp"))
    assert dims.describe() == "tp2-dp2-pp2"
    with pytest.raises(ValueError, match=r"world size 8 != tp x cp x dp x pp = 12"):
        ParallelDims.from_config(ParallelConfig(tp=2, pp=2, dp=3), 8)
    # the spelling before the expert view loads, 'ep' dropped from the dense order
    legacy = ParallelDims.from_config(ParallelConfig(tp=2, pp=2, order="tp-cp-ep-dp-pp"), 8)
    assert legacy.order == ("tp", "cp", "dp", "pp") and legacy.world_size == 8
    # ep and expert_tp fold inside tp x cp x dp: 8 ranks with ep = 4 is still dp = 2
    moe = ParallelDims.from_config(ParallelConfig(tp=2, pp=2, ep=2, expert_tp=1), 8)
    assert (moe.dp, moe.ep, moe.expert_tp, moe.edp) == (2, 2, 1, 2)
    assert moe.describe() == "tp2-dp2-pp2-ep2-etp1"


def test_invalid_dims_are_rejected() -> None:
    with pytest.raises(ValueError, match="must name each of"):
        ParallelDims(order=("tp", "dp", "pp"))
    with pytest.raises(ValueError, match="must name each of tp-cp-dp-pp once"):
        ParallelDims(order=("tp", "cp", "ep", "dp", "pp"))  # ep is not a dense axis
    with pytest.raises(ValueError, match=r"parallel\.tp=0 must be >= 1"):
        ParallelDims(tp=0)
    dims = ParallelDims(tp=2, dp=2)
    with pytest.raises(ValueError, match="rank 4 outside world of size 4"):
        dims.coords(4)
    with pytest.raises(ValueError, match="tp index 2 outside degree 2"):
        dims.rank(tp=2)
    assert ParallelDims().describe() == "single"
    assert ParallelDims(pp=2, vp=3).describe() == "pp2-vp3"
