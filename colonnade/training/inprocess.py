"""In-process restart, the training side: after a peer's death, rebuild the groups in place and
restore the state, keeping this process, its imported torch and its built model.

The rank's side of the protocol is :mod:`colonnade.reliability.rejoin` (leave the broken
groups, wait for the supervisor's next generation, join its default group); here the run's
:class:`~colonnade.parallel.groups.ProcessGroups` are built again for the same layout and
adopted in place (every :class:`~colonnade.parallel.comm.CommGroup` the model, the data-parallel
buffers and the optimizer hold rebinds to the new generation's process group, nothing is
rebuilt), and every rank, the replacement included, restores its state into its live trainer
by the recovery ladder (own memory snapshot, the partner's copy, the latest checkpoint) or,
without memory snapshots, from the latest checkpoint (:func:`restore`, one collective call on
every rank). A restored rank continues
from that step: the losses equal the uninterrupted run's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from colonnade.checkpoint.recovery import recover
from colonnade.checkpoint.training_state import start_from
from colonnade.reliability.monitor import RankMonitor
from colonnade.reliability.rejoin import Membership, RejoinError
from colonnade.reliability.startup import latest_checkpoint
from colonnade.training.setup import build_groups


def restore(trainer: Any, member: Membership) -> str:
    """Every rank of the new generation, the replacement included (one collective call): the
    recovery ladder (:func:`~colonnade.checkpoint.recovery.recover`: own memory snapshot,
    the partner's copy, the disk checkpoint) with memory snapshots, else the latest checkpoint
    under ``checkpoint.save``, into the live trainer (parameters, optimizer state, step,
    sampler, RNG, scaler); then this rank tells the supervisor it is ready. Returns a line for
    the log. Raises :class:`RejoinError` when there is nothing to restore."""
    save = trainer.config.checkpoint.save
    disk = latest_checkpoint(save)
    snapshots = getattr(trainer, "snapshots", None)
    if snapshots is not None:
        recovery = recover(trainer, snapshots, Path(save) if disk is not None else None)
        if "none" in recovery.sources:
            raise RejoinError(f"rank {member.rank}: nothing to restore in process "
                              f"({recovery.describe()})")
        note = recovery.describe()
    elif disk is None:
        raise RejoinError(f"rank {member.rank}: nothing to restore in process (no committed "
                          f"checkpoint under checkpoint.save={save} yet)")
    else:
        note = start_from(trainer, save)
    member.mark_ready()
    return note


def rejoin(trainer: Any, member: Membership, reason: str, monitor: RankMonitor | None) -> str:
    """A collective of this rank failed (``reason``, its message) because a peer died: leave
    the groups (the snapshot group too, after its exchange in flight has ended), join the next
    generation, adopt its groups in place, restore. Returns a line for the log. Call it
    outside the ``except`` block, with the exception and its traceback dropped: their frames
    hold the failed step's handles, hence the broken groups."""
    member.rejoined_at = time.perf_counter()
    step = trainer.step
    snapshots = getattr(trainer, "snapshots", None)
    trainer.ddp.abandon_step()
    member.leave(trainer.groups, [snapshots.group] if snapshots is not None else [],
                 drain=snapshots.wait if snapshots is not None else None)

    def beat() -> None:
        if monitor is not None:
            monitor.beat(step, trainer.groups.stats, phase="rejoin")

    g = member.wait_next(beat)
    member.init()
    trainer.groups.adopt(build_groups(trainer.config, member.world))
    if snapshots is not None:  # made in the same order as the replacement makes it
        fresh = trainer.groups.host_world("snapshot", trainer.config.parallel.timeout_s)
        snapshots.group.rebind(fresh.pg)
    note = restore(trainer, member)
    reason = " ".join(reason.split())[:160]
    return (f"in-process restart: rank {member.rank} rejoined as generation {g} after "
            f"'{reason}'; {note}")


def after_step(member: Membership | None, step: int, is_logger: bool) -> None:
    """After a completed step: the first one since a rejoin prints the time from the failure
    to it (rank 0)."""
    if member is None or member.rejoined_at is None:
        return
    seconds = time.perf_counter() - member.rejoined_at
    member.rejoined_at = None
    if is_logger:
        print(f"colonnade: step {step} completed {seconds:.2f} s after the failure "
              f"(generation {member.generation})", flush=True)
