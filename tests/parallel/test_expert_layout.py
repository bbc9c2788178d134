"""The expert view of :class:`ParallelDims` (pure arithmetic) and its validation.

Dense view: world = tp x cp x dp x pp. Expert view: inside each pipeline stage the in-stage
index j (the dense order with pp left out) splits as ``j = etp_i + etp * (ep_i + ep * edp_i)``,
edp = tp x cp x dp / (ep x etp); pp is shared by both views.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest

from colonnade.config.load import ConfigError
from colonnade.config.sections import Config, ParallelConfig
from colonnade.config.validate import problems, resolve, validate
from colonnade.parallel.dims import EXPERT_AXES, ParallelDims
from colonnade.parallel.groups import EXPERT_GROUP_NAMES, GROUP_NAMES, plan_groups

LAYOUTS: list[dict[str, object]] = [
    dict(tp=2, dp=4, pp=2, ep=2),  # etp = tp = 2: edp 2
    dict(tp=2, dp=4, pp=2, ep=2, etp=1),  # edp 4
    dict(tp=2, dp=4, pp=2, ep=4, etp=2, order=("pp", "dp", "tp", "cp")),
    dict(tp=2, cp=3, dp=2, ep=3, etp=1, order=("cp", "tp", "dp", "pp")),  # edp 4
    dict(tp=4, dp=2, pp=1, ep=8, etp=1),  # ep spans the whole stage: edp 1
    dict(tp=1, dp=6, pp=3, ep=3),
]


def _id(layout: dict[str, object]) -> str:
    return "-".join(f"{k}{'.'.join(v) if isinstance(v, tuple) else v}"
                    for k, v in layout.items())


def _dims(layout: dict[str, object]) -> ParallelDims:
    return ParallelDims(**layout)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_expert_coords_follow_the_formula_and_invert(layout: dict[str, object]) -> None:
    dims = _dims(layout)
    etp, ep, edp = dims.expert_tp, dims.ep, dims.edp
    assert etp * ep * edp == dims.tp * dims.cp * dims.dp  # folded inside one stage
    assert dims.world_size == dims.tp * dims.cp * dims.dp * dims.pp  # ep does not multiply it
    seen = set()
    for rank in range(dims.world_size):
        dense, c = dims.coords(rank), dims.expert_coords(rank)
        j, stride = 0, 1  # in-stage index: the dense mixed radix without pp
        for axis in dims.order:
            if axis != "pp":
                j += dense[axis] * stride
                stride *= dims.degree(axis)
        assert j == c["etp"] + etp * (c["ep"] + ep * c["edp"]) == dims.in_stage_index(rank)
        assert c["pp"] == dense["pp"]  # the views agree on the pipeline stage
        assert dims.expert_rank(**c) == rank
        seen.add((c["etp"], c["ep"], c["edp"], c["pp"]))
    assert len(seen) == dims.world_size  # a bijection onto the expert grid


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
@pytest.mark.parametrize("axes", [("etp",), ("ep",), ("edp",), ("etp", "ep"), ("ep", "edp"),
                                  ("etp", "ep", "edp"), ("ep", "pp")])
def test_expert_groups_partition_each_stage(layout: dict[str, object],
                                            axes: tuple[str, ...]) -> None:
    dims = _dims(layout)
    groups = dims.group_ranks(axes)
    size = 1
    for a in axes:
        size *= dims.degree(a)
    assert {len(g) for g in groups} == {size} and len(groups) == dims.world_size // size
    assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
    for g in groups:
        coords = [dims.expert_coords(r) for r in g]
        for axis in (*EXPERT_AXES, "pp"):
            values = {c[axis] for c in coords}
            assert len(values) == (dims.degree(axis) if axis in axes else 1), axis
        if "pp" not in axes:  # an expert group never leaves its pipeline stage
            assert len({dims.coords(r)["pp"] for r in g}) == 1
        for r in g:
            assert dims.group_of(r, axes) == g


def test_hand_counted_groups() -> None:
    """tp2 dp4 pp2 (16 ranks, default order tp-cp-dp-pp): stage 0 is ranks 0-7, j = rank % 8."""
    megatron = ParallelDims(tp=2, dp=4, pp=2, ep=2)  # etp = tp = 2, edp = 2
    assert megatron.group_ranks("etp") == megatron.group_ranks("tp")
    assert megatron.group_ranks("ep")[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert megatron.group_ranks("edp")[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert megatron.group_of(9, "edp") == [9, 13]
    titan = ParallelDims(tp=2, dp=4, pp=2, ep=2, etp=1)  # ep over consecutive ranks, edp 4
    assert titan.group_ranks("ep")[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert titan.group_ranks("edp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14],
                                        [9, 11, 13, 15]]
    assert titan.group_ranks("etp") == [[r] for r in range(16)]
    assert titan.expert_coords(13) == {"etp": 0, "ep": 1, "edp": 2, "pp": 1}
    assert titan.describe() == "tp2-dp4-pp2-ep2-etp1"


@pytest.mark.parametrize("layout", [dict(tp=2, dp=2), dict(tp=4, cp=2, dp=2, pp=2),
                                    dict(tp=2, dp=3, pp=2, ep=3)], ids=_id)
def test_expert_tp_defaults_to_tp_groups_and_edp_to_dp_cp(layout: dict[str, int]) -> None:
    dims = ParallelDims(**layout)
    assert dims.etp == dims.tp and dims == ParallelDims(**layout, etp=dims.tp)
    assert dims.group_ranks("etp") == dims.group_ranks("tp")  # tp fastest: Megatron's choice
    assert dims.edp == dims.dp * dims.cp // dims.ep
    if dims.ep == 1:
        assert dims.group_ranks("edp") == dims.group_ranks(("dp", "cp"))


def test_views_are_not_mixed_and_bad_degrees_fail() -> None:
    dims = ParallelDims(tp=2, dp=2, ep=2)
    with pytest.raises(ValueError, match="mix the dense view"):
        dims.group_ranks(("tp", "ep"))
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        dims.degree("xp")
    with pytest.raises(ValueError, match=r"ep=3 x etp=2 must divide the tp x cp x dp = 4"):
        ParallelDims(tp=2, dp=2, ep=3)
    with pytest.raises(ValueError, match=r"parallel\.etp=0 must be >= 1"):
        ParallelDims(tp=2, dp=2, etp=0)
    with pytest.raises(ValueError, match="edp index 2 outside degree 2"):
        ParallelDims(tp=2, dp=4, ep=2).expert_rank(edp=2)


def test_plan_shares_expert_groups_and_4096_ranks_stay_fast() -> None:
    small = plan_groups(ParallelDims(tp=2, dp=2, pp=2), experts=True)
    assert tuple(small) == (*GROUP_NAMES, *EXPERT_GROUP_NAMES)
    # ep = 1, etp = tp: no creation call of their own
    assert (small["ep"].source, small["expert_tp"].source, small["expert_dp"].source) == (
        "single", "tp", "dp_cp")
    assert tuple(plan_groups(ParallelDims(tp=2, dp=2, pp=2))) == GROUP_NAMES  # not asked for
    big = ParallelDims(tp=8, pp=8, dp=64, ep=4, etp=2)  # 4096 ranks, edp = 64
    start = time.process_time()
    plan = plan_groups(big, experts=True)
    assert time.process_time() - start < 30.0  # ~1 s of CPU; generous for a shared machine
    created = [n for n, s in plan.items() if s.creates]
    assert created == ["tp", "pp", "dp_cp", "embedding", "ep", "expert_tp"]
    assert plan["expert_dp"].source == "dp_cp"  # etp x ep = tp: edp spans what dp does
    assert (len(plan["ep"].partition), len(plan["expert_tp"].partition)) == (1024, 2048)
    for name in EXPERT_GROUP_NAMES:
        member_of = [0] * big.world_size
        for ranks in plan[name].partition:
            assert len({big.coords(r)["pp"] for r in ranks}) == 1, name
            for r in ranks:
                member_of[r] += 1
        assert member_of == [1] * big.world_size, name


# ----------------------------------------------------------------------------- validation


def _config(world: int, **parallel: object) -> Config:
    base = Config()
    cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **parallel))
    return resolve(cfg, world)


NO_MOE = "no layer has experts, so ep would change nothing"
NO_EXPERTS_TO_SPLIT = "no layer has experts to split"


def _layout_valid(cfg: Config, world: int) -> None:
    """The layout rules accept ``cfg``: its only problems are that this dense model has no
    MoE layer for ep > 1 or expert_tp > 1 to use (the layout itself is valid)."""
    found = problems(cfg, world)
    assert all(NO_MOE in p or NO_EXPERTS_TO_SPLIT in p for p in found), found
    etp = cfg.parallel.expert_tp
    assert len(found) == (cfg.parallel.ep != 1) + (etp is not None and etp > 1)


def test_ep_does_not_multiply_the_world() -> None:
    cfg = _config(8, tp=2, ep=2)
    assert cfg.parallel.dp == 4  # dp = world / (tp * pp * cp); ep folded inside
    _layout_valid(cfg, 8)
    with pytest.raises(ConfigError, match=f"parallel.ep=2 needs a mixture-of-experts .*{NO_MOE}"):
        validate(cfg, 8)
    dims = ParallelDims.from_config(cfg.parallel, 8)
    assert (dims.world_size, dims.edp) == (8, 2)
    _layout_valid(_config(8, tp=2, ep=8, expert_tp=1), 8)  # ep spans the stage, edp = 1
    validate(_config(4, order="tp-cp-ep-dp-pp"), 4)  # the old spelling loads at ep = 1
    assert ParallelDims.from_config(_config(4, order="tp-cp-ep-dp-pp").parallel, 4).order == (
        "tp", "cp", "dp", "pp")


@pytest.mark.parametrize(("world", "parallel", "expected"), [
    (8, dict(tp=2, ep=3), "parallel.ep=3 x parallel.expert_tp=2 (= tp) = 6 does not divide "
     "parallel.tp=2 x cp=1 x dp=4 = 8, the ranks of a pipeline stage"),
    (8, dict(tp=2, ep=3), "e.g. ep in [1, 2, 4]"),
    (8, dict(tp=2, ep=2, expert_tp=3), "parallel.ep=2 x parallel.expert_tp=3 = 6 does not divide"),
    (8, dict(tp=2, expert_tp=3), "expert_tp=3 alone does not divide 8: lower expert_tp"),
    (8, dict(tp=2, expert_tp=0), "parallel.expert_tp=0 must be >= 1."),
    (8, dict(ep=0), "parallel.ep=0 must be >= 1."),
    (4, dict(ep=2, order="tp-ep-cp-dp-pp"), "drop 'ep' from the order, e.g. 'tp-cp-dp-pp'"),
    (4, dict(order="tp-ep-ep-dp-pp"), "must name each axis of tp, cp, dp, pp once"),
    (8, dict(tp=2, pp=2, dp=4, ep=2), "world size 8 != parallel.tp=2 x pp=2 x cp=1 x dp=4 (ep "
     "does not multiply it)"),
])
def test_bad_expert_layouts_are_rejected(world: int, parallel: dict[str, object],
                                         expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(_config(world, **parallel), world)
    assert expected in str(info.value), str(info.value)


def test_every_small_layout_agrees_with_the_validator() -> None:
    """ParallelDims accepts exactly the (tp, dp, ep, expert_tp) the validator accepts."""
    for tp, dp, ep, etp in itertools.product((1, 2, 4), (1, 2, 3), (1, 2, 3, 4), (1, 2, 4)):
        world = tp * dp
        cfg = _config(world, tp=tp, ep=ep, expert_tp=etp)
        ok = (tp * dp) % (ep * etp) == 0
        if ok:
            _layout_valid(cfg, world)
            assert ParallelDims.from_config(cfg.parallel, world).edp == tp * dp // (ep * etp)
        else:
            with pytest.raises(ConfigError, match="does not divide"):
                validate(cfg, world)
            with pytest.raises(ValueError, match="must divide"):
                ParallelDims.from_config(ParallelConfig(tp=tp, ep=ep, expert_tp=etp), world)
