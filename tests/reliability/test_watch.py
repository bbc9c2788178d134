"""Hang before timeout, a frozen rank as a hang, torch's NCCL knobs, the launcher's stop line.

In-process and fast: the launcher's heartbeat watch against a real stopped process, the hang
limit's relation to ``parallel.timeout_s``, the overdue-collective rule, the report's kinds,
the start-up store barrier and the environment handed to NCCL ranks.

Ordering: the heartbeat watch is given every clock reading (``check(now=...)``) and heartbeats
with exact times; a process is known stopped when ``waitpid(WUNTRACED)`` reports it; the
in-process watchdog runs round by round (:class:`WatchdogRounds`) on a clock only the test
moves (:class:`ManualClock`); the store barrier is checked once both ranks are counted in.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException

from colonnade.config.sections import ParallelConfig
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.reliability.monitor import (
    RankInfo,
    RankMonitor,
    failure_path,
    heartbeat_path,
    watchdog_seconds,
)
from colonnade.reliability.report import failure_report, rank_statuses
from colonnade.reliability.startup import join_barrier, set_torch_nccl_env, torch_nccl_env
from colonnade.reliability.watch import HeartbeatWatch, process_state
from tests.reliability.jobs import BACKSTOP_S, ManualClock, WatchdogRounds, wait_until

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`


def _beat(run_dir: Path, rank: int, pid: int, at: float, step: int = 3) -> None:
    """Rank ``rank``'s heartbeat, written at wall-clock time ``at``."""
    path = heartbeat_path(run_dir, rank, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "rank": rank, "world": 2, "attempt": 0, "run_id": "r", "pid": pid, "host": "h",
        "step": step, "phase": "train", "time": at,
        "last_op": "all_reduce(stop_flag) on group 'world' (ranks [0, 1], 8 B)"}))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process this test owns (killed at the end whatever happens)."""
    proc = subprocess.Popen(["sleep", "3600"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _freeze(proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP ``proc`` and return once it is stopped: ``waitpid(WUNTRACED)`` reports the stop
    only after the kernel has put it in state T (it does not reap the process)."""
    os.kill(proc.pid, signal.SIGSTOP)
    pid, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert pid == proc.pid and os.WIFSTOPPED(status), status
    assert process_state(proc.pid) == "T"


def test_watch_records_and_kills_a_frozen_rank(tmp_path: Path,
                                               sleeper: subprocess.Popen[bytes]) -> None:
    """A stopped rank with a heartbeat older than the hang limit is recorded 'frozen' (its step
    and last collective from the heartbeat) and SIGKILLed; the report calls it a hang. The
    heartbeat's time and every clock reading of the watch (``now``) are given, so its ages are
    exact (2, 5 and 7 s) however slowly this machine runs the lines between."""
    _freeze(sleeper)
    t0 = time.time()
    _beat(tmp_path, 1, sleeper.pid, at=t0 - 2.0)
    watch = HeartbeatWatch(tmp_path, "r", t0 - 60, limit_s=4.0, ranks=range(2), host="h")
    assert watch.check(now=t0) == [] and sleeper.poll() is None  # younger than the limit
    assert watch.check(now=t0 + 3.0) == []  # within the slack: its peers report first
    assert watch.check(now=t0 + 5.0) == [1]
    assert sleeper.wait(timeout=BACKSTOP_S) == -signal.SIGKILL
    rec = json.loads(failure_path(tmp_path, 1, 0).read_text())
    assert rec["kind"] == "frozen" and rec["step"] == 3 and rec["state"] == "T"
    assert "stopped by a signal (SIGSTOP / SIGTSTP)" in rec["summary"]
    assert rec["idle_s"] == 7.0, rec["idle_s"]
    report = failure_report(tmp_path, run_id="r")
    assert "likely cause: rank 1: FROZEN at step 3: no heartbeat for " in report, report
    assert "(SIGKILL); last collective all_reduce(stop_flag) on group 'world'" in report, report
    assert "died" not in report, report


def test_watch_leaves_running_ranks_and_kills_stopped_ones_once_the_job_fails(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    """A running process with a stale heartbeat is left alone below the limit; a stopped one is
    killed after a few seconds once another rank of the attempt has failed. The heartbeat is
    3.5 s old at every ``check(now=t)`` (below the limit, above the stopped-rank staleness),
    however long the lines between take."""
    t = time.time()
    _beat(tmp_path, 1, sleeper.pid, at=t - 3.5)
    watch = HeartbeatWatch(tmp_path, "r", t - 60, limit_s=30.0, ranks=range(2), host="h")
    # left running: R, S or D (a just-started process can be in disk sleep on a loaded machine)
    assert watch.check(now=t) == [] and process_state(sleeper.pid) in ("R", "S", "D")
    _freeze(sleeper)
    assert watch.check(now=t) == []  # nobody failed yet: wait for the hang limit
    other = failure_path(tmp_path, 0, 0)
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text(json.dumps({"rank": 0, "attempt": 0, "run_id": "r", "kind": "hang",
                                 "time": time.time()}))
    assert watch.check(now=t) == [1]
    assert sleeper.wait(timeout=BACKSTOP_S) == -signal.SIGKILL
    assert HeartbeatWatch(tmp_path, "r", 0.0, 30.0, range(2, 4), host="h").check() == []


def test_hang_limit_is_below_the_collective_timeout() -> None:
    """One place relates them: 0.8 x timeout_s by default; a set value is kept."""
    assert watchdog_seconds(ParallelConfig(timeout_s=10.0)) == pytest.approx(8.0)
    assert watchdog_seconds(ParallelConfig(timeout_s=300.0)) == pytest.approx(240.0)
    assert watchdog_seconds(ParallelConfig(timeout_s=10.0, watchdog_s=5.0)) == 5.0
    assert watchdog_seconds(ParallelConfig(timeout_s=10.0, watchdog_s=0.0)) == 0.0


def test_watchdog_fires_on_a_collective_waited_too_long(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Other collectives keep completing (no idle time), but one the rank waits for was posted
    longer ago than the limit: NCCL's timeout counts from posting, so the watchdog fires now,
    naming it. Round by round on a clock only the test moves: each round sees exactly the
    completions and waits the test made before it."""
    watchdog_s = 3.0
    clock = ManualClock().install(monkeypatch)
    stats = CommStats()
    group = CommGroup("dp", [0, 1], None, stats, 0)
    late = stats.begin(group, "all_reduce(grads)", 64)
    stats.in_flight[late].started -= 30.0  # posted 30 s ago
    monitor = RankMonitor(tmp_path, RankInfo(rank=0, run_id="t"), watchdog_s=watchdog_s,
                          exit_process=False)
    rounds = WatchdogRounds(monitor, monkeypatch)
    monitor.start(signals=False)
    monitor.beat(4, stats)
    try:
        # 1.5 s apart, 4.5 s past the beat in all: no hang while collectives complete and
        # nobody waits for the late one (a rule that counted it would fire in the first round;
        # one that took no completion for progress, in the second)
        for _ in range(3):
            clock.advance(1.5)
            stats.finish(stats.begin(group, "all_reduce(x)", 8))
            rounds.step()
            assert monitor.fired is None
        stats.mark_waited(late)
        clock.advance(1.5)
        stats.finish(stats.begin(group, "all_reduce(x)", 8))
        rounds.step()
        assert monitor.fired == "hang"
    finally:
        rounds.finish()
        monitor.stop(ok=False)
    rec = json.loads(failure_path(tmp_path, 0, 0).read_text())
    assert rec["kind"] == "hang" and rec["step"] == 4
    assert rec["summary"].startswith("all_reduce(grads) on group 'dp' waited for over 3")
    assert "before the collective timeout parallel.timeout_s" in rec["summary"]


def test_report_kinds_stuck_before_waiting_and_nccl_abort(tmp_path: Path) -> None:
    """A rank hung outside any collective (the cause) comes before one hung inside (waiting for
    it); a SIGABRT (NCCL's watchdog) is named as such."""
    base = {"world": 3, "attempt": 0, "run_id": "r", "host": "h", "time": time.time(),
            "step": 5, "idle_s": 9.0, "last_op": "x", "dump": ""}
    for rank, pending in ((0, ["all_reduce(y) on group 'tp'"]), (1, [])):
        path = failure_path(tmp_path, rank, 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**base, "rank": rank, "pid": rank, "kind": "hang",
                                    "summary": "no progress", "in_flight": pending}))
    abort = argparse.Namespace(exitcode=-int(signal.SIGABRT), pid=7, message="")
    _, statuses = rank_statuses(tmp_path, run_id="r", agent_failures={2: abort})
    assert [(s.rank, s.kind) for s in statuses] == [(2, "died"), (1, "stuck"), (0, "hang")]
    assert "aborted (SIGABRT" in statuses[0].text and "nccl_trace_rank_2" in statuses[0].text
    assert statuses[1].text.startswith("STUCK outside any collective at step 5")
    assert statuses[2].text.startswith("HUNG at step 5 while in all_reduce(y) on group 'tp'")


def test_nccl_env_is_torchs_own_and_user_values_win(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    env = torch_nccl_env(tmp_path)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_FR_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE":
                   str(tmp_path.resolve() / "failures" / "nccl_trace_rank_")}
    for key in env:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")
    added = set_torch_nccl_env(tmp_path)
    assert "TORCH_FR_BUFFER_SIZE" not in added
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "50"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_join_barrier_waits_for_every_rank() -> None:
    """Start-up waits in a store barrier (the long start-up timeout), so the default group is
    made with parallel.timeout_s and no timeout is changed later. The check is made once both
    ranks have counted themselves in (the store's counter, not a sleep): with the third rank
    missing, the barrier's key must not exist and nobody has passed; that a lone rank waits
    (and times out) rather than passing is the last assertion's, with no thread involved."""
    store = dist.HashStore()
    passed: list[int] = []
    timeout = timedelta(seconds=BACKSTOP_S)
    threads = [threading.Thread(target=lambda r=r: (join_barrier(store, r, 3, timeout),
                                                    passed.append(r))) for r in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: store.add("joined", 0) == 2, "both ranks are counted in")
    assert not store.check(["all_joined"])  # the third rank has not arrived: still closed
    assert passed == [] and all(t.is_alive() for t in threads)
    join_barrier(store, 2, 3, timeout)
    for t in threads:
        t.join(timeout=BACKSTOP_S)
    assert sorted(passed) == [0, 1]
    with pytest.raises(Exception, match=r"(?i)timeout|timed out|wait"):
        join_barrier(dist.HashStore(), 0, 2, timedelta(seconds=0.2))


def test_no_private_timeout_api() -> None:
    root = Path(__file__).resolve().parents[2] / "colonnade"
    users = [str(p) for p in root.rglob("*.py") if "_set_pg_timeout" in p.read_text()]
    assert users == []


def test_signal_wrapped_in_another_error_is_a_stop(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM reaching the launcher inside library code that wraps the agent's
    SignalException is reported as the stop it is, not as a launcher failure."""
    from colonnade.config.load import load_config
    from colonnade.launch import _launcher_failed

    config = load_config(None, [f"--logging.dir={tmp_path}"])
    args = argparse.Namespace(nnodes=1, rdzv_endpoint="127.0.0.1:0")
    try:
        try:
            raise SignalException("got signal", sigval=signal.SIGTERM)
        except SignalException as inner:
            raise RuntimeError("rendezvous store call failed") from inner
    except RuntimeError as err:
        status = _launcher_failed(config, args, err, "r", time.time())
    err_text = capsys.readouterr().err
    assert status == 143, err_text
    assert "the job was stopped by SIGTERM" in err_text and "failed before" not in err_text


def test_hung_rank_is_left_to_the_backend_timeout_then_exits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After its hang record (at watchdog_s) a rank waits for the backend's timeout to end it
    (NCCL dumps its flight recorder then), and exits itself HANG_EXIT_GRACE_S after it at the
    latest; the heartbeat stays fresh meanwhile (it is not frozen). Round by round on a clock
    only the test moves, so the record's instant, and from it ``exit_at``, are exact."""
    from colonnade.reliability.monitor import HANG_EXIT_GRACE_S

    clock = ManualClock().install(monkeypatch)
    monitor = RankMonitor(tmp_path, RankInfo(rank=0, run_id="t"), watchdog_s=0.3,
                          heartbeat_s=0.05, exit_process=False, timeout_s=0.5)
    rounds = WatchdogRounds(monitor, monkeypatch)
    monitor.start(signals=False)
    try:
        monitor.beat(2, CommStats())
        clock.advance(0.25)
        rounds.step()
        assert monitor.fired is None and monitor.exit_at is None  # below the limit
        recorded = clock.advance(0.1)
        rounds.step()
        assert monitor.fired == "hang"
        # exit_at = when the hang was recorded + the rest of the backend timeout + the grace
        late = (0.5 - 0.3) + HANG_EXIT_GRACE_S
        assert monitor.exit_at == pytest.approx(recorded + late)
        first = json.loads(heartbeat_path(tmp_path, 0, 0).read_text())["time"]
        clock.advance(0.1)
        rounds.step()
        assert json.loads(heartbeat_path(tmp_path, 0, 0).read_text())["time"] > first
        clock.advance_to(monitor.exit_at - 0.1)
        rounds.step()
        assert not rounds.ended  # still waiting for the backend
        clock.advance_to(monitor.exit_at)
        rounds.step()
        assert rounds.ended  # exits itself (``exit_process``: os._exit(HANG_EXIT_CODE))
    finally:
        rounds.finish()
        monitor.stop(ok=False)
