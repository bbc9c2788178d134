"""Per-rank heartbeat, hang watchdog, and the record of why a rank ended.

Every rank of a run writes under ``logging.dir`` (the launcher reads these after a failure):

  heartbeat/rank{r}-a{k}.json pid, host, attempt, step, phase and the last collective; written
                              at every step and rewritten by the watchdog thread every
                              ``heartbeat_s`` seconds (also while the main thread waits in a
                              collective), so a stale one means the process itself is frozen
  failures/rank{r}-a{k}.json  why rank r ended on attempt k: kind 'exception' | 'hang' |
                              'terminated', a one-line summary, the step, the last collective
  failures/rank{r}-a{k}.txt   the full dump: message, collectives in flight, the traceback and
                              the Python stack of every thread
A fatal signal (SIGSEGV, SIGABRT, ...) makes faulthandler print every thread's stack to stderr.

The watchdog is a daemon thread. Progress is a finished training step (:meth:`beat`) or a
completed collective (``CommStats.progressed_at``); with no progress for ``watchdog_s`` seconds,
or a collective the rank waits for posted over ``watchdog_s`` ago, it writes a 'hang' record.
The rank is then left to the backend's timeout (gloo raises, NCCL's watchdog dumps its flight
recorder and aborts) and exits itself with :data:`HANG_EXIT_CODE` at the latest
:data:`HANG_EXIT_GRACE_S` after that timeout. ``watchdog_s`` defaults to
:data:`WATCHDOG_FRACTION` x ``parallel.timeout_s`` (:func:`watchdog_seconds`, the one place
both limits are related), so the record is written before the backend's own timeout (gloo's
error, NCCL's watchdog abort) ends the rank. The same thread
serves SIGTERM (how a launcher stops the surviving ranks): it records what the rank was doing
(kind 'terminated'), then exits with 128 + SIGTERM. A Python signal handler alone could not do
this: it runs only when the main thread returns to the interpreter, never while the main
thread is blocked in a collective; ``signal.set_wakeup_fd`` hands the signal to the thread.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colonnade.config.sections import ParallelConfig
from colonnade.parallel.comm import CommStats
from colonnade.reliability.dump import comm_state, last_op_text, python_stacks

HANG_EXIT_CODE = 124
"""Exit status of a rank stopped by its own hang detector (like coreutils' timeout)."""
TERM_EXIT_CODE = 128 + int(signal.SIGTERM)
"""Exit status of a rank stopped by SIGTERM after recording its state."""
TERM_GRACE_S = 5.0
HANG_EXIT_GRACE_S = 10.0
"""A hung rank whose backend never ends it (stuck outside every collective, or every rank
stuck) exits itself this long after ``parallel.timeout_s`` would have passed."""
"""With graceful stop on, a SIGTERM'd rank idle this long (no step, no collective) is stuck."""
WATCHDOG_FRACTION = 0.8
"""Default hang limit as a fraction of ``parallel.timeout_s``: below 1 so that the hang
detectors (each rank's and the launcher's) report before the collective timeout aborts."""


def watchdog_seconds(par: ParallelConfig) -> float:
    """The hang limit of the in-rank watchdog and of the launcher's heartbeat watch:
    ``parallel.watchdog_s``, or :data:`WATCHDOG_FRACTION` x ``parallel.timeout_s`` when unset
    (0 disables both). Validation keeps a set value below ``timeout_s``."""
    return WATCHDOG_FRACTION * par.timeout_s if par.watchdog_s is None else par.watchdog_s


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the job (from the launcher's environment)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    attempt: int = 0
    """Restart count: 0 on the first launch, k after k restarts."""
    run_id: str = ""
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)

    @classmethod
    def from_env(cls) -> RankInfo:
        """Read RANK / WORLD_SIZE / LOCAL_RANK / TORCHELASTIC_RESTART_COUNT / _RUN_ID."""
        env = os.environ
        return cls(rank=int(env.get("RANK", "0")), world=int(env.get("WORLD_SIZE", "1")),
                   local_rank=int(env.get("LOCAL_RANK", "0")),
                   attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   run_id=env.get("TORCHELASTIC_RUN_ID", ""))

    def describe(self) -> str:
        """'rank 2 of 4 (pid 123 on node7, attempt 0)'."""
        return (f"rank {self.rank} of {self.world} (pid {self.pid} on {self.host}, "
                f"attempt {self.attempt})")


def heartbeat_path(run_dir: str | Path, rank: int, attempt: int = 0) -> Path:
    """Where rank ``rank`` keeps its heartbeat during attempt ``attempt``."""
    return Path(run_dir) / "heartbeat" / f"rank{rank}-a{attempt}.json"


def failure_path(run_dir: str | Path, rank: int, attempt: int, suffix: str = ".json") -> Path:
    """Where rank ``rank`` records why it ended on attempt ``attempt`` (.json, .txt, .crash.txt)."""
    return Path(run_dir) / "failures" / f"rank{rank}-a{attempt}{suffix}"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (readers never see a
    half-written file)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class RankMonitor:
    """Heartbeat + watchdog + failure records of one rank; ``start`` it, ``beat`` every step."""

    def __init__(self, run_dir: str | Path, info: RankInfo | None = None, *,
                 watchdog_s: float = 0.0, heartbeat_s: float = 1.0,
                 exit_process: bool = True, timeout_s: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.info = info or RankInfo.from_env()
        self.watchdog_s = watchdog_s
        """No progress for this long is a hang (0 disables the check)."""
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        """``parallel.timeout_s``: after its hang record the rank is left to the backend's
        timeout (NCCL then dumps its flight recorder), exiting itself :data:`HANG_EXIT_GRACE_S`
        after it at the latest; None: exit right after the record."""
        self.exit_at: float | None = None
        """``time.monotonic()`` at which a hung rank exits itself (set by its hang record)."""
        self.exit_process = exit_process
        """Exit after a hang or SIGTERM record (False only in tests)."""
        self.stats: CommStats | None = None
        self.step = 0
        self.phase = "setup"
        self.armed = False
        """The hang check starts with the first :meth:`beat` (set-up has its own timeouts)."""
        self.fired: str | None = None
        """Kind of the record written ('exception', 'hang', 'terminated'), None while running."""
        self._last_beat = time.monotonic()
        self._last_write = float("-inf")
        self._stop = threading.Event()
        self._record_lock = threading.Lock()
        self._beat_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None
        self._previous: dict[str, Any] = {}
        self.term_grace_s = TERM_GRACE_S
        self.graceful_stop = False
        """Set by the training loop while it can stop at a step boundary and save
        (:mod:`colonnade.reliability.interrupt`): SIGTERM then ends the rank only when it makes
        no progress for term_grace_s (stuck, or its peers are gone), never while saving."""
        self._term_since: float | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self, signals: bool = True) -> RankMonitor:
        """Create the directories, write the first heartbeat, start the watchdog thread.

        ``signals`` installs the SIGTERM and fatal-signal dumps (main thread only; tests that
        run in-process pass False).
        """
        for sub in ("heartbeat", "failures"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self._write_heartbeat(force=True)
        if signals and threading.current_thread() is threading.main_thread():
            self._install_signals()
        self._thread = threading.Thread(target=self._watch, name="colonnade-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def beat(self, step: int, stats: CommStats | None = None, phase: str = "train") -> None:
        """Progress: step ``step`` (1-based, as logged) starts; ``stats`` counts the collectives."""
        self.step, self.phase, self.armed = step, phase, True
        if stats is not None:
            self.stats = stats
        self._last_beat = time.monotonic()
        self._write_heartbeat(force=True)

    def stop(self, ok: bool = True) -> None:
        """Stop the thread, restore signal handlers, write the final heartbeat."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._restore_signals()
        self.phase = "done" if ok else "failed"
        with contextlib.suppress(OSError):
            self._write_heartbeat(force=True)

    # ------------------------------------------------------------------ records

    def record_failure(self, exc: BaseException) -> Path | None:
        """Record an exception that ends this rank (called from the rank's ``except``)."""
        tb = "".join(traceback.format_exception(exc))
        summary = f"{type(exc).__name__}: {exc}"
        return self._record("exception", summary, f"--- traceback ---\n{tb}")

    def _record(self, kind: str, summary: str, body: str = "") -> Path | None:
        """Write the .json summary and the .txt dump once; later calls return None."""
        with self._record_lock:
            if self.fired is not None:
                return None
            self.fired = kind
        now = time.monotonic()
        info = self.info
        header = f"{info.describe()} at step {self.step} ({self.phase}): {kind}: {summary}"
        text = "\n".join([header, *comm_state(self.stats, now), body,
                          "--- Python stacks of every thread ---", python_stacks()])
        txt = failure_path(self.run_dir, info.rank, info.attempt, ".txt")
        idle = self.idle_s()
        record = {"rank": info.rank, "world": info.world, "attempt": info.attempt,
                  "run_id": info.run_id, "pid": info.pid, "host": info.host, "kind": kind,
                  "summary": " ".join(summary.split())[:2000], "step": self.step,
                  "phase": self.phase, "last_op": last_op_text(self.stats),
                  "in_flight": [r.describe(now) for r in (self.stats.pending()
                                                          if self.stats else [])],
                  "idle_s": round(idle, 2), "dump": str(txt), "time": time.time()}
        try:
            txt.parent.mkdir(parents=True, exist_ok=True)
            txt.write_text(text + "\n")
            write_atomic(failure_path(self.run_dir, info.rank, info.attempt),
                          json.dumps(record, indent=1))
        except OSError as err:  # the dump must never hide the original failure
            print(f"colonnade: could not write the failure record: {err}", file=sys.stderr)
        if kind == "hang":
            print(text, file=sys.stderr, flush=True)
        elif kind == "terminated":
            brief = "\n  ".join([header, *comm_state(self.stats, now)])
            print(f"{brief}\n  dump: {txt}", file=sys.stderr, flush=True)
        return txt

    def _write_heartbeat(self, force: bool = False) -> None:
        with self._beat_lock:  # the main thread (each step) and the watchdog thread write it
            now = time.monotonic()
            if not force and now - self._last_write < self.heartbeat_s:
                return
            self._last_write = now
            self._write_heartbeat_file()

    def _write_heartbeat_file(self) -> None:
        info = self.info
        body = {"rank": info.rank, "world": info.world, "attempt": info.attempt,
                "run_id": info.run_id, "pid": info.pid, "host": info.host, "step": self.step,
                "phase": self.phase, "last_op": last_op_text(self.stats, ages=False),
                "time": time.time()}
        write_atomic(heartbeat_path(self.run_dir, info.rank, info.attempt), json.dumps(body))

    # ------------------------------------------------------------------ watchdog thread

    def idle_s(self) -> float:
        """Seconds since the last progress (a step beat or a completed collective)."""
        last = self._last_beat
        if self.stats is not None:
            last = max(last, self.stats.progressed_at())
        return time.monotonic() - last

    def _watch(self) -> None:
        poll = 0.5 if self.watchdog_s <= 0 else min(0.5, self.watchdog_s / 4)
        while not self._stop.is_set():
            if self._wake is not None:
                ready, _, _ = select.select([self._wake[0]], [], [], poll)
                if ready and self._got_sigterm():
                    if not self.graceful_stop:
                        self._on_terminate()
                        return
                    self._term_since = time.monotonic()
            else:
                self._stop.wait(poll)
            if (self._term_since is not None and self.phase != "save"
                    and self.idle_s() > self.term_grace_s):
                self._on_terminate()
                return
            if self.exit_at is not None:
                if time.monotonic() >= self.exit_at:
                    self._exit_hung()
                    return
            elif self.armed and self.watchdog_s > 0 and self._hung():
                self._on_hang()
                if self.timeout_s is None:
                    self._exit_hung()
                    return
                late = max(0.0, self.timeout_s - self.watchdog_s) + HANG_EXIT_GRACE_S
                self.exit_at = time.monotonic() + late
            with contextlib.suppress(OSError):
                self._write_heartbeat()  # fresh: current step and last collective

    def _hung(self) -> bool:
        """No progress for watchdog_s, or a collective waited for posted over watchdog_s ago."""
        if self.idle_s() > self.watchdog_s:
            return True
        return self.stats is not None and self.stats.overdue(self.watchdog_s) is not None

    def _got_sigterm(self) -> bool:
        assert self._wake is not None
        try:
            data = os.read(self._wake[0], 512)
        except (BlockingIOError, OSError):
            return False
        return int(signal.SIGTERM) in data

    def _on_hang(self) -> None:
        idle = self.idle_s()
        late = self.stats.overdue(self.watchdog_s) if self.stats is not None else None
        if late is not None and idle <= self.watchdog_s:
            what = (f"{late.op} on group '{late.group}' waited for over "
                    f"{time.monotonic() - late.started:.1f} s")
        else:
            what = (f"no progress for {idle:.1f} s: no step finished and no collective "
                    "completed")
        self._record("hang", f"{what} (hang limit parallel.watchdog_s={self.watchdog_s:g}, "
                     "reported before the collective timeout parallel.timeout_s ends the "
                     "rank); this rank is stuck (see its stack below) or waits for a stuck peer")

    def _exit_hung(self) -> None:
        if self.exit_process:
            os._exit(HANG_EXIT_CODE)

    def _on_terminate(self) -> None:
        self._record("terminated", "stopped by SIGTERM (the launcher stops the surviving ranks "
                     "when one fails)")
        if self.exit_process:
            os._exit(TERM_EXIT_CODE)

    # ------------------------------------------------------------------ signals

    def _install_signals(self) -> None:
        self._previous["faulthandler"] = faulthandler.is_enabled()
        if not self._previous["faulthandler"]:  # keep one already set up (pytest's, say)
            faulthandler.enable(file=sys.stderr, all_threads=True)
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._wake = (read_fd, write_fd)
        self._previous["wakeup"] = signal.set_wakeup_fd(write_fd)
        self._previous["sigterm"] = signal.signal(signal.SIGTERM, self._sigterm_in_main)

    def _sigterm_in_main(self, signum: int, frame: Any) -> None:
        """Python-level handler: the watchdog thread does the work; do it here if it is gone."""
        if self._thread is None or not self._thread.is_alive():
            self._on_terminate()

    def _restore_signals(self) -> None:
        if self._wake is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous.get("sigterm") or signal.SIG_DFL)
            signal.set_wakeup_fd(self._previous.get("wakeup", -1))
        for fd in self._wake:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake = None
        if not self._previous.get("faulthandler"):
            faulthandler.disable()
