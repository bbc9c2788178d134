"""Groups and data under context parallelism: dp and dp_cp differ once cp > 1.

The layout order is tp-cp-dp-pp (tp fastest), so with tp2 x cp2 x dp2 rank
``r = t + 2 c + 4 d``. The gradient group dp_cp spans cp and dp; the data sampler's group dp
(cp ranks of one dp index read the same samples) carries no collective, so at cp > 1 it gets no
process group (an :class:`IndexGroup` that refuses collectives); at cp = 1 it shares dp_cp's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from colonnade.data.sampler import BatchSampler
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import IndexGroup, ProcessGroups, plan_groups


def test_plan_tp2_cp2_dp2() -> None:
    plan = plan_groups(ParallelDims(tp=2, cp=2, dp=2))
    assert plan["cp"].partition == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan["dp"].partition == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert plan["dp_cp"].partition == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert plan["tp"].partition == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan["dp"].source == "index" and not plan["dp"].creates
    assert [n for n, s in plan.items() if s.creates] == ["tp", "dp_cp", "cp"]


def test_plan_cp_alone_and_cp1() -> None:
    cp4 = plan_groups(ParallelDims(cp=4))
    assert cp4["dp_cp"].source == "create" and cp4["cp"].source == "dp_cp"  # same partition
    assert cp4["dp"].source == "single" and cp4["dp"].partition == [[0], [1], [2], [3]]
    assert plan_groups(ParallelDims(dp=4))["dp"].source == "dp_cp"  # cp = 1: shared pg
    pp = plan_groups(ParallelDims(cp=2, dp=2, pp=2))
    assert pp["dp"].partition == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pp["dp_cp"].partition == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _groups_and_samples() -> dict[str, Any]:
    groups = ProcessGroups.build(ParallelDims(cp=2, dp=2), timeout_s=60.0)
    sums = {}
    for name in ("cp", "dp_cp"):
        t = torch.tensor([float(dist.get_rank())])
        getattr(groups, name).all_reduce(t)
        sums[name] = float(t)
    refused = ""
    try:
        groups.dp.all_reduce(torch.zeros(1))
    except RuntimeError as err:
        refused = str(err)
    sampler = BatchSampler(64, 8, 2, groups.dp.rank, groups.dp.size, seed=3)
    steps = [sampler.next_step() for _ in range(3)]
    return {"sums": sums, "refused": refused, "steps": steps, "dp": groups.dp.ranks,
            "is_index": isinstance(groups.dp, IndexGroup), "cp_rank": groups.cp.rank}


def test_cp2_dp2_groups_and_data(run_ranks: Callable[..., list[Any]]) -> None:
    res = run_ranks(4, _groups_and_samples)
    for rank, r in enumerate(res):
        assert r["sums"] == {"cp": float(sum(ParallelDims(cp=2, dp=2).group_of(rank, "cp"))),
                             "dp_cp": 6.0}
        assert r["is_index"] and "dp_cp" in r["refused"]
        assert r["dp"] == [rank % 2, rank % 2 + 2]
        assert r["cp_rank"] == rank % 2
    # the two cp ranks of each dp index read the same samples; the dp indices split the batch
    assert res[0]["steps"] == res[1]["steps"] and res[2]["steps"] == res[3]["steps"]
    one = BatchSampler(64, 8, 2, 0, 1, seed=3)
    for k in range(3):
        assert res[0]["steps"][k] + res[2]["steps"][k] == one.next_step()


@pytest.mark.parametrize("op", ["barrier", "all_gather_object", "p2p"])
def test_index_group_refuses_every_collective(op: str) -> None:
    from colonnade.parallel.comm import CommStats

    g = IndexGroup("dp", [0, 2], None, CommStats(), 0)
    calls: dict[str, Callable[[], Any]] = {
        "barrier": g.barrier, "all_gather_object": lambda: g.all_gather_object(1),
        "p2p": lambda: g.p2p([(torch.zeros(1), 2)], [])}
    with pytest.raises(RuntimeError, match=r"group 'dp'.*no process group"):
        calls[op]()
    assert g.rank == 0 and g.size == 2
