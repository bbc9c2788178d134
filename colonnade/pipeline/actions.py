"""Pipeline actions: the instructions an executor runs, one list per pp stage.

A schedule is pure data: for every pp stage (rank) an ordered list of `Action`s. Compute actions
are F (forward), B (backward: input grad, plus the weight grad unless the schedule splits W) and
W (weight grad only, zero-bubble schedules). Communication actions move one micro-batch's
activation (direction "F") or activation gradient (direction "B") between neighbouring stages.

Virtual stages: with pp stages and vp chunks per stage, a *placement* says which virtual stage
chunk c of stage s holds. Activations flow v -> v + 1, gradients v -> v - 1, and the last
virtual stage (v = pp vp - 1) computes the loss.

* "loop" (Megatron's interleaving, every schedule but zbv): v = c * pp + s. A forward message
  always goes from stage s to stage (s + 1) % pp and a backward message from s to (s - 1) % pp.
* "v" (ZB-V, vp = 2): chunk 0 of stage s is v = s, chunk 1 is v = 2 pp - 1 - s, so the
  virtual stages run down the stages and back up: stage 0 holds the first and the last one.
  Chunk 0 sends forward to s + 1, chunk 1 to s - 1; at the turn (v = pp - 1 -> pp) the
  message stays on stage pp - 1 (a *local* message: sender and receiver are the same stage,
  handed over without p2p).

A communication action carries the micro-batch and the *local* chunk of the compute it feeds
(RECV_F before F, RECV_B before B) or comes from (SEND_F after F, SEND_B after B), plus its peer
stage. Sends are asynchronous (post and continue), receives block; messages on each directed pair
of stages and direction are delivered in FIFO order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from colonnade.models.stages import PLACEMENTS, locate, virtual_stage

__all__ = ["PLACEMENTS", "Action", "Kind", "ScheduleError", "comm", "compute", "format_schedule",
           "locate", "peer_of", "virtual_stage"]


class ScheduleError(ValueError):
    """An invalid schedule request, or a schedule that violates a pipeline invariant."""


class Kind(StrEnum):
    """What an action does. Compute kinds: F, B, W; communication kinds: the other four."""

    F = "F"
    B = "B"
    W = "W"
    RECV_F = "RECV_F"
    SEND_F = "SEND_F"
    RECV_B = "RECV_B"
    SEND_B = "SEND_B"


COMPUTE_KINDS: frozenset[Kind] = frozenset({Kind.F, Kind.B, Kind.W})
SEND_KINDS: frozenset[Kind] = frozenset({Kind.SEND_F, Kind.SEND_B})
RECV_KINDS: frozenset[Kind] = frozenset({Kind.RECV_F, Kind.RECV_B})

_SHORT: dict[Kind, str] = {
    Kind.F: "F",
    Kind.B: "B",
    Kind.W: "W",
    Kind.RECV_F: "rF",
    Kind.SEND_F: "sF",
    Kind.RECV_B: "rB",
    Kind.SEND_B: "sB",
}


def peer_of(kind: Kind, stage: int, pp: int, chunk: int = 0, placement: str = "loop") -> int:
    """Peer stage of a communication action of ``kind`` posted on ``stage`` for local ``chunk``.

    Forward traffic goes to the stage of virtual stage v + 1 and comes from that of v - 1;
    backward traffic the other way round. Under "loop" that is (s + 1) % pp and (s - 1) % pp
    whatever the chunk (the wrap-around links stage pp - 1, chunk c, to stage 0, chunk c + 1);
    under "v" the direction flips for chunk 1 and the turn is the stage itself.
    """
    if kind not in (Kind.SEND_F, Kind.RECV_B, Kind.RECV_F, Kind.SEND_B):
        raise ScheduleError(f"{kind.value} is a compute action and has no peer stage")
    step = 1 if kind in (Kind.SEND_F, Kind.RECV_B) else -1
    if placement == "loop":
        return (stage + step) % pp
    return locate(virtual_stage(stage, chunk, pp, placement) + step, pp, placement)[0]


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule.

    Attributes:
        kind: what to do (`Kind`).
        microbatch: micro-batch index in [0, m).
        chunk: local virtual chunk index in [0, vp) of the compute this action is or serves.
        peer: for communication actions the other stage (see `peer_of`); None for compute.
    """

    kind: Kind
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))
        if self.microbatch < 0 or self.chunk < 0:
            raise ScheduleError(f"{self}: microbatch and chunk must be >= 0")
        if self.is_compute and self.peer is not None:
            raise ScheduleError(f"{self.kind.value} is a compute action and takes no peer")
        if self.is_comm and (self.peer is None or self.peer < 0):
            raise ScheduleError(f"{self.kind.value} needs a peer stage >= 0, got {self.peer}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_KINDS

    @property
    def direction(self) -> str:
        """Message direction: "F" (activations: RECV_F/SEND_F), "B" (gradients: RECV_B/SEND_B)."""
        if self.is_compute:
            raise ScheduleError(f"{self}: compute actions have no message direction")
        return "F" if self.kind in (Kind.RECV_F, Kind.SEND_F) else "B"

    @property
    def peer_stage(self) -> int:
        """The stage this communication action talks to (raises for compute actions)."""
        if self.peer is None:
            raise ScheduleError(f"{self}: compute actions have no peer stage")
        return self.peer

    def __str__(self) -> str:
        text = f"{_SHORT[self.kind]}{self.microbatch}c{self.chunk}"
        if self.is_send:
            return f"{text}>{self.peer}"
        if self.is_recv:
            return f"{text}<{self.peer}"
        return text


def compute(kind: Kind, microbatch: int, chunk: int = 0) -> Action:
    """A compute action F, B or W."""
    if kind not in COMPUTE_KINDS:
        raise ScheduleError(f"{kind.value} is not a compute kind (F, B, W)")
    return Action(kind, microbatch, chunk)


def comm(kind: Kind, microbatch: int, chunk: int, stage: int, pp: int,
         placement: str = "loop") -> Action:
    """A communication action posted on `stage`, its peer derived with `peer_of`."""
    return Action(kind, microbatch, chunk, peer_of(kind, stage, pp, chunk, placement))


def format_schedule(lists: Sequence[Sequence[Action]], compute_only: bool = False) -> str:
    """A table with one row per stage: `stage s | F0c0 sF0c0>1 ...`, columns aligned.

    With `compute_only` the communication actions are left out, so that columns line up with
    compute slots and the 1F1B / interleaving pattern is easy to read.
    """
    rows = [[str(a) for a in actions if not (compute_only and a.is_comm)] for actions in lists]
    ncols = max((len(r) for r in rows), default=0)
    widths = [max((len(r[i]) for r in rows if i < len(r)), default=0) for i in range(ncols)]
    label = len(f"stage {len(lists) - 1}") if lists else 0
    lines = []
    for s, row in enumerate(rows):
        cells = " ".join(cell.ljust(widths[i]) for i, cell in enumerate(row))
        lines.append(f"{f'stage {s}'.ljust(label)} | {cells}".rstrip())
    return "\n".join(lines)
