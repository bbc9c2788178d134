"""Every collective and point-to-point transfer goes through this module.

A :class:`CommGroup` wraps one torch.distributed process group with a name ("tp", "dp", ...).
Each call is named, counted (calls, payload bytes, wire bytes per rank by the ring algorithm),
timed (time in flight and time the caller actually waited: the *exposed* time) in the rank's
:class:`~colonnade.parallel.comm_stats.CommStats`, and failures are re-raised as
:class:`CommError` naming the group, its ranks and the operation.

Wire bytes per rank for a payload of B bytes on n ranks (ring algorithms):
all-reduce 2(n-1)/n B, all-gather (n-1)/n B_out, reduce-scatter (n-1)/n B_in, send/recv B,
all-to-all the bytes sent to the other ranks ((n-1)/n B_in for equal splits).
A group of size 1 performs no communication and counts nothing. How each backend's operations
are timed and finished (gloo: the host waits; NCCL: the stream waits, CUDA events time it) is
in :mod:`colonnade.parallel.comm_stats`.

A backend timeout or a dead peer becomes a :class:`CommError` that says which of the two it
was. Under NCCL an asynchronous failure never reaches ``wait()``: torch's own watchdog ends the
process (set up by :func:`colonnade.reliability.startup.torch_nccl_env`), after Colonnade's hang
detector, which fires first (:func:`colonnade.reliability.monitor.watchdog_seconds`), has
written its report.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from colonnade.parallel.comm_stats import (
    Clock,
    CommStats,
    Mark,
    OpStats,
    Timing,
    backend_name,
    clock_for,
    ranks_text,
)

__all__ = ["CommError", "CommGroup", "CommStats", "Handle", "coalesces"]

class CommError(RuntimeError):
    """A collective failed or timed out; the message names group, ranks and operation."""

    def __init__(self, message: str, *, group: str = "", op: str = "",
                 ranks: tuple[int, ...] = (), timed_out: bool = False) -> None:
        super().__init__(message)
        self.group, self.op, self.ranks, self.timed_out = group, op, ranks, timed_out


COALESCING_BACKENDS = ("nccl",)
"""Backends that run the operations of one ``batch_isend_irecv`` as one group (NCCL's
``ncclGroupStart/End``); the others (gloo) post them one by one."""


def coalesces(pg: Any) -> bool:
    """Whether ``pg``'s backend coalesces batched p2p (:data:`COALESCING_BACKENDS`; a mixed
    backend such as 'cpu:gloo,cuda:nccl' counts as coalescing, the safe side)."""
    backend = backend_name(pg)
    return any(name in backend for name in COALESCING_BACKENDS)


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
        stats.complete(Timing(self._entry, self._seq, self._posted, begin, clock.mark(),
                               self._work), clock.host_blocking)
        self.done = True

    def is_completed(self) -> bool:
        """Whether the operation has finished, without blocking."""
        return self._work is None or bool(self._work.is_completed())

    def abandon(self) -> None:
        """Forget the backend work (its group was released after a peer's death,
        :meth:`CommGroup.release`): ``wait`` returns at once; what the operation was to
        produce is garbage, and the state it fed is restored after the rejoin."""
        self._work = None
        self.done = True


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
        self._inflight: weakref.WeakSet[Handle] = weakref.WeakSet()
        """Asynchronous operations posted and not yet waited (abandoned by :meth:`release`)."""

    def __repr__(self) -> str:
        return f"CommGroup({self.name}, ranks={self.ranks})"

    def rebind(self, pg: Any) -> None:
        """Use process group ``pg`` from now on (same name and ranks): an in-process restart
        (:mod:`colonnade.reliability.rejoin`) replaces a broken group by the next
        generation's, and whatever holds this CommGroup (layers, buffers, optimizer) keeps
        working without being rebuilt. Counters (``stats``) carry on."""
        self.pg = pg
        self.clock = clock_for(pg)
        self.coalesces = coalesces(pg)

    def release(self) -> None:
        """Drop this group's process group and abandon its operations in flight
        (:meth:`Handle.abandon`), so nothing in this process references the broken
        communicator any more: on gloo its sockets close once it is collected, and a peer
        blocked on this rank raises instead of waiting for the timeout. Every call until
        :meth:`rebind` would run on no group: none is made (the rank is rejoining)."""
        for handle in list(self._inflight):
            handle.abandon()
        self._inflight.clear()
        self.pg = None

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
            handle = Handle(work, self, f"{op}({name})", entry, seq, posted)
            self._inflight.add(handle)
            return handle
        # blocking: the whole time is exposed (on NCCL: settled when the end event completes)
        self.stats.complete(Timing(entry, seq, posted, posted, self.clock.mark(), None),
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
        handle = Handle(_WorkList(works), self, f"p2p({name})", entry, seq, posted)
        self._inflight.add(handle)
        return handle


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
