"""Every collective and point-to-point transfer goes through this module.

A :class:`CommGroup` wraps one torch.distributed process group with a name ("tp", "dp", ...).
Each call is named, counted (calls, payload bytes, wire bytes per rank by the ring algorithm),
timed (time in flight and time the caller actually waited: the *exposed* time), and failures are
re-raised as :class:`CommError` naming the group, its ranks and the operation.

Wire bytes per rank for a payload of B bytes on n ranks (ring algorithms):
all-reduce 2(n-1)/n B, all-gather (n-1)/n B_out, reduce-scatter (n-1)/n B_in, send/recv B,
all-to-all the bytes sent to the other ranks ((n-1)/n B_in for equal splits).
A group of size 1 performs no communication and counts nothing.

Timing on both backends (:func:`clock_for`, the one place that tells them apart):
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
:mod:`colonnade.reliability` reads them. A backend timeout or a dead peer becomes a
:class:`CommError` that says which of the two it was. Under NCCL an asynchronous failure never
reaches ``wait()``: torch's own watchdog ends the process (set up by
:func:`colonnade.reliability.startup.torch_nccl_env`), after Colonnade's hang detector, which
fires first (:func:`colonnade.reliability.monitor.watchdog_seconds`), has written its report.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from colonnade.device import DeviceEvent

MAX_IN_FLIGHT = 4096
"""Records of un-waited operations kept at most (older ones are dropped)."""


class CommError(RuntimeError):
    """A collective failed or timed out; the message names group, ranks and operation."""

    def __init__(self, message: str, *, group: str = "", op: str = "",
                 ranks: tuple[int, ...] = (), timed_out: bool = False) -> None:
        super().__init__(message)
        self.group, self.op, self.ranks, self.timed_out = group, op, ranks, timed_out


def ranks_text(ranks: list[int] | tuple[int, ...]) -> str:
    """``[0, 1, 2, 3]`` -> ``'[0..3]'`` for long contiguous runs, else the plain list."""
    ranks = list(ranks)
    if len(ranks) > 4 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}..{ranks[-1]}]"
    return str(ranks)


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


COALESCING_BACKENDS = ("nccl",)
"""Backends that run the operations of one ``batch_isend_irecv`` as one group (NCCL's
``ncclGroupStart/End``); the others (gloo) post them one by one."""


def coalesces(pg: Any) -> bool:
    """Whether ``pg``'s backend coalesces batched p2p (:data:`COALESCING_BACKENDS`; a mixed
    backend such as 'cpu:gloo,cuda:nccl' counts as coalescing, the safe side)."""
    backend = backend_name(pg)
    return any(name in backend for name in COALESCING_BACKENDS)


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
class _Timing:
    """An operation whose wait has been issued but whose completion is not yet confirmed."""

    entry: OpStats
    seq: int
    posted: Mark
    waited: Mark
    ended: Mark
    work: Any

    def complete(self) -> bool:
        """Its end mark was reached and the backend says the work is done."""
        return self.ended.done() and (self.work is None or bool(self.work.is_completed()))


@dataclass
class CommStats:
    """Counters of every operation of every group of one rank, keyed by 'group/op'.

    Thread-safe: the hang detector reads :meth:`pending`, :meth:`progressed_at` and
    :meth:`overdue` from its thread, and the pipeline's p2p stream thread posts and waits
    while the main thread runs other collectives.
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
    unsettled: list[_Timing] = field(default_factory=list)
    """Waited operations of a stream-ordered backend not yet seen complete (NCCL)."""
    _lock: Any = field(default_factory=threading.RLock, repr=False)

    def begin(self, group: CommGroup, op: str, payload: int, waited: bool = False) -> int:
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

    def complete(self, timing: _Timing, host_blocking: bool) -> None:
        """The caller's wait for an operation returned: on a host-blocking backend it is done
        now; otherwise it is settled once its end mark and its work are complete."""
        if host_blocking:
            self._account(timing)
            return
        with self._lock:
            self.unsettled.append(timing)
            if len(self.unsettled) > MAX_IN_FLIGHT:
                self.unsettled.pop(0)
        self.poll()

    def _account(self, t: _Timing) -> None:
        with self._lock:
            t.entry.waited_s += t.ended.seconds_since(t.waited)
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
        with self._lock:  # the pipeline's p2p stream thread counts too
            entry = self.ops[key]
            entry.calls += 1
            entry.payload_bytes += payload
            entry.wire_bytes += wire
            return entry

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.settle()
        self.ops.clear()

    def total(self, prefix: str = "", what: str = "wire_bytes") -> float:
        """Sum of one counter over keys starting with ``prefix`` (e.g. 'tp/' or 'dp/all_reduce');
        times settled first."""
        self.settle()
        return float(sum(getattr(s, what) for k, s in self.ops.items() if k.startswith(prefix)))

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Plain-dict copy for logging / JSON (times settled first)."""
        self.settle()
        return {k: dict(vars(v)) for k, v in sorted(self.ops.items())}


class Handle:
    """An in-flight asynchronous operation; :meth:`wait` records the exposed time."""

    def __init__(self, work: Any, group: CommGroup, op: str, entry: OpStats,
                 seq: int = 0, posted: Mark | None = None) -> None:
        self._work, self._group, self._op, self._entry = work, group, op, entry
        self._seq = seq
        self._posted = posted if posted is not None or work is None else group.clock.mark()
        self._start = time.perf_counter()
        self.done = work is None
        """The caller's wait has returned (on NCCL: its stream is ordered after the op)."""

    def wait(self) -> None:
        """Wait for the operation (idempotent): on gloo the host blocks until it is done; on
        NCCL the caller's stream waits, and the op is finished once its event completes."""
        if self.done:
            return
        stats, clock = self._group.stats, self._group.clock
        stats.mark_waited(self._seq)
        begin = clock.mark()
        try:
            self._work.wait()
        except Exception as err:  # re-raised with context
            raise self._group.error(self._op, err, self._start) from err
        assert self._posted is not None
        stats.complete(_Timing(self._entry, self._seq, self._posted, begin, clock.mark(),
                               self._work), clock.host_blocking)
        self.done = True

    def is_completed(self) -> bool:
        """Whether the operation has finished, without blocking."""
        return self._work is None or bool(self._work.is_completed())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommGroup:
    """A named process group; all collectives of Colonnade are methods of this class."""

    def __init__(self, name: str, ranks: list[int], pg: Any, stats: CommStats,
                 global_rank: int, clock: Clock | None = None) -> None:
        self.name = name
        self.ranks = list(ranks)
        self.pg = pg
        self.stats = stats
        self.clock = clock if clock is not None else clock_for(pg)
        """How this group's operations are timed and finished (:func:`clock_for`)."""
        self.size = len(ranks)
        self.rank = self.ranks.index(global_rank) if global_rank in self.ranks else -1
        self.coalesces = coalesces(pg)
        """Whether the backend runs a ``batch_isend_irecv`` as one group (:func:`coalesces`)."""

    def __repr__(self) -> str:
        return f"CommGroup({self.name}, ranks={self.ranks})"

    def error(self, op: str, err: BaseException, started: float | None = None) -> CommError:
        """Wrap a backend failure with the group, ranks and operation named, plus a diagnosis.

        ``started`` (``time.perf_counter()`` when the operation was posted) adds how long it
        waited. A timeout means another rank of the group never joined (stuck or dead); a
        closed connection means a peer process died.
        """
        text = " ".join(str(err).split())
        low = text.lower()
        timed_out = "timed out" in low or "timeout" in low
        waited = f" after {time.perf_counter() - started:.1f} s" if started is not None else ""
        me = self.ranks[self.rank] if self.rank >= 0 else "?"
        hint = ""
        if timed_out:
            hint = (" [timed out (parallel.timeout_s): another rank of this group never joined; "
                    "it is stuck or dead - see every rank's dump under logging.dir/failures]")
        elif any(k in low for k in ("connection closed", "connection reset", "broken pipe",
                                    "connection refused", "peer")):
            hint = " [a peer rank of this group has died; the launcher's report names it]"
        return CommError(f"{op} on group '{self.name}' (ranks {ranks_text(self.ranks)}, this "
                         f"rank's index {self.rank}, global rank {me}) failed{waited}: "
                         f"{text}{hint}", group=self.name, op=op, ranks=tuple(self.ranks),
                         timed_out=timed_out)

    def _run(self, op: str, name: str, payload: int, wire: float, fn: Any,
             async_op: bool) -> Handle | None:
        key = f"{self.name}/{op}" + (f"/{name}" if name else "")
        entry = self.stats.record(key, payload, wire)
        seq = self.stats.begin(self, f"{op}({name})", payload, waited=not async_op)
        start, posted = time.perf_counter(), self.clock.mark()
        try:
            work = fn(async_op)
        except Exception as err:
            raise self.error(f"{op}({name})", err, start) from err
        if async_op:
            return Handle(work, self, f"{op}({name})", entry, seq, posted)
        # blocking: the whole time is exposed (on NCCL: settled when the end event completes)
        self.stats.complete(_Timing(entry, seq, posted, posted, self.clock.mark(), None),
                            self.clock.host_blocking)
        return None

    def all_reduce(self, t: torch.Tensor, *, op: Any = None, name: str = "",
                   async_op: bool = False) -> Handle | None:
        """In-place all-reduce (sum by default) of ``t`` over the group."""
        if self.size == 1:
            return Handle(None, self, "all_reduce", OpStats()) if async_op else None
        n, b = self.size, _nbytes(t)
        red = op if op is not None else dist.ReduceOp.SUM
        return self._run("all_reduce", name, b, 2 * (n - 1) / n * b,
                         lambda a: dist.all_reduce(t, op=red, group=self.pg, async_op=a), async_op)

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, *, name: str = "",
                        async_op: bool = False) -> Handle | None:
        """``out`` (n x t along dim 0) receives every rank's ``t`` in rank order."""
        if self.size == 1:
            out.copy_(t)
            return Handle(None, self, "all_gather", OpStats()) if async_op else None
        n, b = self.size, _nbytes(out)
        return self._run("all_gather", name, _nbytes(t), (n - 1) / n * b,
                         lambda a: dist.all_gather_single(out, t.contiguous(), group=self.pg,
                                                               async_op=a), async_op)

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor, *, op: Any = None,
                            name: str = "", async_op: bool = False) -> Handle | None:
        """Sum ``t`` over ranks and give rank i the i-th slice (along dim 0) into ``out``."""
        if self.size == 1:
            out.copy_(t)
            return Handle(None, self, "reduce_scatter", OpStats()) if async_op else None
        n, b = self.size, _nbytes(t)
        red = op if op is not None else dist.ReduceOp.SUM
        return self._run("reduce_scatter", name, b, (n - 1) / n * b,
                         lambda a: dist.reduce_scatter_single(out, t.contiguous(), op=red,
                                                              group=self.pg, async_op=a), async_op)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, *,
                   in_splits: list[int] | None = None, out_splits: list[int] | None = None,
                   name: str = "", async_op: bool = False) -> Handle | None:
        """Rank i sends rows ``in_splits[j]`` of ``t`` (dim 0, consecutive blocks in rank
        order) to rank j and receives ``out_splits[j]`` rows from rank j into ``out``.

        Splits None: equal blocks, ``t.shape[0] / n`` rows each way. Wire bytes: what leaves
        this rank, ``(B_in - B_in[own block])``, i.e. ``(n-1)/n B_in`` for equal splits.
        """
        if self.size == 1:
            out.copy_(t)
            return Handle(None, self, "all_to_all", OpStats()) if async_op else None
        rows = max(t.shape[0], 1)
        own = (in_splits[self.rank] if in_splits is not None else t.shape[0] // self.size)
        b = _nbytes(t)
        wire = float(b - own * (b // rows))
        return self._run("all_to_all", name, b, wire,
                         lambda a: dist.all_to_all_single(out, t.contiguous(), out_splits,
                                                          in_splits, group=self.pg,
                                                          async_op=a), async_op)

    def broadcast(self, t: torch.Tensor, *, src: int = 0, name: str = "") -> None:
        """Broadcast ``t`` from the group's local rank ``src``."""
        if self.size == 1:
            return
        b = _nbytes(t)
        self._run("broadcast", name, b, float(b),
                  lambda a: dist.broadcast(t, src=self.ranks[src], group=self.pg, async_op=a),
                  False)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank (control plane only, never tensors)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        seq = self.stats.begin(self, "all_gather_object", 0, waited=True)
        start = time.perf_counter()
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except Exception as err:
            raise self.error("all_gather_object", err, start) from err
        self.stats.finish(seq)
        return out

    def barrier(self) -> None:
        """Block until every rank of the group arrives."""
        if self.size > 1:
            seq, start = self.stats.begin(self, "barrier", 0, True), time.perf_counter()
            try:
                dist.barrier(group=self.pg)
            except Exception as err:
                raise self.error("barrier", err, start) from err
            self.stats.finish(seq)

    def p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
            *, name: str = "") -> Handle:
        """Post sends and receives (peers are *global* ranks) together; returns one handle.

        On a backend that coalesces (NCCL) they go through ``batch_isend_irecv``, one group
        that starts and completes together; elsewhere (gloo) ``batch_isend_irecv`` would only
        loop over ``isend`` / ``irecv``, so they are posted by those directly (~17 us less host
        time per operation, on every hop of a pipeline's critical path). ``wait`` on the handle
        completes all of them.
        """
        sends = [(t.contiguous(), peer) for t, peer in sends]
        payload = sum(_nbytes(t) for t, _ in sends)
        entry = self.stats.record(f"{self.name}/p2p" + (f"/{name}" if name else ""),
                                  payload, float(payload))
        if not sends and not recvs:
            return Handle(None, self, "p2p", entry)
        seq, start = self.stats.begin(self, f"p2p({name})", payload), time.perf_counter()
        posted = self.clock.mark()
        try:
            if self.coalesces:
                works = dist.batch_isend_irecv(
                    [dist.P2POp(dist.isend, t, peer, group=self.pg) for t, peer in sends]
                    + [dist.P2POp(dist.irecv, t, peer, group=self.pg) for t, peer in recvs])
            else:
                works = [dist.isend(t, peer, group=self.pg) for t, peer in sends]
                works += [dist.irecv(t, peer, group=self.pg) for t, peer in recvs]
        except Exception as err:
            raise self.error(f"p2p({name})", err, start) from err
        return Handle(_WorkList(works), self, f"p2p({name})", entry, seq, posted)


class _WorkList:
    """Several backend works waited as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        """Wait for every work."""
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        """Every work is done."""
        return all(w.is_completed() for w in self.works)
