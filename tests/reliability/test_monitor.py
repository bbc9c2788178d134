"""The per-rank monitor in-process: the watchdog fires on no progress (and only then), SIGTERM is
recorded by the watchdog thread, and the launcher's report ranks the likely cause first."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.reliability.monitor import RankInfo, RankMonitor, failure_path, heartbeat_path
from colonnade.reliability.report import failure_report, rank_statuses


def _wait_for(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _beat_for(monitor: RankMonitor, stats: CommStats, first: int, seconds: float,
              phase: str = "train") -> tuple[int, float]:
    """Beat steps ``first``, ``first + 1``, ... every ~50 ms for ``seconds`` (monotonic);
    returns (the last step beaten, the longest gap between two beats). The gap tells a test
    whether the machine stalled this thread past a limit (then the monitor was right to fire)."""
    step, last = first, time.monotonic()
    end, gap = last + seconds, 0.0
    monitor.beat(step, stats, phase=phase)
    while time.monotonic() < end:
        time.sleep(0.05)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        step += 1
        monitor.beat(step, stats, phase=phase)
    return step, gap


def _stats_with_pending_op() -> CommStats:
    stats = CommStats()
    group = CommGroup("dp", [1, 3], None, stats, 3)
    stats.finish(stats.begin(group, "all_reduce(loss)", 16))
    stats.begin(group, "all_reduce(grads)", 64)  # never completes
    return stats


def test_watchdog_dumps_a_stuck_rank(tmp_path: Path) -> None:
    info = RankInfo(rank=3, world=4, attempt=0, run_id="t")
    monitor = RankMonitor(tmp_path, info, watchdog_s=0.3, exit_process=False).start(signals=False)
    monitor.beat(5, _stats_with_pending_op())
    _wait_for(lambda: monitor.fired is not None)
    monitor.stop(ok=False)
    assert monitor.fired == "hang"
    rec = json.loads(failure_path(tmp_path, 3, 0).read_text())
    assert rec["kind"] == "hang" and rec["step"] == 5 and rec["idle_s"] >= 0.3
    assert rec["in_flight"][0].startswith("all_reduce(grads) on group 'dp' (ranks [1, 3], 64 B), "
                                          "in flight for ")
    dump = failure_path(tmp_path, 3, 0, ".txt").read_text()
    assert "no progress for" in dump and "parallel.watchdog_s=0.3" in dump
    assert "Thread 'MainThread'" in dump and "_wait_for" in dump  # the stuck main thread
    assert "colonnade-watchdog" not in dump  # the watchdog leaves itself out
    attempt, statuses = rank_statuses(tmp_path, run_id="t")
    assert attempt == 0 and [(s.rank, s.kind) for s in statuses] == [(3, "hang")]
    assert "likely cause: rank 3: HUNG at step 5 while in all_reduce(grads)" in failure_report(
        tmp_path, run_id="t")


def test_watchdog_stays_quiet_while_steps_progress(tmp_path: Path) -> None:
    """Beats every ~50 ms for 2.5 x watchdog_s: no hang (an idle clock that beats did not reset
    fires after 1 s). Robust on a loaded machine: an attempt in which this thread itself was
    stalled for watchdog_s between two beats proves nothing and is retried (3 attempts)."""
    watchdog_s = 1.0
    for attempt in range(3):
        run_dir = tmp_path / f"a{attempt}"
        monitor = RankMonitor(run_dir, RankInfo(rank=0, run_id="t"), watchdog_s=watchdog_s,
                              heartbeat_s=0.0, exit_process=False).start(signals=False)
        last, gap = _beat_for(monitor, CommStats(), 1, 2.5 * watchdog_s)
        fired, idle = monitor.fired, monitor.idle_s()
        monitor.stop(ok=True)
        if gap < 0.8 * watchdog_s:
            break
    assert gap < 0.8 * watchdog_s, f"this thread stalled {gap:.2f} s in every attempt"
    assert idle < watchdog_s and fired is None, (fired, idle)
    beat = json.loads(heartbeat_path(run_dir, 0, 0).read_text())
    assert beat["phase"] == "done" and beat["step"] == last and beat["pid"] == os.getpid()
    assert not failure_path(run_dir, 0, 0).exists()


def test_sigterm_is_recorded_by_the_watchdog_thread(tmp_path: Path) -> None:
    monitor = RankMonitor(tmp_path, RankInfo(rank=1, run_id="t"), exit_process=False)
    monitor.start(signals=True)
    try:
        monitor.beat(7, _stats_with_pending_op())
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(lambda: monitor.fired is not None)
    finally:
        monitor.stop(ok=False)
    assert monitor.fired == "terminated"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handler restored
    rec = json.loads(failure_path(tmp_path, 1, 0).read_text())
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
        tmp_path: Path) -> None:
    """With the loop's graceful stop on, SIGTERM is left to the loop (finish the step, save)
    while the rank progresses, also through a slow save; a rank that stops progressing (its
    peers are gone) is recorded 'terminated' after term_grace_s, as before."""
    grace_s = 1.0
    for attempt in range(3):  # an attempt whose own beats stalled past the grace is retried
        run_dir = tmp_path / f"a{attempt}"
        monitor = RankMonitor(run_dir, RankInfo(rank=1, run_id="t"), heartbeat_s=0.0,
                              exit_process=False)
        monitor.term_grace_s = grace_s
        monitor.graceful_stop = True
        monitor.start(signals=True)
        stats = CommStats()
        try:
            monitor.beat(3, stats)
            os.kill(os.getpid(), signal.SIGTERM)
            last, gap = _beat_for(monitor, stats, 4, 1.5 * grace_s)  # still stepping: no record
            monitor.beat(last, stats, phase="save")
            time.sleep(1.5 * grace_s)  # a save longer than the grace: still no record
            quiet = monitor.fired is None
            monitor.beat(last, _stats_with_pending_op())  # back in training, now stuck
            _wait_for(lambda m=monitor: m.fired is not None)
        finally:
            monitor.stop(ok=False)
        if gap < 0.8 * grace_s:
            break
    assert gap < 0.8 * grace_s, f"this thread stalled {gap:.2f} s in every attempt"
    assert quiet, "recorded while the rank was stepping or saving"
    assert monitor.fired == "terminated"
    rec = json.loads(failure_path(run_dir, 1, 0).read_text())
    assert rec["kind"] == "terminated" and rec["step"] == last and rec["idle_s"] >= grace_s
