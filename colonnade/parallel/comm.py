"""Every collective and point-to-point transfer goes through this module.

A :class:`CommGroup` wraps one torch.distributed process group with a name ("tp", "dp", ...).
Each call is named, counted (calls, payload bytes, wire bytes per rank by the ring algorithm),
timed (time in flight and time the caller actually waited: the *exposed* time), and failures are
re-raised as :class:`CommError` naming the group, its ranks and the operation.

Wire bytes per rank for a payload of B bytes on n ranks (ring algorithms):
all-reduce 2(n-1)/n B, all-gather (n-1)/n B_out, reduce-scatter (n-1)/n B_in, send/recv B.
A group of size 1 performs no communication and counts nothing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class CommError(RuntimeError):
    """A collective failed or timed out; the message names group, ranks and operation."""


@dataclass
class OpStats:
    """Counters for one (group, operation) pair."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    in_flight_s: float = 0.0
    waited_s: float = 0.0


@dataclass
class CommStats:
    """Counters of every operation of every group of one rank, keyed by 'group/op'."""

    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, key: str, payload: int, wire: float) -> OpStats:
        """Count one call and return its stats entry."""
        entry = self.ops[key]
        entry.calls += 1
        entry.payload_bytes += payload
        entry.wire_bytes += wire
        return entry

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.ops.clear()

    def total(self, prefix: str = "", what: str = "wire_bytes") -> float:
        """Sum of one counter over keys starting with ``prefix`` (e.g. 'tp/' or 'dp/all_reduce')."""
        return float(sum(getattr(s, what) for k, s in self.ops.items() if k.startswith(prefix)))

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Plain-dict copy for logging / JSON."""
        return {k: dict(vars(v)) for k, v in sorted(self.ops.items())}


class Handle:
    """An in-flight asynchronous operation; :meth:`wait` records the exposed time."""

    def __init__(self, work: Any, group: CommGroup, op: str, entry: OpStats) -> None:
        self._work, self._group, self._op, self._entry = work, group, op, entry
        self._start = time.perf_counter()
        self.done = work is None

    def wait(self) -> None:
        """Block until the operation completes (idempotent)."""
        if self.done:
            return
        begin = time.perf_counter()
        try:
            self._work.wait()
        except Exception as err:  # re-raised with context
            raise self._group.error(self._op, err) from err
        end = time.perf_counter()
        self._entry.waited_s += end - begin
        self._entry.in_flight_s += end - self._start
        self.done = True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommGroup:
    """A named process group; all collectives of Colonnade are methods of this class."""

    def __init__(self, name: str, ranks: list[int], pg: Any, stats: CommStats,
                 global_rank: int) -> None:
        self.name = name
        self.ranks = list(ranks)
        self.pg = pg
        self.stats = stats
        self.size = len(ranks)
        self.rank = self.ranks.index(global_rank) if global_rank in self.ranks else -1

    def __repr__(self) -> str:
        return f"CommGroup({self.name}, ranks={self.ranks})"

    def error(self, op: str, err: BaseException) -> CommError:
        """Wrap a backend failure with the group, ranks and operation named."""
        return CommError(f"{op} on group '{self.name}' (ranks {self.ranks}, this rank's index "
                         f"{self.rank}) failed: {err}")

    def _run(self, op: str, name: str, payload: int, wire: float, fn: Any,
             async_op: bool) -> Handle | None:
        key = f"{self.name}/{op}" + (f"/{name}" if name else "")
        entry = self.stats.record(key, payload, wire)
        start = time.perf_counter()
        try:
            work = fn(async_op)
        except Exception as err:
            raise self.error(f"{op}({name})", err) from err
        if async_op:
            return Handle(work, self, f"{op}({name})", entry)
        entry.in_flight_s += time.perf_counter() - start
        entry.waited_s += time.perf_counter() - start
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
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except Exception as err:
            raise self.error("all_gather_object", err) from err
        return out

    def barrier(self) -> None:
        """Block until every rank of the group arrives."""
        if self.size > 1:
            try:
                dist.barrier(group=self.pg)
            except Exception as err:
                raise self.error("barrier", err) from err

    def p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
            *, name: str = "") -> Handle:
        """Post sends and receives (peers are *global* ranks) together; returns one handle.

        Uses ``batch_isend_irecv`` so the backend may fuse them; ``wait`` on the handle
        completes all of them.
        """
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group=self.pg) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=self.pg) for t, peer in recvs]
        payload = sum(_nbytes(t) for t, _ in sends)
        entry = self.stats.record(f"{self.name}/p2p" + (f"/{name}" if name else ""),
                                  payload, float(payload))
        if not ops:
            return Handle(None, self, "p2p", entry)
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as err:
            raise self.error(f"p2p({name})", err) from err
        return Handle(_WorkList(works), self, f"p2p({name})", entry)


class _WorkList:
    """Several backend works waited as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()
