"""The validator's recovery checks (part of the 'reliability' rule of
:mod:`colonnade.config.validate`): memory snapshots and the in-process restart."""

from __future__ import annotations

from colonnade.config.sections import CheckpointConfig


def recovery_problems(ck: CheckpointConfig) -> list[str]:
    """checkpoint.memory_interval >= 0, a non-empty memory_dir, and an in-process restart with
    something to restore from (memory snapshots, or periodic disk checkpoints)."""
    out: list[str] = []
    if ck.memory_interval < 0:
        out.append(f"checkpoint.memory_interval={ck.memory_interval} must be >= 0 "
                   "(0: no memory snapshots; 1: a snapshot every step).")
    if not ck.memory_dir.strip():
        out.append("checkpoint.memory_dir is empty; give a node-local directory (tmpfs) or "
                   "'auto' (/dev/shm/colonnade/...).")
    if ck.restart == "in-process" and ck.memory_interval < 1 and (not ck.save
                                                                    or ck.interval < 1):
        out.append(f"checkpoint.restart='in-process' needs a state to restore after a "
                   f"failure (checkpoint.memory_interval={ck.memory_interval}, "
                   f"checkpoint.save={ck.save}, checkpoint.interval={ck.interval}): set "
                   "--checkpoint.memory_interval=1 (memory snapshots, recommended) or "
                   "--checkpoint.interval=N (N > 0) with checkpoint.save unset or a directory, "
                   "or use --checkpoint.restart=job.")
    return out
