"""A 4096-rank job (tp8 pp8 dp64) laid out from ParallelDims alone, without processes.

Groups: every rank joins exactly one group per axis, the groups of an axis partition the world,
members of a group differ only along that group's axes, and the creation calls are one per
created axis, the same number at 4096 ranks as at 8 (O(axes), not O(ranks)). With gloo's
``new_subgroups_by_enumeration`` every rank still enters one ``new_group`` per multi-rank group
(torch's contract); with NCCL's ``split_group`` each creation call is one communicator split.
"""

from __future__ import annotations

from colonnade.config.choices import AXES
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import GROUP_NAMES, plan_groups

BIG = ParallelDims(tp=8, pp=8, dp=64)
SMALL = ParallelDims(tp=2, pp=4, dp=2)
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "pp": ("pp",), "dp": ("dp",), "cp": ("cp",), "dp_cp": ("dp", "cp"),
}


def test_4096_ranks_one_group_per_axis_partitioning_the_world() -> None:
    assert BIG.world_size == 4096
    plan = plan_groups(BIG)
    for name in GROUP_NAMES:
        parts = plan[name].partition
        member_of = [0] * BIG.world_size
        for ranks in parts:
            for r in ranks:
                member_of[r] += 1
        assert member_of == [1] * 4096, name  # each rank in exactly one group of this axis
        if name not in GROUP_AXES:
            continue
        varying = GROUP_AXES[name]
        size = 1
        for axis in varying:
            size *= BIG.degree(axis)
        assert len(parts) == 4096 // size and {len(p) for p in parts} == {size}, name
        for ranks in parts:  # members agree on every other coordinate
            fixed = {tuple(BIG.coords(r)[a] for a in AXES if a not in varying) for r in ranks}
            assert len(fixed) == 1, (name, ranks[:4])
    assert len(plan["tp"].partition) == 512 and len(plan["pp"].partition) == 512
    assert len(plan["dp_cp"].partition) == 64
    # embedding: stage 0 and stage 7 of each of the 512 pipelines, middle stages alone
    pairs = [p for p in plan["embedding"].partition if len(p) > 1]
    assert len(pairs) == 512
    assert all({BIG.coords(p[0])["pp"], BIG.coords(p[1])["pp"]} == {0, 7} for p in pairs)


def test_4096_ranks_creation_calls_are_per_axis_not_per_rank() -> None:
    big, small = plan_groups(BIG), plan_groups(SMALL)
    created = [n for n, s in big.items() if s.creates]
    assert created == ["tp", "pp", "dp_cp", "embedding"]  # dp shares dp_cp, cp single
    assert created == [n for n, s in small.items() if s.creates]  # same calls at 16 ranks
    assert big["dp"].source == "dp_cp" and big["cp"].source == "single"
    # groups a rank joins (with a process group): one per created axis
    joined = [0] * BIG.world_size
    for name in created:
        for ranks in big[name].partition:
            if len(ranks) > 1:
                for r in ranks:
                    joined[r] += 1
    for r in range(BIG.world_size):  # middle stages hold no embedding: one fewer
        assert joined[r] == (4 if BIG.coords(r)["pp"] in (0, 7) else 3), r
    # new_group calls each rank makes under gloo (every multi-rank group, all ranks enter)
    per_rank_new_group = sum(len([p for p in big[n].partition if len(p) > 1]) for n in created)
    assert per_rank_new_group == 512 + 512 + 64 + 512
