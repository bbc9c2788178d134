"""Schedules: exact orders, the checker over a grid of layouts, bubbles and peaks by simulation."""

from __future__ import annotations

import random

import pytest

from colonnade.pipeline.actions import Action, Kind, ScheduleError, format_schedule, peer_of
from colonnade.pipeline.checker import check_schedule
from colonnade.pipeline.schedules import (
    SCHEDULES,
    build_schedule,
    interleaved_groups,
    one_f_one_b,
)
from colonnade.pipeline.simulate import Dag, one_stage_bound, simulate, timing
from tests.pipeline.test_zbv import _peak_until_w


def _row(actions: list[Action], compute_only: bool = True) -> str:
    return " ".join(str(a) for a in actions if not (compute_only and a.is_comm))


def _microbatch_counts(pp: int) -> list[int]:
    return sorted({1, pp, 2 * pp, pp + 1, 3 * pp + 1})


GRID = [
    (name, pp, vp, m)
    for name in SCHEDULES
    for pp in (1, 2, 3, 4, 8)
    for vp in (1, 2, 3)
    for m in _microbatch_counts(pp)
]


def _expected_peak(name: str, pp: int, vp: int, m: int, stage: int) -> int:
    if name == "gpipe":
        return m
    if name in ("1f1b", "zb_h1"):
        return min(pp - stage, m)
    group = max(len(g) for g in interleaved_groups(pp, m))
    return min(2 * (pp - stage - 1) + (vp - 1) * group + 1, vp * m)


@pytest.mark.parametrize(("name", "pp", "vp", "m"), GRID)
def test_grid_checks_or_raises_documented_error(name: str, pp: int, vp: int, m: int) -> None:
    if name == "zbv":
        _check_zbv_grid(pp, vp, m)
        return
    if name != "interleaved_1f1b" and vp != 1:
        with pytest.raises(ScheduleError, match=r"parallel\.vp must be 1"):
            build_schedule(name, pp, vp, m)
        return
    if name == "interleaved_1f1b" and (vp < 2 or pp < 2):
        field = r"parallel\.vp >= 2" if vp < 2 else r"parallel\.pp >= 2"
        with pytest.raises(ScheduleError, match=field):
            build_schedule(name, pp, vp, m)
        return
    lists = build_schedule(name, pp, vp, m)
    report = check_schedule(lists, pp, vp, m)
    per_item = 3 if name == "zb_h1" else 2
    assert report.num_compute == (per_item * vp * m,) * pp
    assert report.splits_w == (name == "zb_h1")
    assert report.peak_in_flight == tuple(_expected_peak(name, pp, vp, m, s) for s in range(pp))


def _check_zbv_grid(pp: int, vp: int, m: int) -> None:
    """zbv needs vp = 2; its lists check in the "v" placement, split W, and hold at most 2 pp
    chunk-activations (F done, W not done) on every stage, reaching min(2 m, 2 pp)."""
    if vp != 2:
        with pytest.raises(ScheduleError, match=rf"parallel\.vp must be 2 \(got vp={vp}\)"):
            build_schedule("zbv", pp, vp, m)
        return
    lists = build_schedule("zbv", pp, vp, m)
    report = check_schedule(lists, pp, vp, m, placement="v")
    assert report.num_compute == (3 * vp * m,) * pp and report.splits_w
    until_w = [_peak_until_w(actions) for actions in lists]
    assert max(until_w) == min(2 * m, 2 * pp) and all(p <= 2 * pp for p in until_w)
    assert all(f <= w for f, w in zip(report.peak_in_flight, until_w, strict=True))
    if pp >= 2:  # at pp = 1 both placements put v = c on chunk c
        with pytest.raises(ScheduleError, match=r"FIFO mismatch|peer must be stage"):
            check_schedule(lists, pp, vp, m)  # the "loop" placement misreads the V's messages


def test_one_f_one_b_order_pp4_m6() -> None:
    rows = [_row(one_f_one_b(4, 1, 6, s)) for s in range(4)]
    assert rows == [
        "F0c0 F1c0 F2c0 F3c0 B0c0 F4c0 B1c0 F5c0 B2c0 B3c0 B4c0 B5c0",
        "F0c0 F1c0 F2c0 B0c0 F3c0 B1c0 F4c0 B2c0 F5c0 B3c0 B4c0 B5c0",
        "F0c0 F1c0 B0c0 F2c0 B1c0 F3c0 B2c0 F4c0 B3c0 F5c0 B4c0 B5c0",
        "F0c0 B0c0 F1c0 B1c0 F2c0 B2c0 F3c0 B3c0 F4c0 B4c0 F5c0 B5c0",
    ]


def test_one_f_one_b_comm_placement() -> None:
    lists = build_schedule("1f1b", 2, 1, 2)
    assert _row(lists[0], compute_only=False) == (
        "F0c0 sF0c0>1 F1c0 sF1c0>1 rB0c0<1 B0c0 rB1c0<1 B1c0"
    )
    assert _row(lists[1], compute_only=False) == (
        "rF0c0<0 F0c0 B0c0 sB0c0>0 rF1c0<0 F1c0 B1c0 sB1c0>0"
    )


def test_gpipe_order() -> None:
    assert _row(build_schedule("gpipe", 2, 1, 3)[1]) == "F0c0 F1c0 F2c0 B0c0 B1c0 B2c0"


def test_interleaved_order_matches_megatron_pp2_vp2_m4() -> None:
    lists = build_schedule("interleaved_1f1b", 2, 2, 4)
    # stage 0: warmup 2*(2-0-1) + (2-1)*2 = 4 chunk-forwards, then 1F1B, chunk 1 backward first
    assert _row(lists[0]) == (
        "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0"
    )
    # stage 1 (last virtual stage is chunk 1 here): warmup 2
    assert _row(lists[1]) == (
        "F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 B2c0 B3c0"
    )
    # the wrap-around: chunk 1 of stage 0 receives from stage 1, gradients go back to stage 1
    assert str(lists[0][4]) == "rF0c1<1"
    assert "sB0c1>1" in _row(lists[0], compute_only=False)


def test_interleaved_groups_spread_remainder() -> None:
    assert [list(g) for g in interleaved_groups(4, 8)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [len(g) for g in interleaved_groups(4, 13)] == [5, 4, 4]
    assert [len(g) for g in interleaved_groups(4, 5)] == [5]
    assert [len(g) for g in interleaved_groups(4, 3)] == [3]


def test_zb_h1_order_pp4_m6() -> None:
    rows = [_row(build_schedule("zb_h1", 4, 1, 6)[s]) for s in range(4)]
    assert rows[0] == (
        "F0c0 F1c0 F2c0 F3c0 B0c0 W0c0 F4c0 B1c0 W1c0 F5c0 B2c0 W2c0 B3c0 W3c0 B4c0 W4c0 B5c0 W5c0"
    )
    assert rows[3] == (
        "F0c0 B0c0 F1c0 B1c0 F2c0 B2c0 F3c0 B3c0 W0c0 F4c0 B4c0 W1c0 F5c0 B5c0 W2c0 W3c0 W4c0 W5c0"
    )
    # F/B order is exactly 1F1B's, hence the same activation memory
    for s in range(4):
        fb = [a for a in build_schedule("zb_h1", 4, 1, 6)[s] if a.kind in (Kind.F, Kind.B)]
        assert fb == [a for a in one_f_one_b(4, 1, 6, s) if a.is_compute]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("pipedream", 2, 1, 4), r"unknown pipeline schedule 'pipedream'.*1f1b"),
        (("gpipe", 2, 2, 4), r"parallel\.vp must be 1 \(got vp=2\).*interleaved_1f1b"),
        (("zb_h1", 2, 3, 4), r"parallel\.vp must be 1"),
        (("zbv", 2, 1, 4), r"zbv runs two chunks per stage.*parallel\.vp must be 2 \(got vp=1\)"),
        (("zbv", 4, 3, 8), r"set parallel\.vp=2"),
        (("interleaved_1f1b", 2, 1, 4), r"parallel\.vp >= 2.*'1f1b'"),
        (("interleaved_1f1b", 1, 2, 4), r"parallel\.pp >= 2"),
        (("1f1b", 2, 1, 0), r"training\.microbatches must be an integer >= 1, got 0"),
        (("1f1b", 0, 1, 4), r"parallel\.pp must be an integer >= 1"),
    ],
)
def test_build_schedule_rejects_bad_arguments(args: tuple, pattern: str) -> None:
    with pytest.raises(ScheduleError, match=pattern):
        build_schedule(*args)


def test_stage_out_of_range() -> None:
    with pytest.raises(ScheduleError, match=r"stage must be in \[0, parallel\.pp=2\), got 2"):
        one_f_one_b(2, 1, 4, 2)


def test_action_str_peer_and_direction() -> None:
    send = Action(Kind.SEND_F, 3, 1, peer_of(Kind.SEND_F, 3, 4))
    assert (str(send), send.peer_stage, send.direction) == ("sF3c1>0", 0, "F")
    recv = Action(Kind.RECV_B, 2, 0, peer_of(Kind.RECV_B, 0, 4))
    assert (str(recv), recv.peer_stage, recv.direction) == ("rB2c0<1", 1, "B")
    assert peer_of(Kind.RECV_F, 0, 4) == 3 and peer_of(Kind.SEND_B, 0, 4) == 3
    assert str(Action(Kind.F, 3, 1)) == "F3c1"
    with pytest.raises(ScheduleError, match="no peer stage"):
        _ = Action(Kind.W, 0).peer_stage
    with pytest.raises(ScheduleError, match="needs a peer"):
        Action(Kind.SEND_B, 0, 0)


def test_format_schedule_table() -> None:
    table = format_schedule(build_schedule("1f1b", 2, 1, 2), compute_only=True)
    assert table.splitlines() == [
        "stage 0 | F0c0 F1c0 B0c0 B1c0",
        "stage 1 | F0c0 B0c0 F1c0 B1c0",
    ]
    full = format_schedule(build_schedule("1f1b", 2, 1, 2)).splitlines()
    assert full[1].startswith("stage 1 | rF0c0<0 F0c0")


# ---- timing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_one_f_one_b_and_gpipe_bubble(name: str, pp: int) -> None:
    for m in _microbatch_counts(pp):
        sim = simulate(build_schedule(name, pp, 1, m), t_f=1.0, t_b=2.0, t_w=0.0)
        assert sim.makespan == pytest.approx(3.0 * (m + pp - 1))
        assert sim.busy == pytest.approx([3.0 * m] * pp)
        assert sim.bubble_fraction == pytest.approx([(pp - 1) / (m + pp - 1)] * pp)
        ideal = 3.0 * m
        assert [i / ideal for i in sim.idle] == pytest.approx([(pp - 1) / m] * pp)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("vp", [2, 3])
def test_interleaved_bubble_is_p_minus_1_over_vm(pp: int, vp: int) -> None:
    for m in [pp, 2 * pp, pp + 1, 3 * pp + 1]:
        sim = simulate(build_schedule("interleaved_1f1b", pp, vp, m), t_f=1.0, t_b=2.0, t_w=0.0)
        ideal = 3.0 * vp * m  # vp chunks of F + B per micro-batch
        assert sim.busy == pytest.approx([ideal] * pp)
        assert [i / ideal for i in sim.idle] == pytest.approx([(pp - 1) / (vp * m)] * pp)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_h1_bubble_matches_qi_et_al(pp: int) -> None:
    t = 1.0
    for m in [pp, 2 * pp, pp + 1, 3 * pp + 1]:
        zb = simulate(build_schedule("zb_h1", pp, 1, m), t_f=t, t_b=t, t_w=t)
        # (p - 1)(T_F + T_B - T_W) idle on every stage, a third of 1F1B's (p - 1)(T_F + T_B + T_W)
        assert zb.idle == pytest.approx([(pp - 1) * (t + t - t)] * pp)
        assert zb.makespan == pytest.approx(3 * t * m + (pp - 1) * t)
        base = simulate(build_schedule("1f1b", pp, 1, m), t_f=t, t_b=t, t_w=t)
        assert base.idle == pytest.approx([(pp - 1) * 3 * t] * pp)
        assert zb.max_bubble_fraction < base.max_bubble_fraction


def test_zb_h1_beats_1f1b_with_unequal_costs() -> None:
    for pp, m in [(4, 8), (8, 17)]:
        zb = simulate(build_schedule("zb_h1", pp, 1, m), t_f=1.0, t_b=1.3, t_w=0.7)
        base = simulate(build_schedule("1f1b", pp, 1, m), t_f=1.0, t_b=1.3, t_w=0.7)
        assert zb.busy == pytest.approx(base.busy)
        assert zb.makespan < base.makespan


def test_unsplit_backward_costs_t_b_plus_t_w_and_comm_latency() -> None:
    one = simulate(build_schedule("1f1b", 1, 1, 3), t_f=1.0, t_b=2.0, t_w=0.5)
    split = simulate(build_schedule("zb_h1", 1, 1, 3), t_f=1.0, t_b=2.0, t_w=0.5)
    assert one.makespan == pytest.approx(10.5) and split.makespan == pytest.approx(10.5)
    # pp=2, m=1: F0 (1) + send (0.5) + F1 (1) + B1 (2) + send (0.5) + B0 (2)
    sim = simulate(build_schedule("1f1b", 2, 1, 1), t_f=1.0, t_b=2.0, t_w=0.0, t_comm=0.5)
    assert sim.makespan == pytest.approx(7.0)
    first = sim.timeline[1][0]
    assert (str(first.action), first.start, first.end) == ("rF0c0<0", 0.0, 1.5)
    assert sim.busy == pytest.approx([3.0, 3.0])
    with pytest.raises(ScheduleError, match="t_comm must be >= 0"):
        simulate(build_schedule("1f1b", 2, 1, 1), 1.0, 2.0, 0.0, t_comm=-1.0)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_compiled_dag_times_exactly_as_the_replay(name: str) -> None:
    """Dag.makespan (the planner's fast path) equals replay's makespan for every schedule, with
    durations that differ per stage, chunk, kind and micro-batch and a comm latency."""
    rng = random.Random(name)
    vp = 2 if name in ("interleaved_1f1b", "zbv") else 1
    placement = "v" if name == "zbv" else "loop"
    for pp, m in ((1, 3), (2, 4), (3, 6), (4, 9)):
        if name == "interleaved_1f1b" and pp == 1:
            continue
        lists = build_schedule(name, pp, vp, m)
        dag = Dag.of(lists, placement)
        for t_comm in (0.0, 0.3):
            table = {(s, a): rng.uniform(0.1, 2.0) for s, stage in enumerate(lists)
                     for a in stage}
            duration = lambda stage, a, table=table: table[stage, a]  # noqa: E731

            want = timing(lists, duration, t_comm, placement).makespan
            assert dag.makespan(duration, t_comm) == pytest.approx(want, rel=1e-15, abs=0)
    with pytest.raises(ScheduleError, match="deadlock"):
        first, second = build_schedule("1f1b", 2, 1, 2)
        Dag.of([list(reversed(first)), second])


def _makespan(name: str, times: list[dict[str, float]], m: int) -> float:
    """Replay of schedule ``name`` with per-stage times keyed "F", "B", "W" (vp = 1), or
    "F0", "B1", ... per chunk (zbv); an unsplit backward costs B + W."""
    vp = 2 if name == "zbv" else 1
    placement = "v" if name == "zbv" else "loop"

    def duration(stage: int, a: Action) -> float:
        t = times[stage]
        if vp == 2:
            return t[f"{a.kind.value}{a.chunk}"]
        if a.kind == Kind.B and name != "zb_h1":
            return t["B"] + t["W"]
        return t[a.kind.value]

    return timing(build_schedule(name, len(times), vp, m), duration, placement=placement).makespan


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_no_one_stage_schedule_beats_the_bound(pp: int) -> None:
    rng = random.Random(pp)
    for _ in range(20):
        times = [{kind: rng.uniform(0.1, 2.0) for kind in "FBW"} for _ in range(pp)]
        for m in (pp, pp + 1, 2 * pp, 3 * pp + 1):
            bound = one_stage_bound(times, m)
            head = sum(t["F"] for t in times[:-1])
            assert bound >= head + m * sum(times[-1].values()) - 1e-12
            for name in ("gpipe", "1f1b", "zb_h1"):
                assert _makespan(name, times, m) >= bound - 1e-9, name
    # equal stages, T_F = T_B = T_W = 1: ZB-H1's (p - 1)(T_F + T_B - T_W) + 3m is the bound
    for m in (pp, 2 * pp, 3 * pp + 1):
        equal = [{"F": 1.0, "B": 1.0, "W": 1.0}] * pp
        assert _makespan("zb_h1", equal, m) == pytest.approx(one_stage_bound(equal, m))
        assert one_stage_bound(equal, m) == pytest.approx(pp - 1 + 3 * m)
    with pytest.raises(ScheduleError, match="m must be >= 1"):
        one_stage_bound(equal, 0)


GPT2_TINY_PP2_MS = [{"F": 21.65, "B": 0.07, "W": 43.52}, {"F": 25.09, "B": 29.28, "W": 23.73}]
"""Issue 19's gpt2-tiny at pp = 2, 4 micro-batches of 4 x 128 tokens: median ms per action on
the 2-core machine under zb_h1 (stage 0 holds the embedding: its B has no input gradient to
make, its W is the whole backward; stage 1 the head and the loss)."""
GPT2_TINY_ZBV_MS = [
    {"F0": 11.03, "B0": 0.03, "W0": 21.92, "F1": 14.44, "B1": 17.37, "W1": 13.61},
    {"F0": 11.03, "B0": 13.03, "W0": 10.13, "F1": 10.88, "B1": 13.28, "W1": 10.13},
]
"""The same model under zbv, per rank and chunk (rank 0: embedding + layer 0 and layer 3 +
head + loss; rank 1: layers 1 and 2)."""


def test_zb_h1_reaches_the_bound_that_zbv_beats_on_gpt2_tiny() -> None:
    """Why issue 19's "pp2 ZB-H1 vs torch ZBV" row reads ~0.94: with the measured action times
    ZB-H1 already runs at the least makespan of any one-stage-per-rank schedule (the first
    forward on stage 0, then all of the heavier last stage's work), while the V placement
    starts its busiest rank at once."""
    bound = one_stage_bound(GPT2_TINY_PP2_MS, 4)
    assert bound == pytest.approx(21.65 + 4 * (25.09 + 29.28 + 23.73))
    assert _makespan("zb_h1", GPT2_TINY_PP2_MS, 4) == pytest.approx(bound)
    assert _makespan("1f1b", GPT2_TINY_PP2_MS, 4) > 1.08 * bound
    zbv = _makespan("zbv", GPT2_TINY_ZBV_MS, 4)
    assert zbv == pytest.approx(4 * sum(GPT2_TINY_ZBV_MS[0].values()))  # rank 0 never idles
    assert 0.93 < zbv / bound < 0.95
