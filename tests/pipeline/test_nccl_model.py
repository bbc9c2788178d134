"""The NCCL p2p model (in-order groups per rank, a group done only when all its ops matched)
and the executor's posting (:func:`p2p_program`) proven deadlock-free under it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from colonnade.config.choices import schedule_placement
from colonnade.pipeline.actions import Action, ScheduleError
from colonnade.pipeline.executor import forward_only_lists
from colonnade.pipeline.nccl_model import Group, Op, check_nccl, executor_groups, run_groups
from colonnade.pipeline.p2p import Message, received_message, recv_message
from colonnade.pipeline.schedules import build_schedule

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)]


def _f(k: int) -> Message:
    return Message("F", k, 0)


def _b(k: int) -> Message:
    return Message("B", k, 0)


def test_issue_pattern_deadlocks() -> None:
    """Issue 20's 1F1B pp=2 pattern: stage 0 {send F0, recv B0} while stage 1 posts {recv F1}
    ahead of its send B0, and stage 0's send F1 sits behind its first group."""
    s0 = [(Op("send", 1, _f(0)), Op("recv", 1, _b(0))), (Op("send", 1, _f(1)),)]
    s1 = [(Op("recv", 0, _f(0)),), (Op("recv", 0, _f(1)),), (Op("send", 0, _b(0)),)]
    with pytest.raises(ScheduleError, match=r"rank 0 group 0/2 waits on: recv<-1 B0\.0"):
        run_groups([s0, s1])


def test_paired_groups_complete_in_counted_rounds() -> None:
    """The same traffic posted Megatron-style (matching groups one to one) completes."""
    s0 = [(Op("send", 1, _f(0)),), (Op("send", 1, _f(1)), Op("recv", 1, _b(0)))]
    s1 = [(Op("recv", 0, _f(0)),), (Op("recv", 0, _f(1)), Op("send", 0, _b(0)))]
    assert run_groups([s0, s1]) == 2


def test_mismatched_payload_rejected() -> None:
    with pytest.raises(ScheduleError, match="different messages"):
        run_groups([[(Op("send", 1, _f(0)),)], [(Op("recv", 0, _f(1)),)]])


def legacy_groups(lists: Sequence[Sequence[Action]], overlap: bool,
                  placement: str = "loop") -> list[list[Group]]:
    """The posting the executor used before issue 20 (main at 7723d49), rebuilt here as the
    negative case: one group per run of communication actions between two computes, holding
    the run's sends and its receives plus, with overlap, the next run's receives; receives
    on a pair in the sender's send order. Local messages (the V's turn) take no op."""
    pp = len(lists)
    out: list[list[Group]] = []
    for stage, actions in enumerate(lists):
        stream: dict[int, list[Message]] = {}
        for src, acts in enumerate(lists):
            for a in acts:
                if a.is_send and src != stage and a.peer == stage:
                    stream.setdefault(src, []).append(received_message(a, src, pp,
                                                                       placement)[1])
        posted = dict.fromkeys(stream, 0)
        runs: list[list[Action]] = [[]]
        for a in actions:
            if a.is_comm and a.peer != stage:
                runs[-1].append(a)
            elif a.is_compute:
                runs.append([])
        groups: list[Group] = []
        for i, run in enumerate(runs):
            ops = [Op("send", *received_message(a, stage, pp, placement)) for a in run
                   if a.is_send]
            want = [a for a in run if a.is_recv] + (
                [a for a in runs[i + 1] if a.is_recv] if overlap and i + 1 < len(runs) else [])
            for a in want:
                peer, msg = a.peer_stage, recv_message(a)
                while posted[peer] <= stream[peer].index(msg):
                    ops.append(Op("recv", peer, stream[peer][posted[peer]]))
                    posted[peer] += 1
            if ops:
                groups.append(tuple(ops))
        out.append(groups)
    return out


@pytest.mark.parametrize("name,vp", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_legacy_overlap_posting_is_caught(name: str, vp: int, pp: int) -> None:
    """The pre-fix posting with overlap_p2p hangs on NCCL for every schedule; the model says so."""
    with pytest.raises(ScheduleError, match="NCCL p2p deadlock"):
        run_groups(legacy_groups(build_schedule(name, pp, vp, 2 * pp), overlap=True,
                                 placement=schedule_placement(name)))


def test_legacy_interleaved_without_overlap_is_caught() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0 group 5/15 waits on: send->1 B0\.0"):
        run_groups(legacy_groups(build_schedule("interleaved_1f1b", 2, 2, 4), overlap=False))


def _cases() -> list[tuple[str, int, int, int]]:
    """Every schedule x pp {2, 4} x vp {1, 2} x m {pp, 2pp, pp + 1} the schedule accepts."""
    out = []
    for name, _ in SCHEDULES:
        for pp in (2, 4):
            for vp in (1, 2):
                for m in (pp, 2 * pp, pp + 1):
                    try:
                        build_schedule(name, pp, vp, m)
                    except ScheduleError:
                        continue
                    out.append((name, pp, vp, m))
    return out


CASES = _cases()


def test_case_matrix_covers_every_schedule() -> None:
    assert {c[0] for c in CASES} == {n for n, _ in SCHEDULES} and len(CASES) == 30


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name,pp,vp,m", CASES)
def test_executor_posting_is_deadlock_free_under_nccl(name: str, pp: int, vp: int, m: int,
                                                      overlap: bool) -> None:
    lists = build_schedule(name, pp, vp, m)
    placement = schedule_placement(name)
    groups = executor_groups(lists, overlap, placement)
    rounds = check_nccl(lists, overlap, placement)
    assert rounds >= max(len(g) for g in groups)  # every group of every rank completed
    sent = sum(op.kind == "send" for gs in groups for g in gs for op in g)
    # the V's turn (stage pp - 1 to itself) is handed over without p2p
    assert sent == sum(a.is_send and a.peer != s for s, actions in enumerate(lists)
                       for a in actions)
    assert all(op.peer != s for s, gs in enumerate(groups) for g in gs for op in g)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("pp,vp,m,placement", [(2, 1, 3, "loop"), (4, 2, 8, "loop"),
                                               (4, 2, 5, "loop"), (2, 2, 3, "v"),
                                               (4, 2, 8, "v"), (4, 2, 5, "v")])
def test_forward_only_posting_is_deadlock_free_under_nccl(pp: int, vp: int, m: int,
                                                          placement: str,
                                                          overlap: bool) -> None:
    assert check_nccl(forward_only_lists(pp, vp, m, placement), overlap, placement) > 0


def test_check_nccl_needs_the_lists_placement() -> None:
    """zbv lists read in the "loop" placement name the turn's message wrongly."""
    lists = build_schedule("zbv", 2, 2, 4)
    assert check_nccl(lists, True, "v") > 0
    with pytest.raises(ScheduleError, match=r"FIFO mismatch on channel F 1->1"):
        check_nccl(lists, True)


def test_large_pipeline_is_deadlock_free() -> None:
    """pp=8, vp=2, 32 micro-batches: 1,000+ messages in well under a second."""
    assert check_nccl(build_schedule("interleaved_1f1b", 8, 2, 32), overlap=True) > 0
