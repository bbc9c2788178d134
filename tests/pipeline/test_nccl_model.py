"""The NCCL p2p model: in-order groups per rank, a group done only when all its ops matched."""

from __future__ import annotations

import pytest

from colonnade.pipeline.actions import ScheduleError
from colonnade.pipeline.nccl_model import Op, check_nccl, executor_groups, run_groups
from colonnade.pipeline.p2p import Message
from colonnade.pipeline.schedules import build_schedule


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


def test_executor_groups_1f1b_pp2() -> None:
    """The groups derive from the executor's own batching (post_plan + RecvOrder)."""
    groups = executor_groups(build_schedule("1f1b", 2, 1, 2), overlap=True)
    assert [[str(op) for op in g] for g in groups[0]] == [
        ["send->1 F0.0", "recv<-1 B0.0"], ["send->1 F1.0", "recv<-1 B1.0"]]
    assert len(groups[1]) == 4


@pytest.mark.parametrize("name,vp", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                     ("zb_h1", 1)])
@pytest.mark.parametrize("pp", [2, 4])
def test_today_overlap_posting_deadlocks_under_nccl(name: str, vp: int, pp: int) -> None:
    """Issue 20 item 1 (open): with overlap_p2p the executor's posting hangs on NCCL."""
    with pytest.raises(ScheduleError, match="NCCL p2p deadlock"):
        check_nccl(build_schedule(name, pp, vp, 2 * pp), overlap=True)


@pytest.mark.parametrize("name,pp,m,rounds", [
    ("gpipe", 2, 3, 6), ("gpipe", 4, 5, 14), ("1f1b", 2, 4, 5), ("1f1b", 4, 8, 19),
    ("zb_h1", 2, 3, 5), ("zb_h1", 4, 8, 29), ("interleaved_1f1b", 4, 4, 21)])
def test_no_overlap_posting_completes(name: str, pp: int, m: int, rounds: int) -> None:
    vp = 2 if name == "interleaved_1f1b" else 1
    assert check_nccl(build_schedule(name, pp, vp, m), overlap=False) == rounds


def test_interleaved_no_overlap_pp2_m4_deadlocks() -> None:
    """Open: even without overlap, interleaved pp=2 m=4 posts a send behind an unmatched recv."""
    with pytest.raises(ScheduleError, match=r"rank 0 group 5/15 waits on: send->1 B0\.0"):
        check_nccl(build_schedule("interleaved_1f1b", 2, 2, 4), overlap=False)
