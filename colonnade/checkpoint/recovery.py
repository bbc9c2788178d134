"""The recovery ladder: a rank's own memory snapshot, its partner's copy of it, the disk.

:func:`recover` runs on every rank at the start of a restarted job (or after an in-process
rejoin). Every rank lists the snapshots it holds (its own, and the peer copies it keeps for its
source, :meth:`MemorySnapshots.holdings`); the lists are all-gathered and every rank computes
the same answer (:func:`newest_common_step`): the newest step S at which each rank r's state is
held by r itself or by partner(r). When S is newer than the disk checkpoint, each rank restores
from its own file, or receives the bytes from its partner (p2p on the snapshot group), and no
disk is read; otherwise every rank loads the disk checkpoint (:func:`load_training`) and the log
says why ("rank 3's snapshot and its copy on rank 0 are both gone: ...").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from colonnade.checkpoint.memory import Held, MemorySnapshots, decode, partner_of
from colonnade.checkpoint.snapshot_state import apply_state
from colonnade.checkpoint.state import TrainState

SOURCES = ("memory", "peer", "disk", "none")
"""Where a rank's state came from: its own snapshot, its partner's copy, the disk
checkpoint, nowhere (a fresh start)."""


@dataclass
class Recovery:
    """What :func:`recover` did."""

    step: int
    """The step the run continues from (0: nothing was restored)."""
    sources: list[str]
    """Per rank, one of :data:`SOURCES`."""
    bytes_moved: int = 0
    """Snapshot bytes sent from partners to the ranks that lost theirs (all ranks' total)."""
    seconds: float = 0.0
    """Wall time of the recovery on this rank."""
    reason: str = ""
    """Why the disk (or nothing) was used instead of memory, '' when memory was."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The disk checkpoint's metadata when it was loaded (its notes), else empty."""

    def describe(self) -> str:
        """One log line."""
        if "disk" in self.sources or "none" in self.sources:
            where = "disk" if "disk" in self.sources else "scratch"
            return (f"recovered from {where} at step {self.step} in {self.seconds:.2f} s"
                    + (f": {self.reason}" if self.reason else ""))
        peers = [r for r, s in enumerate(self.sources) if s == "peer"]
        via = (f"; rank(s) {', '.join(map(str, peers))} from their partner's copy "
               f"({self.bytes_moved / 2**20:.1f} MiB moved)" if peers else "")
        return (f"recovered from memory at step {self.step} in {self.seconds:.2f} s (ranks' own "
                f"snapshots{via}; no disk read)")


Listing = dict[str, Any]
"""One rank's holdings as all-gathered: {"own": {step: nbytes}, "peer": {step: nbytes}}
(peer: copies of its source's state)."""


def listing_of(held: list[Held]) -> Listing:
    """The all-gathered form of one rank's holdings."""
    return {"own": {h.step: h.nbytes for h in held if not h.peer},
            "peer": {h.step: h.nbytes for h in held if h.peer}}


def newest_common_step(listings: list[Listing], partners: list[int]
                       ) -> tuple[int | None, list[str], str]:
    """(S, per-rank source 'memory' | 'peer', why) for the newest step S at which every rank r
    is held by itself or by ``partners[r]`` (whose peer files are r's); (None, [], why) when
    no step is, ``why`` naming the ranks that miss the newest step any rank holds."""
    world = len(listings)
    steps = sorted({s for item in listings for s in (*item["own"], *item["peer"])},
                   reverse=True)
    why = ""
    for step in steps:
        sources, lost = [], []
        for r in range(world):
            if step in listings[r]["own"]:
                sources.append("memory")
            elif world > 1 and step in listings[partners[r]]["peer"]:
                sources.append("peer")
            else:
                lost.append(r)
        if not lost:
            return step, sources, why
        if not why:
            why = "; ".join(f"rank {r}'s snapshot of step {step} and its copy on rank "
                            f"{partners[r]} are both gone" for r in lost)
    return None, [], why or ("no memory snapshot of this run and layout is held (a snapshot "
                             "restores only into the run and layout that took it)")


def recover(trainer: TrainState, snapshots: MemorySnapshots, disk: Path | None) -> Recovery:
    """Restore ``trainer`` by the ladder (collective over every rank; see the module doc).

    ``disk``: the disk checkpoint to fall back to (a save directory or step directory), None
    when there is none (then a rank without a memory snapshot starts from scratch)."""
    from colonnade.checkpoint.training_state import load_training, read_metadata

    start = time.perf_counter()
    group, world = snapshots.group, snapshots.world
    held = snapshots.holdings()
    listings = group.all_gather_object(listing_of(held))
    partners = [partner_of(r, world, snapshots.per_node) for r in range(world)]
    step, sources, why = newest_common_step(listings, partners)
    disk_step = int(read_metadata(disk)["step"]) if disk is not None else None
    if step is not None and disk_step is not None and step <= disk_step:
        why = f"the disk checkpoint (step {disk_step}) is as new as memory (step {step})"
        step = None
    if step is None:
        if disk is None:
            return Recovery(0, ["none"] * world, seconds=time.perf_counter() - start,
                            reason=f"{why}; no disk checkpoint: starting from scratch")
        meta = load_training(trainer, disk)
        return Recovery(int(meta["step"]), ["disk"] * world,
                        seconds=time.perf_counter() - start,
                        reason=f"{why}: falling back to disk step {meta['step']}", meta=meta)
    moved = _restore(trainer, snapshots, held, listings, partners, step, sources)
    return Recovery(step, sources, moved, time.perf_counter() - start)


def _restore(trainer: TrainState, snapshots: MemorySnapshots, held: list[Held],
             listings: list[Listing], partners: list[int], step: int,
             sources: list[str]) -> int:
    """Every rank applies its state at ``step``: from its own file, or from bytes its
    partner sends (one p2p round on the snapshot group). Returns the bytes moved (all ranks)."""
    me = snapshots.rank
    sends: list[tuple[torch.Tensor, int]] = []
    recvs: list[tuple[torch.Tensor, int]] = []
    mine: bytes | None = None
    if sources[me] == "memory":
        mine = next(h for h in held if not h.peer and h.step == step).path.read_bytes()
    src = snapshots.source
    if snapshots.world > 1 and sources[src] == "peer":  # I hold src's copy: send it
        path = next(h for h in held if h.peer and h.step == step).path
        sends.append((torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8),
                      src))
    got: torch.Tensor | None = None
    if sources[me] == "peer":
        got = torch.empty(int(listings[partners[me]]["peer"][step]), dtype=torch.uint8)
        recvs.append((got, partners[me]))
    snapshots.group.p2p(sends, recvs, name="recover").wait()
    if got is not None:
        mine = got.numpy().tobytes()
    assert mine is not None
    tensors, header = decode(mine)
    apply_state(trainer, tensors, header)
    return sum(int(listings[partners[r]]["peer"][step])
               for r in range(snapshots.world) if sources[r] == "peer")
