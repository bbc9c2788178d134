"""The checker: numbers it reports, and corrupted schedules it must reject (each one named)."""

from __future__ import annotations

import pytest

from colonnade.pipeline.actions import Action, Kind, ScheduleError
from colonnade.pipeline.checker import check_schedule
from colonnade.pipeline.schedules import build_schedule


def _index(actions: list[Action], text: str) -> int:
    return [str(a) for a in actions].index(text)


def _base(pp: int = 3, m: int = 4) -> list[list[Action]]:
    return build_schedule("1f1b", pp, 1, m)


def test_report_numbers_1f1b() -> None:
    report = check_schedule(_base(2, 2), 2, 1, 2)
    assert report.num_actions == (8, 8)
    assert report.total_actions == 16
    assert report.num_compute == (4, 4)
    assert report.peak_in_flight == (2, 1)
    assert report.peak_pending_w == (0, 0)
    assert not report.splits_w


def test_report_numbers_zb_h1_and_gpipe() -> None:
    zb = check_schedule(build_schedule("zb_h1", 4, 1, 8), 4, 1, 8)
    assert zb.splits_w and zb.num_compute == (24,) * 4
    assert zb.peak_in_flight == (4, 3, 2, 1)  # same activation memory as 1F1B
    assert zb.peak_pending_w == (1, 2, 3, 4)  # stage s defers s weight-grads
    gp = check_schedule(build_schedule("gpipe", 4, 1, 6), 4, 1, 6)
    assert gp.peak_in_flight == (6, 6, 6, 6)
    # stage 0: 6 F + 6 SEND_F + 6 RECV_B + 6 B; middle stages have both recvs and sends
    assert gp.num_actions == (24, 36, 36, 24)


def test_rejects_missing_b() -> None:
    lists = _base()
    del lists[1][_index(lists[1], "B1c0")]
    with pytest.raises(ScheduleError, match=r"stage 1: missing B1c0"):
        check_schedule(lists, 3, 1, 4)


def test_rejects_duplicated_f() -> None:
    lists = _base()
    lists[0].append(Action(Kind.F, 2, 0))
    with pytest.raises(ScheduleError, match=r"stage 0: duplicated F2c0 at actions #\d+ and #\d+"):
        check_schedule(lists, 3, 1, 4)


def test_rejects_swapped_recv_order() -> None:
    lists = _base()
    i, j = _index(lists[1], "rF0c0<0"), _index(lists[1], "rF1c0<0")
    lists[1][i], lists[1][j] = lists[1][j], lists[1][i]
    with pytest.raises(
        ScheduleError,
        match=r"FIFO mismatch on channel F 0->1: message #0 was sent by stage 0 as sF0c0>1 "
        r"\(micro-batch 0, virtual stage 0\) but receive rF1c0<0 on stage 1 expects micro-batch 1",
    ):
        check_schedule(lists, 3, 1, 4)


def test_rejects_swapped_forward_blocks_at_interleaved_wrap() -> None:
    """Stage 0 runs chunk 1 of micro-batches 0 and 1 in the opposite order to stage 1's sends."""
    lists = build_schedule("interleaved_1f1b", 2, 2, 4)
    s0 = lists[0]
    a, b = _index(s0, "rF0c1<1"), _index(s0, "rF1c1<1")
    s0[a : a + 3], s0[b : b + 3] = s0[b : b + 3], s0[a : a + 3]
    with pytest.raises(
        ScheduleError,
        match=r"FIFO mismatch on channel F 1->0: message #0 was sent by stage 1 as sF0c0>0 "
        r"\(micro-batch 0, virtual stage 1\) but receive rF1c1<1 on stage 0",
    ):
        check_schedule(lists, 2, 2, 4)


def test_rejects_recv_with_no_send_as_deadlock() -> None:
    lists = _base()
    del lists[0][_index(lists[0], "sF3c0>1")]  # the last activation stage 0 -> 1
    with pytest.raises(ScheduleError, match=r"deadlock") as err:
        check_schedule(lists, 3, 1, 4)
    text = str(err.value)
    assert "stage 1: blocked at action" in text and "rF3c0<0" in text
    assert "waiting for message #3 on channel F 0->1 (stage 0 has sent 3 so far)" in text
    assert "stage 0: blocked at action #11 rB2c0<1" in text  # stage 1 never sends that gradient


def test_rejects_send_posted_after_dependent_recv_as_deadlock() -> None:
    """Stage 0 waits for B0's gradient before sending F0's activation: a cycle."""
    lists = _base(2, 1)
    assert [str(a) for a in lists[0]] == ["F0c0", "sF0c0>1", "rB0c0<1", "B0c0"]
    lists[0][1], lists[0][2] = lists[0][2], lists[0][1]
    with pytest.raises(ScheduleError, match=r"deadlock") as err:
        check_schedule(lists, 2, 1, 1)
    assert "stage 0: blocked at action #1 rB0c0<1" in str(err.value)
    assert "stage 1: blocked at action #0 rF0c0<0" in str(err.value)


def test_rejects_send_never_received() -> None:
    lists = _base()
    del lists[2][_index(lists[2], "rF3c0<1")]
    with pytest.raises(ScheduleError, match=r"stage 1 sends 4 messages on channel F 1->2 but"):
        check_schedule(lists, 3, 1, 4)


def test_rejects_forward_before_its_recv() -> None:
    lists = _base()
    recv = lists[1].pop(_index(lists[1], "rF3c0<0"))
    lists[1].insert(_index(lists[1], "F3c0") + 1, recv)
    with pytest.raises(ScheduleError, match=r"stage 1: F3c0 .* needs its RECV_F before it"):
        check_schedule(lists, 3, 1, 4)


def test_rejects_wrong_peer_and_bad_shape() -> None:
    lists = _base()
    i = _index(lists[0], "sF0c0>1")
    lists[0][i] = Action(Kind.SEND_F, 0, 0, peer=2)
    with pytest.raises(ScheduleError, match=r"peer must be stage 1 for SEND_F with pp=3, got 2"):
        check_schedule(lists, 3, 1, 4)
    with pytest.raises(ScheduleError, match=r"one action list per stage \(pp=4\), got 3"):
        check_schedule(_base(), 4, 1, 4)
    with pytest.raises(ScheduleError, match=r"micro-batch must be < m=3"):
        check_schedule(_base(), 3, 1, 3)


def test_rejects_backward_before_forward() -> None:
    lists = _base(1, 2)
    lists[0] = [Action(Kind.B, 0), Action(Kind.F, 0), Action(Kind.F, 1), Action(Kind.B, 1)]
    with pytest.raises(ScheduleError, match=r"stage 0: B0c0 \(action #0\) runs before its F0c0"):
        check_schedule(lists, 1, 1, 2)


def test_rejects_w_errors() -> None:
    lists = build_schedule("zb_h1", 2, 1, 2)
    i, j = _index(lists[1], "B0c0"), _index(lists[1], "W0c0")
    bad = [list(x) for x in lists]
    bad[1][i], bad[1][j] = bad[1][j], bad[1][i]
    with pytest.raises(ScheduleError, match=r"stage 1: W0c0 .* runs before its B0c0"):
        check_schedule(bad, 2, 1, 2)
    missing = [list(x) for x in lists]
    del missing[0][_index(missing[0], "W1c0")]
    with pytest.raises(ScheduleError, match=r"stage 0: missing W1c0 \(the schedule splits B"):
        check_schedule(missing, 2, 1, 2)


def test_report_numbers_zbv() -> None:
    """pp=2, m=4 in the V: stage 0 (v 0 and 3) has 4 comm actions per micro-batch, stage 1
    (v 1 and 2, the turn) 8, four of them local; peaks are chunk-activations."""
    lists = build_schedule("zbv", 2, 2, 4)
    report = check_schedule(lists, 2, 2, 4, placement="v")
    assert report.splits_w and report.num_compute == (24, 24)
    assert report.num_actions == (24 + 4 * 4, 24 + 8 * 4)
    assert report.peak_in_flight == (4, 4) and report.peak_pending_w == (1, 3)
    assert sum(a.is_comm and a.peer == 1 for a in lists[1]) == 4 * 4  # the local hand-overs


def test_rejects_loop_peer_in_the_v() -> None:
    """Stage 0's chunk-1 receive comes from stage 1 in the V; the loop's peer is named."""
    lists = build_schedule("zbv", 3, 2, 3)
    i = _index(lists[1], "sF0c1>0")
    lists[1][i] = Action(Kind.SEND_F, 0, 1, peer=2)
    with pytest.raises(ScheduleError, match=r"stage 1 action #\d+ sF0c1>2: peer must be stage 0"):
        check_schedule(lists, 3, 2, 3, placement="v")


def test_rejects_swapped_local_hand_over_at_the_turn() -> None:
    """The turn's messages (stage pp - 1 to itself) are FIFO like any other channel."""
    lists = build_schedule("zbv", 2, 2, 4)
    s1 = lists[1]
    a, b = _index(s1, "rF0c1<1"), _index(s1, "rF1c1<1")
    s1[a], s1[b] = s1[b], s1[a]
    with pytest.raises(ScheduleError, match=r"FIFO mismatch on channel F 1->1: message #0 was "
                       r"sent by stage 1 as sF0c0>1 \(micro-batch 0, virtual stage 1\)"):
        check_schedule(lists, 2, 2, 4, placement="v")
