"""The per-rank monitor in-process: the watchdog fires on no progress (and only then), SIGTERM is
recorded by the watchdog thread, and the launcher's report ranks the likely cause first.

Ordering: a test whose watchdog must fire waits for the record file (written last, atomically)
with a backstop; a test that proves the watchdog stays quiet runs it round by round
(:class:`WatchdogRounds`) against a :class:`ManualClock`, so no stall of any thread can make an
idle time the test did not set.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.reliability.monitor import RankInfo, RankMonitor, failure_path, heartbeat_path
from colonnade.reliability.report import failure_report, rank_statuses
from tests.reliability.jobs import ManualClock, WatchdogRounds, wait_until

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`


def _stats_with_pending_op() -> CommStats:
    stats = CommStats()
    group = CommGroup("dp", [1, 3], None, stats, 3)
    stats.finish(stats.begin(group, "all_reduce(loss)", 16))
    stats.begin(group, "all_reduce(grads)", 64)  # never completes
    return stats


def test_watchdog_dumps_a_stuck_rank(tmp_path: Path) -> None:
    """No beat after step 5: the watchdog records a hang with the collective in flight, every
    thread's stack and the limit. Real clock: firing is the expected outcome, and however late
    the watchdog thread runs, its idle time is only larger (``idle_s >= 0.3`` holds). The main
    thread waits for the .json record, which is written after the dump, so the dump's stacks
    were taken while the main thread was inside ``wait_until`` (not yet in ``stop``)."""
    info = RankInfo(rank=3, world=4, attempt=0, run_id="t")
    monitor = RankMonitor(tmp_path, info, watchdog_s=0.3, exit_process=False).start(signals=False)
    monitor.beat(5, _stats_with_pending_op())
    record = failure_path(tmp_path, 3, 0)
    wait_until(record.exists, "the hang record is written")
    monitor.stop(ok=False)
    assert monitor.fired == "hang"
    rec = json.loads(record.read_text())
    assert rec["kind"] == "hang" and rec["step"] == 5 and rec["idle_s"] >= 0.3
    assert rec["in_flight"][0].startswith("all_reduce(grads) on group 'dp' (ranks [1, 3], 64 B), "
                                          "in flight for ")
    dump = failure_path(tmp_path, 3, 0, ".txt").read_text()
    assert "no progress for" in dump and "parallel.watchdog_s=0.3" in dump
    assert "Thread 'MainThread'" in dump and "in wait_until" in dump  # the stuck main thread
    assert "colonnade-watchdog" not in dump  # the watchdog leaves itself out
    attempt, statuses = rank_statuses(tmp_path, run_id="t")
    assert attempt == 0 and [(s.rank, s.kind) for s in statuses] == [(3, "hang")]
    assert "likely cause: rank 3: HUNG at step 5 while in all_reduce(grads)" in failure_report(
        tmp_path, run_id="t")


def test_watchdog_stays_quiet_while_steps_progress(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Beats every 0.25 x watchdog_s for 2.5 x watchdog_s, the watchdog looking each time just
    before the next beat (idle 0.25 s): no hang, where an idle clock that beats did not reset
    would fire from the fifth look on. The clock moves only between rounds and the rounds run
    at the test's word, so the watchdog sees exactly these idle times on any schedule."""
    watchdog_s = 1.0
    clock = ManualClock().install(monkeypatch)
    monitor = RankMonitor(tmp_path, RankInfo(rank=0, run_id="t"), watchdog_s=watchdog_s,
                          heartbeat_s=0.0, exit_process=False)
    rounds = WatchdogRounds(monitor, monkeypatch)
    monitor.start(signals=False)
    stats = CommStats()
    try:
        monitor.beat(1, stats)
        for step in range(2, 12):  # 10 gaps of 0.25 s
            clock.advance(0.25 * watchdog_s)
            rounds.step()
            assert monitor.fired is None, (step, monitor.idle_s())
            monitor.beat(step, stats)
        idle = monitor.idle_s()
    finally:
        rounds.finish()
        monitor.stop(ok=True)
    assert idle < watchdog_s and monitor.fired is None, (monitor.fired, idle)
    beat = json.loads(heartbeat_path(tmp_path, 0, 0).read_text())
    assert beat["phase"] == "done" and beat["step"] == 11 and beat["pid"] == os.getpid()
    assert not failure_path(tmp_path, 0, 0).exists()


def test_sigterm_is_recorded_by_the_watchdog_thread(tmp_path: Path) -> None:
    """SIGTERM reaches the watchdog thread through the wake-up pipe and it records what the rank
    was doing. Nothing else can fire (the hang check is off), and the test waits for the .json
    record, written last: no race with the thread."""
    monitor = RankMonitor(tmp_path, RankInfo(rank=1, run_id="t"), exit_process=False)
    monitor.start(signals=True)
    record = failure_path(tmp_path, 1, 0)
    try:
        monitor.beat(7, _stats_with_pending_op())
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(record.exists, "the SIGTERM record is written")
    finally:
        monitor.stop(ok=False)
    assert monitor.fired == "terminated"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handler restored
    rec = json.loads(record.read_text())
    assert rec["kind"] == "terminated" and rec["step"] == 7
    assert rec["in_flight"][0].startswith("all_reduce(grads) on group 'dp'")


def _write(path: Path, body: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))


def test_report_puts_the_silent_dead_rank_first(tmp_path: Path) -> None:
    now = time.time()
    base = {"world": 3, "attempt": 0, "run_id": "r", "host": "h", "time": now}
    for rank in range(3):
        _write(heartbeat_path(tmp_path, rank, 0), {**base, "rank": rank, "pid": 100 + rank,
                                                   "step": 9, "phase": "train",
                                                   "last_op": "barrier on group 'world'"})
    _write(failure_path(tmp_path, 0, 0), {
        **base, "rank": 0, "pid": 100, "kind": "exception", "step": 9, "in_flight": [],
        "summary": "CommError: all_reduce(x) on group 'tp' failed: Connection closed by peer",
        "last_op": "all_reduce(x) on group 'tp'", "idle_s": 0.1, "dump": "d0"})
    _write(failure_path(tmp_path, 1, 0), {
        **base, "rank": 1, "pid": 101, "kind": "terminated", "step": 9, "idle_s": 0.2,
        "in_flight": ["all_reduce(y) on group 'dp'"], "last_op": "x", "dump": "d1"})
    text = failure_report(tmp_path, run_id="r", since=now - 5)
    lines = text.splitlines()
    assert lines[0].startswith("colonnade: the job failed (attempt 0); likely cause: rank 2: "
                               "died without a Python error"), text
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["rank 2", "rank 0", "rank 1"]
    assert "while in all_reduce(y) on group 'dp'" in lines[3]
    assert failure_report(tmp_path, run_id="other").endswith("no rank left a record under "
                                                              f"{tmp_path / 'failures'}")


def test_graceful_sigterm_waits_while_steps_progress_then_fires_when_stuck(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the loop's graceful stop on, SIGTERM is left to the loop (finish the step, save)
    while the rank progresses, also through a save longer than the grace; a rank that stops
    progressing (its peers are gone) is recorded 'terminated' once idle past term_grace_s, as
    before. The watchdog runs round by round on a clock only the test moves: it reads the
    signal (``raise_signal`` has put it in the wake-up pipe before it returns) in the first
    round, and every later round sees exactly the idle time and phase the test set, on any
    schedule."""
    grace_s = 1.0
    clock = ManualClock().install(monkeypatch)
    monitor = RankMonitor(tmp_path, RankInfo(rank=1, run_id="t"), heartbeat_s=0.0,
                          exit_process=False)
    monitor.term_grace_s = grace_s
    monitor.graceful_stop = True
    rounds = WatchdogRounds(monitor, monkeypatch)
    monitor.start(signals=True)
    stats = CommStats()
    quiet: list[bool] = []
    try:
        monitor.beat(3, stats)
        signal.raise_signal(signal.SIGTERM)
        rounds.step()  # the watchdog reads the signal: the loop stops the rank, no record
        quiet.append(monitor.fired is None)
        last = 3
        for last in range(4, 10):  # still stepping, 0.25 x grace apart, 1.5 x grace in all
            clock.advance(0.25 * grace_s)
            rounds.step()
            quiet.append(monitor.fired is None)
            monitor.beat(last, stats)
        monitor.beat(last, stats, phase="save")
        for _ in range(3):  # a save of 1.5 x grace: still no record
            clock.advance(0.5 * grace_s)
            rounds.step()
            quiet.append(monitor.fired is None)
        monitor.beat(last, _stats_with_pending_op())  # back in training, now stuck
        clock.advance(0.9 * grace_s)
        rounds.step()
        quiet.append(monitor.fired is None)  # idle, but not yet past the grace
        clock.advance(0.2 * grace_s)
        rounds.step()
    finally:
        rounds.finish()
        monitor.stop(ok=False)
    assert all(quiet), f"recorded while the rank was stepping or saving: {quiet}"
    assert monitor.fired == "terminated" and rounds.ended
    rec = json.loads(failure_path(tmp_path, 1, 0).read_text())
    assert rec["kind"] == "terminated" and rec["step"] == last and rec["idle_s"] >= grace_s
    assert rec["idle_s"] == pytest.approx(1.1 * grace_s, abs=0.01)
