"""ProcessGroups creates only the groups used for a collective, one creation call per axis.

Counted on gloo ranks by wrapping torch.distributed's creation functions: per layout, the
``new_subgroups_by_enumeration`` calls equal the axes with a group of more than one rank that
no earlier axis already has (dp shares dp_cp's pg at cp = 1, embedding shares pp's at pp = 2;
``model`` is not made at all), and the ``new_group`` calls equal the multi-rank groups of those
calls. Every group made is then used: a sum over it equals the sum of its ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from colonnade.parallel import groups as groups_mod
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import EXPERT_GROUP_NAMES, ProcessGroups, plan_groups

LAYOUTS: dict[str, dict[str, int]] = {
    "tp2-pp2": {"tp": 2, "pp": 2},
    "tp2-dp2": {"tp": 2, "dp": 2},
    "pp4": {"pp": 4},
    "dp2-pp2": {"dp": 2, "pp": 2},
}
# (creation calls, new_group calls) each rank makes; the first names the axes created
EXPECTED: dict[str, tuple[list[str], int]] = {
    "tp2-pp2": (["tp", "pp"], 2 + 2),  # embedding == pp at pp 2; dp_cp, dp, cp single
    "tp2-dp2": (["tp", "dp_cp"], 2 + 2),  # dp == dp_cp; pp, cp, embedding single
    "pp4": (["pp", "embedding"], 1 + 1),  # embedding {0, 3}; middle stages alone
    "dp2-pp2": (["pp", "dp_cp"], 2 + 2),
}


def _count_creation(degrees: dict[str, int], tied: bool,
                    experts: bool = False) -> dict[str, Any]:
    """Build the groups with counting wrappers around the creation APIs; use every group."""
    calls: dict[str, list[Any]] = {"subgroups": [], "new_group": []}
    real_sub, real_new = dist.new_subgroups_by_enumeration, dist.new_group

    def sub(parts: list[list[int]], **kw: Any) -> Any:
        calls["subgroups"].append((kw.get("group_desc"), parts, kw.get("timeout")))
        return real_sub(parts, **kw)

    def new(*args: Any, **kw: Any) -> Any:
        calls["new_group"].append(kw.get("ranks", args[0] if args else None))
        return real_new(*args, **kw)

    # new_subgroups_by_enumeration calls distributed_c10d's new_group: wrap both names
    dist.new_subgroups_by_enumeration, dist.new_group, c10d.new_group = sub, new, new
    try:
        groups = ProcessGroups.build(ParallelDims(**degrees), timeout_s=420.0,
                                     tied_embeddings=tied, experts=experts)
    finally:
        dist.new_subgroups_by_enumeration, dist.new_group = real_sub, real_new
        c10d.new_group = real_new
    sums = {}
    for name in ("tp", "pp", "dp", "cp", "dp_cp", "embedding",
                 *(EXPERT_GROUP_NAMES if experts else ())):
        g = getattr(groups, name)
        t = torch.tensor([float(dist.get_rank())])
        g.all_reduce(t)
        sums[name] = (g.ranks, float(t), g.pg is not None)
    return {"axes": [c[0] for c in calls["subgroups"]],
            "timeouts": [c[2].total_seconds() for c in calls["subgroups"]],
            "new_group": len(calls["new_group"]), "sums": sums}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_groups_created_equal_groups_used(run_ranks: Callable[..., list[Any]],
                                          layout: str) -> None:
    degrees = LAYOUTS[layout]
    dims = ParallelDims(**degrees)
    axes, new_groups = EXPECTED[layout]
    for rank, res in enumerate(run_ranks(dims.world_size, _count_creation, degrees, True)):
        assert res["axes"] == axes, (layout, rank)
        assert res["timeouts"] == [420.0] * len(axes)  # the timeout is given at creation
        assert res["new_group"] == new_groups, (layout, rank)
        for name, (ranks, total, has_pg) in res["sums"].items():
            assert total == float(sum(ranks)), (layout, rank, name)
            assert has_pg == (len(ranks) > 1), (layout, rank, name)
        plan = plan_groups(dims)
        assert [n for n, s in plan.items() if s.creates] == axes


def test_untied_embeddings_make_no_embedding_group(run_ranks: Callable[..., list[Any]]) -> None:
    for rank, res in enumerate(run_ranks(4, _count_creation, {"pp": 4}, False)):
        assert res["axes"] == ["pp"] and res["new_group"] == 1
        assert res["sums"]["embedding"] == ([rank], float(rank), False)


# expert layouts: (creation calls, new_group calls) each rank makes
EXPERT_LAYOUTS: dict[str, tuple[dict[str, int], list[str], int]] = {
    # etp = tp, ep = 2 spans dp: ep shares dp_cp's pg, expert_tp tp's, edp = 1 is single
    "tp2-dp2-pp2-ep2": ({"tp": 2, "dp": 2, "pp": 2, "ep": 2}, ["tp", "pp", "dp_cp"], 4 + 4 + 4),
    # ep spans the whole stage (world): one new call; expert_tp and expert_dp single
    "tp2-dp2-ep4-etp1": ({"tp": 2, "dp": 2, "ep": 4, "etp": 1}, ["tp", "dp_cp", "ep"],
                         2 + 2 + 1),
    # ep over pairs, edp across them: two new calls
    "dp4-ep2": ({"dp": 4, "ep": 2}, ["dp_cp", "ep", "expert_dp"], 1 + 2 + 2),
}


@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_expert_groups_one_call_per_new_partition(run_ranks: Callable[..., list[Any]],
                                                  layout: str) -> None:
    degrees, axes, new_groups = EXPERT_LAYOUTS[layout]
    dims = ParallelDims(**degrees)  # type: ignore[arg-type]
    results = run_ranks(dims.world_size, _count_creation, degrees, True, True)
    for rank, res in enumerate(results):
        assert res["axes"] == axes and res["new_group"] == new_groups, (layout, rank)
        for name, axis in (("ep", "ep"), ("expert_tp", "etp"), ("expert_dp", "edp")):
            ranks, total, has_pg = res["sums"][name]
            assert ranks == dims.group_of(rank, axis), (layout, rank, name)
            assert total == float(sum(ranks)) and has_pg == (len(ranks) > 1)
    assert [n for n, s in plan_groups(dims, experts=True).items() if s.creates] == axes


def test_plan_shares_equal_partitions() -> None:
    plan = plan_groups(ParallelDims(tp=2, pp=2, dp=2))
    assert plan["dp"].source == "dp_cp" and plan["embedding"].source == "pp"
    assert plan["cp"].source == "single"
    assert plan["dp"].partition == plan["dp_cp"].partition == [[0, 2], [1, 3], [4, 6], [5, 7]]
    three = plan_groups(ParallelDims(pp=3, dp=2))
    assert three["embedding"].creates
    assert three["embedding"].partition == [[0, 4], [1, 5], [2], [3]]  # middle stages alone


def _split_path(degrees: dict[str, int]) -> dict[str, Any]:
    """With a splittable default group (as NCCL with a bound device), each axis is one
    ``split_group`` call; stood in for on gloo (which cannot split) by the enumeration."""
    calls: list[tuple[Any, ...]] = []

    def split(*, split_ranks: list[list[int]], timeout: Any, group_desc: str) -> Any:
        calls.append((group_desc, split_ranks, timeout.total_seconds()))
        mine, _ = dist.new_subgroups_by_enumeration(split_ranks, timeout=timeout)
        return mine

    real_split, real_can = dist.split_group, groups_mod._can_split
    dist.split_group, groups_mod._can_split = split, lambda: True  # type: ignore[assignment]
    try:
        groups = ProcessGroups.build(ParallelDims(**degrees), timeout_s=700.0)
    finally:
        dist.split_group, groups_mod._can_split = real_split, real_can  # type: ignore
    t = torch.tensor([float(dist.get_rank())])
    groups.tp.all_reduce(t)
    return {"calls": calls, "tp_sum": float(t)}


def test_split_group_path_is_one_call_per_axis(run_ranks: Callable[..., list[Any]]) -> None:
    for rank, res in enumerate(run_ranks(4, _split_path, {"tp": 2, "pp": 2})):
        assert res["calls"] == [("tp", [[0, 1], [2, 3]], 700.0), ("pp", [[0, 2], [1, 3]], 700.0)]
        assert res["tp_sum"] == (1.0 if rank < 2 else 5.0)
