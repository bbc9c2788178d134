"""The launcher's watch over its ranks: a frozen rank is a hang, not a death.

A rank's own watchdog (:mod:`colonnade.reliability.monitor`) cannot report a process that is
frozen as a whole: SIGSTOP / SIGTSTP, a debugger, a GIL held forever, a process blocked in the
kernel. Every live rank rewrites its heartbeat about once a second from its watchdog thread, so
the launcher reads a heartbeat older than the hang limit as "this process no longer runs".

:class:`HeartbeatWatch` (a daemon thread of the launcher) then writes that rank's failure record
(kind 'frozen': its step, last collective and process state, from its last heartbeat and
``/proc``) and SIGKILLs it, so the elastic agent stops the job at once instead of waiting 30 s
for a stopped process that can never exit after SIGTERM. Limits:

* the hang limit :func:`colonnade.reliability.monitor.watchdog_seconds` (0.8 x
  ``parallel.timeout_s`` by default) plus :data:`HEARTBEAT_SLACK_S`, so the peers waiting for
  the frozen rank record their hang first and the whole job is gone by about the collective
  timeout;
* a *stopped* process (state T) whose heartbeat is older than :data:`STOPPED_STALE_S` is killed
  at once when another rank of the attempt has already failed (the job is ending anyway).

Only this node's ranks are watched (their pids are local). If the launcher itself was suspended
(its own loop saw a gap), that round is skipped: every heartbeat looks old after a resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from colonnade.reliability.monitor import failure_path, write_atomic
from colonnade.reliability.report import read_records

POLL_S = 0.5
"""How often the launcher reads the heartbeats."""
HEARTBEAT_SLACK_S = 2.0
"""Added to the hang limit: a heartbeat is up to a refresh period old when the rank freezes,
and the peers' own watchdogs (their idle time counts from the freeze) should report first."""
STOPPED_STALE_S = 3.0
"""A stopped rank (state T) with a heartbeat this old is frozen once the job is failing."""
STATES = {"R": "running", "S": "sleeping", "D": "blocked in the kernel (uninterruptible)",
          "T": "stopped by a signal (SIGSTOP / SIGTSTP)", "t": "stopped by a debugger",
          "Z": "exited (zombie)"}


def process_state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` from /proc (None when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


class HeartbeatWatch:
    """Finds this node's frozen ranks from their heartbeats, records and kills them."""

    def __init__(self, run_dir: str | Path, run_id: str, since: float, limit_s: float,
                 ranks: range, host: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_id, self.since, self.limit_s, self.ranks = run_id, since, limit_s, ranks
        self.host = host or socket.gethostname()
        self.killed: dict[int, str] = {}
        """Ranks this watch killed, with the summary it recorded."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HeartbeatWatch:
        """Watch in a daemon thread (nothing when the hang limit is 0: disabled)."""
        if self.limit_s > 0:
            self._thread = threading.Thread(target=self._run, name="colonnade-job-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            suspended = now - last > 4 * POLL_S + 1.0  # the launcher itself was not running
            last = now
            if not suspended:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    self.check()

    def _latest_beats(self) -> dict[int, dict[str, Any]]:
        """This node's ranks' heartbeats of this run, the latest attempt of each (only their
        own files are read: at thousands of ranks the directory is large and shared)."""
        out: dict[int, dict[str, Any]] = {}
        for rank in self.ranks:
            for path in (self.run_dir / "heartbeat").glob(f"rank{rank}-a*.json"):
                try:
                    beat = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if (beat.get("run_id") != self.run_id
                        or float(beat.get("time", 0.0)) < self.since - 1.0):
                    continue
                if rank not in out or int(beat["attempt"]) > int(out[rank]["attempt"]):
                    out[rank] = beat
        return out

    def check(self, now: float | None = None) -> list[int]:
        """One look at every local rank's latest attempt; returns the ranks killed."""
        now = time.time() if now is None else now
        out = []
        for rank, beat in sorted(self._latest_beats().items()):
            attempt = int(beat["attempt"])
            if rank in self.killed or beat.get("host") != self.host:
                continue
            if beat.get("phase") in ("done", "failed"):
                continue
            if self._recorded(rank, attempt):
                continue  # it said itself why it ends
            pid, age = int(beat["pid"]), now - float(beat["time"])
            state = process_state(pid)
            if state is None or state == "Z":
                continue  # gone: the agent reports its exit
            late = age > self.limit_s + HEARTBEAT_SLACK_S
            if late or (state == "T" and age > STOPPED_STALE_S and self._failing(attempt)):
                self._freeze(rank, beat, pid, age, state)
                out.append(rank)
        return out

    def _recorded(self, rank: int, attempt: int) -> bool:
        """Rank ``rank`` has recorded why it ends (this run's record, not an older run's)."""
        try:
            rec = json.loads(failure_path(self.run_dir, rank, attempt).read_text())
        except (OSError, ValueError):
            return False
        return rec.get("run_id") == self.run_id and float(rec.get("time", 0.0)) >= self.since - 1

    def _failing(self, attempt: int) -> bool:
        """Some rank of this attempt has recorded why it ends (the job is stopping)."""
        records = read_records(self.run_dir, self.run_id, self.since)
        return any(a == attempt for a, _ in records)

    def _freeze(self, rank: int, beat: dict[str, Any], pid: int, age: float,
                state: str) -> None:
        """Record rank ``rank`` as frozen, then SIGKILL it."""
        how = STATES.get(state, f"state {state}")
        summary = (f"no heartbeat for {age:.1f} s (hang limit parallel.watchdog_s="
                   f"{self.limit_s:g}); the process is {how}: the whole process was frozen, its "
                   "own watchdog too; the launcher killed it (SIGKILL)")
        attempt = int(beat.get("attempt", 0))
        txt = failure_path(self.run_dir, rank, attempt, ".txt")
        record = {"rank": rank, "world": beat.get("world"), "attempt": attempt,
                  "run_id": self.run_id, "pid": pid, "host": self.host, "kind": "frozen",
                  "summary": summary, "step": beat.get("step"), "phase": beat.get("phase"),
                  "last_op": beat.get("last_op", "none"), "in_flight": [],
                  "idle_s": round(age, 2), "state": state, "dump": str(txt),
                  "time": time.time()}
        with contextlib.suppress(OSError):
            txt.parent.mkdir(parents=True, exist_ok=True)
            txt.write_text(f"rank {rank} (pid {pid} on {self.host}, attempt {attempt}) at step "
                           f"{beat.get('step')} ({beat.get('phase')}): frozen: {summary}\n"
                           f"last heartbeat: {json.dumps(beat)}\n")
            write_atomic(failure_path(self.run_dir, rank, attempt), json.dumps(record, indent=1))
        self.killed[rank] = summary
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
