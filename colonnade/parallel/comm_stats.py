"""The accounting behind :mod:`colonnade.parallel.comm`: what each operation cost, what is pending.

:class:`CommStats` counts each named operation of a rank (calls, payload bytes, wire bytes per
rank by the ring algorithm) and times it: time in flight and time the caller actually waited
(the *exposed* time). :func:`clock_for` (the one place that tells the backends apart) says how:
* gloo: ``wait()`` blocks the host until the data is there, so wall-clock time is honest: an op
  is finished when ``wait()`` returns, exposed time = the time spent in ``wait()``.
* NCCL: ``wait()`` only makes the caller's CUDA stream wait for the op's stream and returns at
  once. Times come from CUDA events recorded on the caller's stream (:class:`DeviceEvent`) at
  posting (p), before ``wait()`` (w) and after it (e): in flight = e - p, exposed = e - w (how
  long the compute stream stalled on the op). An op stays pending (in :meth:`CommStats.pending`,
  what the hang detector reports) until event e has completed *and* the backend says the work
  is done; the times are added lazily, when the stats are read or at the step's
  synchronisation (:meth:`CommStats.settle`).

For failure diagnosis :class:`CommStats` also keeps the last posted operation, the operations
still in flight and the time of the latest completion (:class:`OpRecord`); the hang detector of
:mod:`colonnade.reliability` reads them.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from colonnade.device import DeviceEvent

MAX_IN_FLIGHT = 4096
"""Records of un-waited operations kept at most (older ones are dropped)."""


def ranks_text(ranks: list[int] | tuple[int, ...]) -> str:
    """``[0, 1, 2, 3]`` -> ``'[0..3]'`` for long contiguous runs, else the plain list."""
    ranks = list(ranks)
    if len(ranks) > 4 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}..{ranks[-1]}]"
    return str(ranks)


class GroupName(Protocol):
    """What the stats note of a group (a :class:`~colonnade.parallel.comm.CommGroup`)."""

    name: str
    ranks: list[int]


class Mark(Protocol):
    """A point on the caller's timeline (a wall-clock reading or a CUDA event)."""

    def done(self) -> bool:
        """Whether the point has been reached (always, for a wall-clock reading)."""
        ...

    def wait(self) -> None:
        """Block the host until the point has been reached."""
        ...

    def seconds_since(self, earlier: Any) -> float:
        """Seconds from ``earlier`` (a mark of the same clock) to this one; both done."""
        ...


class Clock(Protocol):
    """Makes :class:`Mark` s; ``host_blocking`` says whether ``wait()`` blocks the host."""

    host_blocking: bool

    def mark(self) -> Mark:
        """A mark at this point of the caller's timeline."""
        ...


class WallMark:
    """``time.perf_counter()`` when it was made."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def done(self) -> bool:
        """Always: the host has passed it."""
        return True

    def wait(self) -> None:
        """Nothing to wait for."""

    def seconds_since(self, earlier: Any) -> float:
        """Wall-clock seconds from ``earlier``."""
        return float(self.t - earlier.t)


class WallClock:
    """Host timeline: backends whose ``wait()`` blocks until the data is there (gloo)."""

    host_blocking = True

    def mark(self) -> Mark:
        """The current wall-clock time."""
        return WallMark()


class EventClock:
    """Device timeline: CUDA events on the current stream, for backends whose ``wait()`` only
    orders streams (NCCL)."""

    host_blocking = False

    def mark(self) -> Mark:
        """An event recorded on the current CUDA stream."""
        return DeviceEvent()


STREAM_ORDERED_BACKENDS = ("nccl",)
"""Backends whose ``Work.wait()`` returns before the operation is done (it orders streams)."""


def clock_for(pg: Any) -> Clock:
    """The one place where the backend decides how operations are timed and finished:
    wall clock for host-blocking backends (gloo, and size-1 groups), CUDA events for
    stream-ordered ones (:data:`STREAM_ORDERED_BACKENDS`)."""
    backend = backend_name(pg)
    if any(name in backend for name in STREAM_ORDERED_BACKENDS):
        return EventClock()
    return WallClock()


def backend_name(pg: Any) -> str:
    """``pg``'s backend, lower case ('gloo', 'nccl', 'cpu:gloo,cuda:nccl'); '' for no group
    (size 1) or a group this rank is not in (it never runs an operation there)."""
    if pg is None:
        return ""
    try:
        return str(dist.get_backend(pg)).lower()
    except (RuntimeError, ValueError):
        return ""


@dataclass
class OpRecord:
    """One posted operation as the hang detector and failure dumps see it."""

    group: str
    ranks: tuple[int, ...]
    op: str
    """Operation and its name, e.g. 'all_reduce(dp_grads)'."""
    payload_bytes: int
    started: float
    """``time.monotonic()`` when it was posted."""
    finished: float | None = None
    """``time.monotonic()`` when it was seen complete; None while in flight (or failed)."""
    waited: float | None = None
    """``time.monotonic()`` when the caller first needed the result (a blocking call: at
    posting; async: its ``wait()``); None while nobody waits for it."""

    def describe(self, now: float | None = None, ages: bool = True) -> str:
        """'all_reduce(x) on group 'dp' (ranks [0, 2], 64 B), in flight for 3.2 s' (without
        ``ages``: '..., in flight' / '..., completed', for text read later)."""
        now = time.monotonic() if now is None else now
        if not ages:
            state = "in flight" if self.finished is None else "completed"
        elif self.finished is None:
            state = f"in flight for {now - self.started:.1f} s"
        else:
            state = f"completed {now - self.finished:.1f} s ago"
        return (f"{self.op} on group '{self.group}' (ranks {ranks_text(self.ranks)}, "
                f"{self.payload_bytes} B), {state}")


@dataclass
class OpStats:
    """Counters for one (group, operation) pair."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    in_flight_s: float = 0.0
    """Posting to completion as the caller sees it (until its wait returned / stream passed)."""
    waited_s: float = 0.0
    """Exposed time: how long the caller (host on gloo, compute stream on NCCL) stalled."""


@dataclass
class Timing:
    """An operation whose wait has been issued but whose completion is not yet confirmed."""

    entry: OpStats
    seq: int
    posted: Mark
    waited: Mark
    ended: Mark
    work: Any
    phase: str = ""
    """The step phase (:attr:`CommStats.phase`) the caller's wait returned in."""

    def complete(self) -> bool:
        """Its end mark was reached and the backend says the work is done."""
        return self.ended.done() and (self.work is None or bool(self.work.is_completed()))


@dataclass
class CommStats:
    """Counters of every operation of every group of one rank, keyed by 'group/op'.

    Thread-safe: the hang detector reads :meth:`pending`, :meth:`progressed_at` and
    :meth:`overdue` from its thread, and the pipeline's p2p posting thread posts (and waits
    in in-order mode) while the main thread runs other collectives.
    """

    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    last: OpRecord | None = None
    """The operation posted most recently (what a hang dump reports)."""
    in_flight: dict[int, OpRecord] = field(default_factory=dict)
    """Posted operations not yet completed, by sequence number."""
    last_progress: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` of the latest completion seen (the hang detector's progress)."""
    posted: int = 0
    """Operations posted so far (sequence numbers)."""
    unsettled: list[Timing] = field(default_factory=list)
    """Waited operations of a stream-ordered backend not yet seen complete (NCCL)."""
    phase: str = ""
    """The part of the training step the rank is in (set by the straggler detector's step
    timer, :mod:`colonnade.reliability.straggler`); exposed time is also summed per phase."""
    waited_by_phase: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Exposed (waited) seconds per :attr:`phase` in which the caller's wait returned."""
    _lock: Any = field(default_factory=threading.RLock, repr=False)

    def begin(self, group: GroupName, op: str, payload: int, waited: bool = False) -> int:
        """Note that ``op`` was posted on ``group`` (``waited``: a blocking call); returns its
        sequence number."""
        now = time.monotonic()
        rec = OpRecord(group.name, tuple(group.ranks), op, payload, now,
                       waited=now if waited else None)
        with self._lock:
            self.poll()
            self.posted += 1
            self.last = rec
            self.in_flight[self.posted] = rec
            if len(self.in_flight) > MAX_IN_FLIGHT:  # a handle dropped without wait(): forget it
                self.in_flight.pop(next(iter(self.in_flight)))
            return self.posted

    def mark_waited(self, seq: int) -> None:
        """The caller now needs the result of operation ``seq``."""
        with self._lock:
            rec = self.in_flight.get(seq)
            if rec is not None and rec.waited is None:
                rec.waited = time.monotonic()

    def finish(self, seq: int) -> None:
        """Note that operation ``seq`` completed."""
        with self._lock:
            rec = self.in_flight.pop(seq, None)
            now = time.monotonic()
            if rec is not None:
                rec.finished = now
            self.last_progress = now

    def complete(self, timing: Timing, host_blocking: bool) -> None:
        """The caller's wait for an operation returned: on a host-blocking backend it is done
        now; otherwise it is settled once its end mark and its work are complete."""
        timing.phase = self.phase
        if host_blocking:
            self._account(timing)
            return
        with self._lock:
            self.unsettled.append(timing)
            if len(self.unsettled) > MAX_IN_FLIGHT:
                self.unsettled.pop(0)
        self.poll()

    def _account(self, t: Timing) -> None:
        with self._lock:
            waited = t.ended.seconds_since(t.waited)
            t.entry.waited_s += waited
            self.waited_by_phase[t.phase] += waited
            t.entry.in_flight_s += t.ended.seconds_since(t.posted)
            self.finish(t.seq)

    def poll(self) -> None:
        """Settle the waited operations that have completed (never blocks)."""
        with self._lock:
            if not self.unsettled:
                return
            still = []
            for t in self.unsettled:
                if t.complete():
                    self._account(t)
                else:
                    still.append(t)
            self.unsettled = still

    def settle(self) -> None:
        """Wait (host) for every waited operation's end mark, then settle what completed: the
        step's synchronisation point. A no-op on host-blocking backends."""
        with self._lock:
            marks = [t.ended for t in self.unsettled]
        for mark in marks:
            mark.wait()
        self.poll()

    def pending(self) -> list[OpRecord]:
        """Operations in flight, oldest first (a snapshot, safe from another thread)."""
        with self._lock:
            self.poll()
            return list(self.in_flight.values())

    def progressed_at(self) -> float:
        """``time.monotonic()`` of the latest completion, completions so far settled."""
        self.poll()
        return self.last_progress

    def overdue(self, limit_s: float, now: float | None = None) -> OpRecord | None:
        """The oldest operation the caller waits for that was posted over ``limit_s`` ago (the
        backend's own timeout counts from posting too), or None."""
        now = time.monotonic() if now is None else now
        for rec in self.pending():
            if rec.waited is not None and now - rec.started > limit_s:
                return rec
        return None

    def record(self, key: str, payload: int, wire: float) -> OpStats:
        """Count one call and return its stats entry."""
        with self._lock:  # the pipeline's p2p posting thread counts too
            entry = self.ops[key]
            entry.calls += 1
            entry.payload_bytes += payload
            entry.wire_bytes += wire
            return entry

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.settle()
        self.ops.clear()
        self.waited_by_phase.clear()

    def total(self, prefix: str = "", what: str = "wire_bytes") -> float:
        """Sum of one counter over keys starting with ``prefix`` (e.g. 'tp/' or 'dp/all_reduce');
        times settled first."""
        self.settle()
        return float(sum(getattr(s, what) for k, s in self.ops.items() if k.startswith(prefix)))

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Plain-dict copy for logging / JSON (times settled first)."""
        self.settle()
        return {k: dict(vars(v)) for k, v in sorted(self.ops.items())}
