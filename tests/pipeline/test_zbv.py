"""ZB-V: the lists check in the V placement, hold at most 2 pp chunk-activations, and beat
ZB-H1's makespan; the V's messages (the turn is local), its NCCL posting and its forward-only
lists; the layers each stage's chunks hold."""

from __future__ import annotations

import pytest

from colonnade.config.choices import schedule_placement
from colonnade.models.stages import stage_chunks
from colonnade.pipeline.actions import Action, Kind, locate, peer_of, virtual_stage
from colonnade.pipeline.checker import check_schedule
from colonnade.pipeline.executor import forward_only_lists
from colonnade.pipeline.nccl_model import check_nccl, executor_groups
from colonnade.pipeline.p2p import Message, local_messages, p2p_program
from colonnade.pipeline.schedules import build_schedule
from colonnade.pipeline.simulate import replay, simulate

STAGES = range(2, 7)
MICROBATCHES = range(1, 13)

# Measured makespans (F = B = W = 0.5 per chunk, 1 per ZB-H1 stage) where pp does not divide m
# (there ZB-V reaches the bound 3 m + (pp - 1) / 2 once m >= 2 pp, see the test below):
# (pp, m) -> (zbv, zb_h1)
MEASURED = {
    (2, 3): (9.5, 10.0), (3, 4): (13.0, 14.0), (3, 7): (22.0, 23.0), (4, 5): (17.0, 18.0),
    (4, 7): (22.5, 24.0), (4, 9): (28.5, 30.0), (4, 11): (34.5, 36.0), (5, 6): (21.0, 22.0),
    (5, 12): (38.0, 40.0), (6, 7): (25.0, 26.0), (6, 10): (32.5, 35.0), (6, 11): (35.5, 38.0),
}


def _peak_until_w(actions: list[Action]) -> int:
    """Most chunk-activations a stage holds at once: +1 at F, -1 at W (its last use)."""
    held = peak = 0
    for a in actions:
        held += {Kind.F: 1, Kind.W: -1}.get(a.kind, 0)
        peak = max(peak, held)
    return peak


def _makespans(pp: int, m: int) -> tuple[float, float]:
    """(zbv, zb_h1) makespans with a stage's F = B = W = 1 (0.5 per ZB-V chunk)."""
    zbv = simulate(build_schedule("zbv", pp, 2, m), 0.5, 0.5, 0.5, placement="v").makespan
    return zbv, simulate(build_schedule("zb_h1", pp, 1, m), 1.0, 1.0, 1.0).makespan


@pytest.mark.parametrize("pp", STAGES)
def test_lists_check_complete_and_within_2pp(pp: int) -> None:
    for m in MICROBATCHES:
        lists = build_schedule("zbv", pp, 2, m)
        report = check_schedule(lists, pp, 2, m, placement="v")
        assert report.splits_w and report.num_compute == (6 * m,) * pp, m
        want = sorted((kind.value, k, c) for kind in (Kind.F, Kind.B, Kind.W)
                      for k in range(m) for c in (0, 1))
        for actions in lists:
            assert sorted((a.kind.value, a.microbatch, a.chunk) for a in actions
                          if a.is_compute) == want, m
        peaks = [_peak_until_w(actions) for actions in lists]
        assert max(peaks) == min(2 * m, 2 * pp) and all(p <= 2 * pp for p in peaks), (m, peaks)
        assert all(f <= p for f, p in zip(report.peak_in_flight, peaks, strict=True))


@pytest.mark.parametrize("pp", STAGES)
def test_makespan_beats_zb_h1(pp: int) -> None:
    """ZB-V never takes longer than ZB-H1 and is strictly faster once m > pp (at m <= pp its
    warm-up pattern over 2 pp - 1 slots leaves ZB-H1's makespan); no schedule beats the bound
    3 m + (pp - 1) / 2 (stage pp - 1 starts (pp - 1) / 2 late and has 3 m of work), which ZB-V
    reaches when pp divides m >= 2 pp (ZB-H1: 3 m + pp - 1)."""
    for m in MICROBATCHES:
        zbv, zb_h1 = _makespans(pp, m)
        bound = 3 * m + (pp - 1) / 2
        assert bound <= zbv <= zb_h1, (m, zbv, zb_h1)
        if m > pp:
            assert zbv < zb_h1 == 3 * m + pp - 1, (m, zbv, zb_h1)
        else:
            assert zbv == zb_h1, (m, zbv, zb_h1)
        if m % pp == 0 and m >= 2 * pp:
            assert zbv == bound, m
        elif (pp, m) in MEASURED:
            assert (zbv, zb_h1) == MEASURED[(pp, m)]
    assert _makespans(pp, 1) == (2 * pp + 1.0, 2 * pp + 1.0)


def test_measured_examples() -> None:
    assert _makespans(2, 4) == (12.5, 13.0)
    assert _makespans(4, 8) == (25.5, 27.0)
    sim = simulate(build_schedule("zbv", 4, 2, 8), 0.5, 0.5, 0.5, placement="v")
    assert sim.busy == (24.0,) * 4 and sim.idle == (1.5,) * 4  # (pp - 1) / 2 idle per stage
    base = simulate(build_schedule("1f1b", 4, 1, 8), 1.0, 1.0, 1.0)  # B = B + W: t_b + t_w
    assert base.makespan == 33.0


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_v_placement_and_local_turn(pp: int) -> None:
    """Stage 0 holds v 0 and v 2 pp - 1; chunk 1 sends forward to s - 1; the only local
    messages are on stage pp - 1 (chunk 0's activation into chunk 1, chunk 1's gradient into
    chunk 0); no p2p op names its own stage."""
    last = 2 * pp - 1
    assert [virtual_stage(0, c, pp, "v") for c in (0, 1)] == [0, last]
    assert [locate(v, pp, "v") for v in range(2 * pp)] == (
        [(s, 0) for s in range(pp)] + [(s, 1) for s in reversed(range(pp))])
    assert peer_of(Kind.SEND_F, 1, pp, 1, "v") == 0 and peer_of(Kind.RECV_F, 0, pp, 1, "v") == 1
    assert peer_of(Kind.SEND_F, pp - 1, pp, 0, "v") == pp - 1  # the turn
    m = pp + 1
    lists = build_schedule("zbv", pp, 2, m)
    for s, actions in enumerate(lists):
        want = ({Message(d, k, c) for k in range(m) for d, c in (("F", 1), ("B", 0))}
                if s == pp - 1 else set())
        assert local_messages(actions, s) == want, s
    for overlap in (True, False):
        for program in p2p_program(tuple(tuple(a) for a in lists), overlap, "v"):
            assert all(op.peer != program.stage for g in program.groups for op in g)
            received = {op.msg for g in program.groups for op in g if op.kind == "recv"}
            assert received.isdisjoint(local_messages(lists[program.stage], program.stage))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("pp", [2, 4])
def test_nccl_model_replays_zbv(pp: int, overlap: bool) -> None:
    for m in (1, pp, pp + 1, 2 * pp + 1):
        lists = build_schedule("zbv", pp, 2, m)
        rounds = check_nccl(lists, overlap, schedule_placement("zbv"))
        assert rounds >= max(len(g) for g in executor_groups(lists, overlap, "v")), m


@pytest.mark.parametrize("pp", STAGES)
def test_forward_only_lists_in_the_v(pp: int) -> None:
    """Every (micro-batch, chunk) forward once per stage, chunk 0 of all micro-batches
    first; the replay and the NCCL model complete (no deadlock, FIFO)."""
    for m in (1, pp, 2 * pp + 1):
        lists = forward_only_lists(pp, 2, m, "v")
        for actions in lists:
            assert [(a.microbatch, a.chunk) for a in actions if a.kind == Kind.F] == [
                (k, c) for c in (0, 1) for k in range(m)]
            assert all(a.kind in (Kind.F, Kind.RECV_F, Kind.SEND_F) for a in actions)
        timeline = replay(lists, lambda stage, a: 1.0, placement="v")
        assert [len(t) for t in timeline] == [len(a) for a in lists]
        assert check_nccl(lists, True, "v") > 0 and check_nccl(lists, False, "v") > 0


def test_stage_chunks_in_the_v() -> None:
    """8 layers, pp = 2, vp = 2: v holds layers [2v, 2v + 1]; stage 0 has v 0 (embedding) and
    v 3 (head), stage 1 v 1 and v 2; the loop would give stage 0 v 0 and v 2."""
    assert stage_chunks(8, 2, 2, 0, placement="v") == [([0, 1], True, False),
                                                       ([6, 7], False, True)]
    assert stage_chunks(8, 2, 2, 1, placement="v") == [([2, 3], False, False),
                                                       ([4, 5], False, False)]
    assert stage_chunks(8, 2, 2, 0) == [([0, 1], True, False), ([4, 5], False, False)]
    assert stage_chunks(8, 2, 2, 1, layout=(3, 1, 1, 3), placement="v") == [
        ([3], False, False), ([4], False, False)]
