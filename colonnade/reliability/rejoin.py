"""In-process restart, the rank's side: leave broken process groups, rejoin the next generation.

Under ``checkpoint.restart='in-process'`` the launcher's supervisor
(:mod:`colonnade.reliability.supervisor`) hosts the job's store and, when a rank dies, bumps
the *generation* counter in it (key :func:`generation_key`) and starts a replacement process
with the same RANK. Each surviving rank:

1. notices the failure: on gloo a collective with the dead peer raises (its sockets close:
   "Connection closed by peer" / "Read error"), and ranks that were waiting on a survivor
   raise as soon as that survivor leaves its groups, so the failure reaches every rank within
   a collective; on NCCL a collective with a dead peer does not raise on the host (``wait()``
   only orders streams), so :class:`GenerationWatch` (a thread polling the store) aborts the
   communicators when the generation moves, which makes the stuck host call raise;
2. leaves its groups (:meth:`Membership.leave`): every CommGroup drops its process group and
   abandons its operations in flight, gloo ``destroy_process_group()`` shuts every group down
   and the collector closes its sockets; NCCL ``_abort_process_group()`` aborts every
   communicator inside one ncclGroupStart/End (``ncclCommAbort``: a communicator with a dead
   peer cannot be destroyed collectively);
3. waits for the next generation (:meth:`Membership.wait_next`) and joins its default group
   on the store prefix ``colonnade/attempt{a}/gen{g}`` (:meth:`Membership.init`), so no key of
   a broken generation is read again. The training side rebuilds its groups in place
   (:meth:`colonnade.parallel.groups.ProcessGroups.adopt`) and restores the state
   (:mod:`colonnade.training.inprocess`).

A replacement process joins the generation the store names when it starts. A rank that cannot
rejoin (no new generation within ``parallel.timeout_s``) raises :class:`RejoinError`; the
supervisor then restarts the whole job (``--max-restarts`` permitting).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from colonnade.parallel.comm import CommError, CommGroup
from colonnade.parallel.groups import ProcessGroups

SUPERVISOR_KEY = "colonnade/supervisor"
"""Set by the supervisor in the job's store: a rank started by anything else (torchrun) under
restart='in-process' has nobody to replace a dead peer and refuses to start."""
POLL_S = 0.05
"""How often a rank waiting for the next generation reads the store (seconds)."""
PEER_FAILURES: tuple[type[BaseException], ...] = (CommError, dist.DistError)
"""What a collective raises when a peer of its group has died (or left its groups)."""


REJOIN_FAILED = 3
"""Exit status of a rank that could not rejoin: the supervisor restarts the whole job."""


class RejoinError(RuntimeError):
    """This rank could not rejoin the job (no next generation in time, or nothing to restore)."""


def generation_key(attempt: int) -> str:
    """The store key holding the current generation of job attempt ``attempt``."""
    return f"colonnade/attempt{attempt}/generation"


def ready_key(attempt: int, generation: int) -> str:
    """The store counter each rank adds 1 to once it has rejoined and restored its state."""
    return f"colonnade/attempt{attempt}/gen{generation}/ready"


def read_generation(store: Any, attempt: int) -> int:
    """The generation the store names (0 before any in-process restart)."""
    key = generation_key(attempt)
    return int(store.get(key)) if store.check([key]) else 0


@dataclass
class Membership:
    """This rank's place in an in-process restartable job: the job's store (unprefixed), who
    it is, and the generation of the process groups it is in."""

    store: Any
    rank: int
    world: int
    attempt: int
    generation: int
    backend: str
    device: torch.device
    timeout_s: float
    watch: GenerationWatch | None = field(default=None)
    """NCCL: the thread that aborts the communicators when the generation moves."""
    rejoined_at: float | None = field(default=None)
    """``time.perf_counter()`` when the last failure was caught (None: none yet); the loop
    reports the time from it to the next completed step."""

    @property
    def prefix(self) -> str:
        """The store prefix of this generation's default group."""
        return f"colonnade/attempt{self.attempt}/gen{self.generation}"

    def init(self) -> None:
        """Join this generation's default process group (every rank of the generation)."""
        from colonnade.reliability.startup import join_barrier

        store = dist.PrefixStore(self.prefix, self.store)
        timeout = timedelta(seconds=self.timeout_s)
        join_barrier(store, self.rank, self.world, timeout)
        dist.init_process_group(self.backend, store=store, rank=self.rank,
                                world_size=self.world, timeout=timeout,
                                device_id=self.device if self.device.type == "cuda" else None)

    def leave(self, groups: ProcessGroups, others: Sequence[CommGroup] = (),
              drain: Callable[[], None] | None = None) -> None:
        """Leave every process group of this generation: ``groups`` drop them and abandon
        their operations in flight (:meth:`ProcessGroups.release`), then gloo destroys them
        and NCCL aborts them (see the module), and the collector frees them. Gloo closes a
        group's sockets only when the last reference to it is gone (destroying a group that
        something still holds leaves its peers blocked until the timeout): that is what makes
        a survivor's peers that wait on it raise at once. ``others``: groups made outside
        ``groups`` (the memory snapshots' own group), released too; ``drain``: waits for a
        background thread that used them (its error, a dead peer's, is dropped: the recovery
        lists only complete snapshots)."""
        groups.release()
        for group in others:
            group.release()
        if self.backend == "nccl":
            abort_communicators()
        elif dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if drain is not None:
            with contextlib.suppress(Exception):
                drain()
            gc.collect()

    def wait_next(self, beat: Callable[[], None] | None = None) -> int:
        """Wait for a generation newer than this one (the supervisor has started a replacement)
        and take it; ``beat`` is called while waiting (the hang watchdog's heartbeat). Raises
        :class:`RejoinError` after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while (g := read_generation(self.store, self.attempt)) <= self.generation:
            if time.monotonic() > deadline:
                raise RejoinError(
                    f"rank {self.rank}: no new generation after generation {self.generation} "
                    f"within parallel.timeout_s={self.timeout_s} s (no rank was replaced: the "
                    "failure was not a dead process, or the supervisor is gone)")
            if beat is not None:
                beat()
            time.sleep(POLL_S)
        self.generation = g
        return g

    def mark_ready(self) -> None:
        """Tell the supervisor this rank has rejoined and restored (it counts the ranks)."""
        self.store.add(ready_key(self.attempt, self.generation), 1)


def join_job(backend: str, device: torch.device, timeout_s: float) -> Membership:
    """Connect to the supervisor's store (env:// : MASTER_ADDR / MASTER_PORT, RANK,
    WORLD_SIZE, TORCHELASTIC_RESTART_COUNT) and join the generation it names."""
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    if not store.check([SUPERVISOR_KEY]):
        raise RejoinError("checkpoint.restart='in-process' needs `colonnade train --nproc N` "
                          "(its supervisor replaces a dead rank); under torchrun use "
                          "--checkpoint.restart=job")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    member = Membership(store, rank, world, attempt, read_generation(store, attempt), backend,
                        device, timeout_s)
    member.init()
    if backend == "nccl":  # a dead peer does not make an NCCL call raise: watch the store
        member.watch = GenerationWatch(store.clone(), member, abort_communicators).start()
    return member


def abort_communicators() -> None:
    """Abort every NCCL communicator of this process (``ncclCommAbort`` inside one
    ncclGroupStart/End), from the watch thread: the main thread's pending NCCL work fails, so
    its next synchronising call raises and the rank rejoins. A no-op once they are gone."""
    if dist.is_initialized():
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()


class GenerationWatch:
    """NCCL's failure detection: a thread polling the store that calls ``on_change`` (abort
    the communicators, :meth:`Membership.leave`) once the generation moves past the one this
    rank is in, so a host call stuck behind a collective with a dead peer raises. Gloo needs
    no watch (the collective itself raises). ``store`` is a client of its own (a store client
    is not shared between threads)."""

    def __init__(self, store: Any, member: Membership, on_change: Callable[[], None],
                 poll_s: float = 0.5) -> None:
        self.store, self.member, self.on_change, self.poll_s = store, member, on_change, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="colonnade-generation",
                                        daemon=True)
        self.fired_for = member.generation
        """The newest generation this watch has aborted for."""

    def start(self) -> GenerationWatch:
        """Start polling."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()

    def check(self) -> bool:
        """One poll: abort when the store's generation is past this rank's; True if it did."""
        g = read_generation(self.store, self.member.attempt)
        if g <= max(self.member.generation, self.fired_for):
            return False
        self.fired_for = g
        self.on_change()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()
