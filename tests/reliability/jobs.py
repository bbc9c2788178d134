"""Helpers of the reliability tests: a tiny corpus, a tiny model, real launcher jobs, and the
means to order a test by events instead of by the scheduler.

Jobs are separate process trees (``start_new_session``) so a test can time them out and kill
exactly what it started. Every job trains the same tiny Llama (2 layers, hidden 32, vocab 300,
seq 16) on a 6-document corpus prepared once per session.

No test here is ordered by a sleep or by a measured wall-clock gap: a 2-core machine running
other jobs stalls any thread for seconds. A test waits for a condition (:func:`wait_until`, a
process exit, a record on disk) with a generous backstop that only ends a test whose product
broke; the in-process watchdog tests run the watchdog thread one round at a time
(:class:`WatchdogRounds`) against a clock that only the test moves (:class:`ManualClock`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from colonnade.reliability.monitor import RankMonitor

REPO = Path(__file__).resolve().parents[2]
BACKSTOP_S = 60.0
"""How long an in-process test waits for something that must happen: never what orders a test,
only what ends one whose product broke."""
AGENT_WAITS_FOR_RANKS = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100000"}
"""A job's environment in which torch's elastic agent, stopping the ranks after a failure or a
stop signal, waits for them instead of SIGKILLing them after its usual 30 s. Such a job ends
only when every rank ends by itself (its error, its watchdog's record of a SIGTERM, the
launcher's kill of a frozen rank); one that relied on the agent's timed kill never ends, and
its test fails at its backstop instead of passing a wall-clock bound by luck."""
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi"]


def write_corpus(directory: Path, docs: int = 6, words: int = 1500, seed: int = 0) -> Path:
    """A directory of small deterministic text files."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(docs):
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        (directory / f"doc{i}.txt").write_text(text + "\n")
    return directory


def tiny_args(corpus: Path, prepared: Path, run_dir: Path, **extra: object) -> list[str]:
    """``--section.field=value`` overrides of the tiny model and data, plus ``extra``
    (keys 'section__field')."""
    fields: dict[str, object] = {
        "model.num_layers": 2, "model.hidden_size": 32, "model.num_heads": 4,
        "model.vocab_size": 300, "model.max_seq_len": 32, "training.seq_len": 16,
        "training.micro_batch_size": 2, "training.steps": 8, "training.eval_interval": 0,
        "training.device": "cpu", "logging.log_interval": 1, "logging.progress": "false",
        "logging.tensorboard": "false", "logging.peak_tflops": 1.0,
        "data.input": str(corpus), "data.prepared_dir": str(prepared),
        "logging.dir": str(run_dir),
    }
    fields.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"--{k}={v}" for k, v in fields.items()]


@dataclass
class Job:
    """A started job: its process, where its output goes, when it began."""

    proc: subprocess.Popen[bytes]
    log: Path
    started: float

    def wait(self, timeout: float) -> int:
        """Exit status; kills the whole job and fails the test after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not end within {timeout} s; output:\n{self.output()}"
                                 ) from None

    def kill(self) -> None:
        """SIGKILL the job's process group (only what this test started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def output(self) -> str:
        """Everything the job printed (stdout and stderr)."""
        return self.log.read_text(errors="replace")


def start(argv: list[str], log: Path, module: str = "colonnade.cli",
          env: dict[str, str] | None = None) -> Job:
    """Run ``python -m module argv`` from the repository root, output to ``log`` (``env``:
    added to this process's environment)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {}))
    fh = log.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, env=env,
                            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    fh.close()
    return Job(proc, log, time.monotonic())


def losses(run_dir: Path) -> dict[int, float]:
    """Loss of every logged step of ``run_dir/metrics.jsonl`` (a re-logged step: the last)."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[int(rec["step"])] = float(rec["loss"])
    return out


def heartbeat(run_dir: Path, rank: int, attempt: int = 0) -> dict[str, object] | None:
    """Rank ``rank``'s heartbeat, or None when it has not written one yet."""
    path = run_dir / "heartbeat" / f"rank{rank}-a{attempt}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = BACKSTOP_S,
               job: Job | None = None, poll_s: float = 0.01) -> None:
    """Return once ``condition()`` is true (checked every ``poll_s``); fail after ``timeout_s``
    (a backstop, not an ordering), or as soon as ``job`` has ended (it can no longer happen)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if job is not None:
            assert job.proc.poll() is None, f"the job ended before {what}:\n{job.output()}"
        assert time.monotonic() < deadline, (
            f"not {what} within {timeout_s} s" + (f":\n{job.output()}" if job else ""))
        time.sleep(poll_s)


class ManualClock:
    """``time`` as the watchdog's modules see it, moved only by the test (:meth:`install`).

    ``monotonic()`` and ``time()`` return the test's instant in the monitor, the collective
    counters and the dumps; every other attribute is the real ``time`` module's. It starts
    :data:`AHEAD_S` ahead of the real monotonic clock, so a time read from the real clock by
    mistake (``CommStats.last_progress``'s default is the real clock, bound at import) looks
    ancient: idle, so a mix-up fires the watchdog instead of hiding a hang.
    """

    AHEAD_S = 100_000.0
    MODULES = ("colonnade.reliability.monitor", "colonnade.parallel.comm_stats",
               "colonnade.reliability.dump")

    def __init__(self) -> None:
        self._origin = time.monotonic() + self.AHEAD_S
        self._now = self._origin
        self._wall = time.time()

    def monotonic(self) -> float:
        """The test's instant."""
        return self._now

    def time(self) -> float:
        """The wall-clock time of the test's instant (it moves with :meth:`monotonic`)."""
        return self._wall + (self._now - self._origin)

    def advance(self, seconds: float) -> float:
        """Move the clock ``seconds`` on; returns the new instant."""
        assert seconds >= 0.0, seconds
        self._now += seconds
        return self._now

    def advance_to(self, instant: float) -> None:
        """Move the clock to exactly ``instant`` (not backwards)."""
        assert instant >= self._now, (instant, self._now)
        self._now = instant

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> ManualClock:
        """Be ``time`` in :data:`MODULES` until the test ends."""
        for name in self.MODULES:
            monkeypatch.setattr(importlib.import_module(name), "time", self)
        return self


class _RoundStop(threading.Event):
    """The monitor's stop flag, whose ``wait(poll)`` (the top of a watchdog round without
    signal handling) waits for the test's next :meth:`WatchdogRounds.step` instead of ``poll``."""

    def __init__(self, rounds: WatchdogRounds) -> None:
        super().__init__()
        self._rounds = rounds

    def wait(self, timeout: float | None = None) -> bool:
        self._rounds.next_round()
        return self.is_set()

    def set(self) -> None:
        super().set()
        self._rounds.wake()


class _RoundSelect:
    """The ``select`` module as the monitor sees it: ``select.select`` (the top of a watchdog
    round with signal handling) waits for the test's next :meth:`WatchdogRounds.step`, then
    looks at the signal wake-up pipe without waiting (a signal byte sent before the step is
    there: ``signal.raise_signal`` writes it before it returns)."""

    def __init__(self, rounds: WatchdogRounds) -> None:
        self._rounds = rounds

    def select(self, rlist: list[Any], wlist: list[Any], xlist: list[Any],
               timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
        self._rounds.next_round()
        return select.select(rlist, wlist, xlist, 0)


class WatchdogRounds:
    """Runs a :class:`RankMonitor`'s watchdog thread one round of its loop at a time.

    Each round of the thread's loop begins with a wait (``poll`` seconds on the stop flag, or
    ``select`` on the signal wake-up pipe); here that wait ends only when the test calls
    :meth:`step`, which returns once the round is over: the thread is back at its wait, or it
    has ended (a record that ends the rank). So every round sees exactly the state the test set
    before :meth:`step`, and with a :class:`ManualClock` what the watchdog decides depends on
    nothing but the order of the test's lines, however the threads are scheduled. Create it
    before :meth:`RankMonitor.start`; end with :meth:`finish`, then ``monitor.stop``.
    """

    def __init__(self, monitor: RankMonitor, monkeypatch: pytest.MonkeyPatch) -> None:
        import colonnade.reliability.monitor as module

        self._monitor = monitor
        self._cond = threading.Condition()
        self._granted = 0
        """Rounds the test has allowed (:meth:`step`)."""
        self._begun = 0
        """Rounds the thread has begun."""
        self._finished = 0
        """Rounds the thread has finished (it is back at its wait)."""
        self.ended = False
        """The thread has left its loop (a record that ends the rank, or :meth:`finish`)."""
        self._stop = _RoundStop(self)
        monkeypatch.setattr(monitor, "_stop", self._stop)
        monkeypatch.setattr(module, "select", _RoundSelect(self))
        loop = monitor._watch

        def watch() -> None:
            try:
                loop()
            finally:
                with self._cond:
                    self.ended = True
                    self._cond.notify_all()

        monkeypatch.setattr(monitor, "_watch", watch)

    def next_round(self) -> None:
        """In the watchdog thread, at the top of each round: the previous round is over; wait
        until the test allows the next one or the monitor stops."""
        with self._cond:
            self._finished = self._begun
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._granted > self._begun or self._stop.is_set())
            if self._granted > self._begun:
                self._begun += 1

    def wake(self) -> None:
        """The stop flag was set: a thread waiting for its next round goes on."""
        with self._cond:
            self._cond.notify_all()

    def step(self) -> None:
        """Let the thread run one round, and return when it is over."""
        with self._cond:
            self._granted += 1
            want = self._granted
            self._cond.notify_all()
            over = self._cond.wait_for(lambda: self._finished >= want or self.ended,
                                       timeout=BACKSTOP_S)
        assert over, f"the watchdog thread did not finish round {want} in {BACKSTOP_S} s"

    def finish(self) -> None:
        """Set the monitor's stop flag and wait until the thread has left its loop, so that
        ``monitor.stop()`` finds it gone: its final heartbeat is then the last one written,
        however slowly the thread runs (``stop`` itself waits for it only 5 s)."""
        self._stop.set()
        if self._monitor._thread is None:
            return
        with self._cond:
            gone = self._cond.wait_for(lambda: self.ended, timeout=BACKSTOP_S)
        assert gone, f"the watchdog thread did not end in {BACKSTOP_S} s"
