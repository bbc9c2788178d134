"""In-memory snapshots of the training state, replicated to a partner rank.

Every ``checkpoint.memory_interval`` steps each rank writes its snapshot
(:mod:`.snapshot_state`) as one safetensors file (no pickle; the JSON header in the file's
``__metadata__``) into ``checkpoint.memory_dir`` (node-local RAM: tmpfs), and sends the same
bytes to its partner (:func:`partner_of`), which keeps them as a *peer* file in its own
memory_dir. Files are written atomically (``.tmp`` then rename) and the previous step's files
are removed only once *every* rank holds the new step's own and peer copies (a barrier on the
snapshot group, in the background thread), so at every instant one step (the previous or the
new) is held whole on every rank, by itself and by its partner: a node lost in the middle of an
exchange still leaves each rank's state in its own memory or its partner's. In steady state a
rank's memory_dir share holds one own copy and one peer copy (of its source's state): the
memory cost per rank is ``own_bytes(r) + own_bytes(source(r))`` (:func:`memory_cost`, plus a
few KiB of headers), twice that at the peak of an exchange (the previous step's copies kept
until the barrier); the traffic ``own_bytes(r) / memory_interval`` per step each way.

The training thread only stages host copies (:class:`~colonnade.checkpoint.staging.
HostStager`: clones on CPU; pinned buffers and a side stream on a GPU); a background thread
serialises, writes the own file, and exchanges the bytes with the partner and the source on a
dedicated gloo group (:meth:`ProcessGroups.host_world`, never a training group from two
threads; host tensors, so NCCL's device-only communicators are not involved), overlapped with
the next step. The next snapshot waits for it (its errors re-raised there).

File names: ``rank<R>.step<S>.own.safetensors`` (rank R's state at step S, on R's node) and
``rank<R>.step<S>.peer-on<H>.safetensors`` (a copy of it held by rank H = partner(R)).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch as st
import torch

from colonnade.checkpoint.format import Entry
from colonnade.checkpoint.pieces import Piece
from colonnade.checkpoint.snapshot_state import (
    layout_fingerprint,
    state_bytes,
    state_header,
    state_tensors,
)
from colonnade.checkpoint.staging import HostStager
from colonnade.checkpoint.state import TrainState
from colonnade.config.sections import Config
from colonnade.parallel.comm import CommGroup

SUFFIX = ".safetensors"


def partner_of(rank: int, world: int, per_node: int) -> int:
    """The rank holding ``rank``'s peer copy: the same local rank on the next node (several
    nodes, ``per_node`` ranks each), else the next rank; ``rank`` itself for a world of one."""
    step = per_node if world > per_node else 1
    return (rank + step) % world


def source_of(rank: int, world: int, per_node: int) -> int:
    """The rank whose peer copy ``rank`` holds (the inverse of :func:`partner_of`)."""
    step = per_node if world > per_node else 1
    return (rank - step) % world


def memory_cost(own_bytes: list[int], per_node: int) -> list[int]:
    """Host bytes of snapshot tensors each rank holds in steady state: its own snapshot plus
    the peer copy of its source's (``own_bytes[r]``: rank r's :func:`state_bytes`)."""
    world = len(own_bytes)
    if world == 1:
        return list(own_bytes)
    return [own_bytes[r] + own_bytes[source_of(r, world, per_node)] for r in range(world)]


def default_memory_dir(config: Config) -> Path:
    """``checkpoint.memory_dir='auto'``: /dev/shm/colonnade/<hash of checkpoint.save and
    logging.dir> (the temp directory where /dev/shm does not exist)."""
    key = f"{config.checkpoint.save}|{Path(config.logging.dir).resolve()}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else Path(tempfile.gettempdir())
    return base / "colonnade" / digest


def memory_dir_of(config: Config) -> Path:
    """Where this run's snapshots live (``checkpoint.memory_dir``, 'auto' resolved)."""
    md = config.checkpoint.memory_dir
    return default_memory_dir(config) if md == "auto" else Path(md)


def own_name(rank: int, step: int) -> str:
    """File name of rank ``rank``'s own snapshot at ``step``."""
    return f"rank{rank:05d}.step{step:09d}.own{SUFFIX}"


def peer_name(owner: int, step: int, holder: int) -> str:
    """File name of the copy of ``owner``'s snapshot at ``step`` held by ``holder``."""
    return f"rank{owner:05d}.step{step:09d}.peer-on{holder:05d}{SUFFIX}"


def encode(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> bytes:
    """A snapshot as safetensors bytes, ``header`` as JSON in its metadata."""
    flat = {k: t.contiguous() for k, t in tensors.items()}
    return st.save(flat, metadata={"colonnade": json.dumps(header)})


def read_header(data: bytes | Path) -> dict[str, Any]:
    """The JSON header of a snapshot (bytes, or a file of which only the header is read)."""
    if isinstance(data, Path):
        with data.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            raw = fh.read(n)
    else:
        (n,) = struct.unpack("<Q", data[:8])
        raw = data[8:8 + n]
    meta = json.loads(raw).get("__metadata__") or {}
    return json.loads(meta["colonnade"])


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, header) of snapshot bytes."""
    return st.load(data), read_header(data)


def payload_bytes(path: Path) -> int:
    """Tensor bytes of a snapshot file (its size without the safetensors header)."""
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    return path.stat().st_size - 8 - n


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Held:
    """A snapshot file this rank holds: whose state, which step, its size in bytes."""

    owner: int
    step: int
    nbytes: int
    path: Path
    peer: bool


class MemorySnapshots:
    """This rank's memory snapshots: taking them (:meth:`snapshot`) and listing what it holds
    for the recovery (:meth:`holdings`)."""

    def __init__(self, directory: Path, group: CommGroup, per_node: int, interval: int,
                 fingerprint: str, run_id: str, stager: HostStager | None = None) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.group = group
        """The gloo group of every rank used only for snapshot traffic."""
        self.rank, self.world = max(group.rank, 0), group.size
        self.partner = partner_of(self.rank, self.world, per_node)
        self.source = source_of(self.rank, self.world, per_node)
        self.per_node, self.interval = per_node, interval
        self.fingerprint, self.run_id = fingerprint, run_id
        self.stager = stager or HostStager()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []
        self.last_step: int | None = None
        """Step of the newest snapshot whose own file and exchange are complete."""
        self._older: list[Path] = [h.path for h in self.holdings(check=False)]
        """This rank's files to remove once the next snapshot is complete (no directory scan
        per step): the previous snapshot's, and at first what an earlier attempt left."""

    @classmethod
    def create(cls, trainer: TrainState, run_id: str, per_node: int) -> MemorySnapshots:
        """The snapshots of ``trainer``'s run (collective: makes the snapshot group)."""
        cfg = trainer.config
        group = trainer.groups.host_world("snapshot", cfg.parallel.timeout_s)
        return cls(memory_dir_of(cfg), group, per_node, cfg.checkpoint.memory_interval,
                   layout_fingerprint(cfg, trainer.groups.world.size), run_id)

    # ------------------------------------------------------------------ taking snapshots

    def due(self, step: int) -> bool:
        """Whether a snapshot is taken after ``step`` steps."""
        return self.interval > 0 and step > 0 and step % self.interval == 0

    def snapshot(self, trainer: TrainState) -> bool:
        """At a step boundary: when due, stage this rank's state and hand it to the background
        thread (which writes the own file and exchanges copies); returns whether it did."""
        step = int(trainer.step)
        if not self.due(step):
            return False
        self.wait()
        live = state_tensors(trainer)
        entries = [Entry(k, t, Piece((0,), (t.numel(),)), (t.numel(),)) for k, t in live.items()]
        staged = self.stager.stage(entries, step)
        header = state_header(trainer, self.fingerprint, self.run_id)
        self._thread = threading.Thread(target=self._publish, args=(staged, header),
                                        name="colonnade-snapshot", daemon=True)
        self._thread.start()
        return True

    def _publish(self, staged: Any, header: dict[str, Any]) -> None:
        try:
            entries = self.stager.ready(staged)
            data = encode({e.name: e.tensor for e in entries}, header)
            self.stager.release(staged)  # encoded: the host buffers may take the next step's
            step = int(header["step"])
            written = [self.dir / own_name(self.rank, step)]
            write_atomic(written[0], data)
            if self.world > 1:
                got = self._exchange(data)
                written.append(self.dir / peer_name(self.source, step, self.rank))
                write_atomic(written[1], got)
            # the previous step's copies go only once every rank holds this step's (own and
            # peer): a rank that dies mid-exchange leaves the previous step whole everywhere
            self.group.barrier()
            for path in self._older:
                if path not in written:
                    path.unlink(missing_ok=True)
            self._older = written
            self.last_step = step
        except BaseException as err:  # re-raised by wait()
            self._errors.append(err)

    def _exchange(self, data: bytes) -> bytes:
        """Send ``data`` to the partner and receive the source's snapshot bytes (two p2p
        rounds on the snapshot group: the sizes, then the bytes)."""
        size = torch.tensor([len(data)], dtype=torch.int64)
        theirs = torch.zeros(1, dtype=torch.int64)
        self.group.p2p([(size, self.partner)], [(theirs, self.source)], name="size").wait()
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        got = torch.empty(int(theirs.item()), dtype=torch.uint8)
        self.group.p2p([(mine, self.partner)], [(got, self.source)], name="snapshot").wait()
        return got.numpy().tobytes()

    def wait(self) -> None:
        """Block until the snapshot in flight is written and exchanged; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._errors:
            err, self._errors = self._errors[0], []
            raise err

    # ------------------------------------------------------------------ what is held

    def holdings(self, check: bool = True) -> list[Held]:
        """The complete snapshot files this rank holds: its own, and the peer copies it keeps
        (``peer-on<this rank>``). ``check``: only those of this run and layout (header's
        run id and fingerprint)."""
        out = []
        for path in sorted(self.dir.glob(f"rank*.step*{SUFFIX}")):
            parts = path.name[:-len(SUFFIX)].split(".")
            if len(parts) != 3:
                continue
            owner, step, kind = int(parts[0][4:]), int(parts[1][4:]), parts[2]
            peer = kind == f"peer-on{self.rank:05d}"
            if not (peer or (kind == "own" and owner == self.rank)):
                continue
            if check:
                try:
                    head = read_header(path)
                except (OSError, ValueError, KeyError, struct.error):
                    continue
                if head.get("run_id") != self.run_id or head.get("fingerprint") != (
                        self.fingerprint):
                    continue
            out.append(Held(owner, step, path.stat().st_size, path, peer))
        return out

    def clear(self) -> int:
        """Remove every snapshot file this rank holds (of any run); returns how many."""
        held = self.holdings(check=False)
        for h in held:
            h.path.unlink(missing_ok=True)
        self._older = []
        return len(held)

    def close(self) -> None:
        """At the end of a run: finish the snapshot in flight."""
        self.wait()


def own_bytes_all(snapshots: MemorySnapshots, trainer: TrainState) -> list[int]:
    """Every rank's snapshot tensor bytes (collective on the snapshot group)."""
    return [int(b) for b in snapshots.group.all_gather_object(state_bytes(trainer))]


