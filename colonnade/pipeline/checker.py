"""Prove a pipeline schedule correct without processes.

`check_schedule(lists, pp, vp, m)` verifies, in this order, and raises `ScheduleError` with a
precise description of the first violation:
1. shape: pp lists, micro-batch in [0, m), chunk in [0, vp), each comm action's peer is the
   neighbour `peer_of` derives for the placement (loop: forward traffic to s + 1, backward to
   s - 1, modulo pp; v: chunk 1 the other way, the turn local);
2. completeness, per stage: exactly one F and one B of every (micro-batch, chunk), and exactly
   one W if the schedule splits the backward (any W anywhere); B after its F, W after its B;
3. FIFO matching and deadlock freedom: all stages are replayed together with asynchronous sends
   and blocking receives (`simulate.replay`); the k-th receive on each directed pair and direction
   must get the k-th send, carrying the same micro-batch from the adjacent virtual stage; a stuck
   replay reports where every stage is blocked; a message never received is an error;
4. dependencies, per stage: F of virtual stage v > 0 is preceded by exactly one RECV_F of its
   (micro-batch, chunk) (which step 3 matched to the SEND_F of v - 1), F of v < last is followed
   by exactly one SEND_F; B of v < last is preceded by its RECV_B, B of v > 0 followed by its
   SEND_B; no other communication actions.
Memory: in-flight chunk-activations on a stage = F done and B not done (+1 at F, -1 at B).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from colonnade.pipeline.actions import Action, Kind, ScheduleError, peer_of, virtual_stage
from colonnade.pipeline.simulate import replay

Item = tuple[int, int]  # (microbatch, chunk)


@dataclass(frozen=True)
class ScheduleReport:
    """What `check_schedule` proved. Tuples are indexed by stage."""

    pp: int
    vp: int
    microbatches: int
    splits_w: bool
    num_actions: tuple[int, ...]
    num_compute: tuple[int, ...]
    peak_in_flight: tuple[int, ...]
    peak_pending_w: tuple[int, ...]

    @property
    def total_actions(self) -> int:
        return sum(self.num_actions)


def _check_shape(lists: Sequence[Sequence[Action]], pp: int, vp: int, m: int,
                 placement: str) -> None:
    if len(lists) != pp:
        raise ScheduleError(f"expected one action list per stage (pp={pp}), got {len(lists)}")
    for s, actions in enumerate(lists):
        for i, a in enumerate(actions):
            if not isinstance(a, Action):
                raise ScheduleError(f"stage {s} action #{i}: {a!r} is not an Action")
            if not (a.microbatch < m and a.chunk < vp):
                raise ScheduleError(
                    f"stage {s} action #{i} {a}: micro-batch must be < m={m} and chunk < vp={vp}"
                )
            want = peer_of(a.kind, s, pp, a.chunk, placement) if a.is_comm else None
            if a.is_comm and a.peer != want:
                raise ScheduleError(
                    f"stage {s} action #{i} {a}: peer must be stage {want} "
                    f"for {a.kind.value} with pp={pp}, got {a.peer}"
                )


def _positions(stage: int, actions: Sequence[Action], kind: Kind) -> dict[Item, int]:
    """Index of each (mb, chunk) of `kind` on the stage; raises on a duplicate."""
    pos: dict[Item, int] = {}
    for i, a in enumerate(actions):
        if a.kind == kind:
            item = (a.microbatch, a.chunk)
            if item in pos:
                raise ScheduleError(
                    f"stage {stage}: duplicated {a} at actions #{pos[item]} and #{i} "
                    f"(each {kind.value} must run exactly once)"
                )
            pos[item] = i
    return pos


def _check_compute(
    stage: int, actions: Sequence[Action], vp: int, m: int, splits_w: bool
) -> tuple[int, int]:
    """Completeness and local order; returns (peak in-flight, peak pending W)."""
    items = [(mb, c) for mb in range(m) for c in range(vp)]
    kinds = [Kind.F, Kind.B] + ([Kind.W] if splits_w else [])
    pos = {k: _positions(stage, actions, k) for k in kinds}
    if not splits_w and any(a.kind == Kind.W for a in actions):
        raise ScheduleError(f"stage {stage}: W actions present but the schedule does not split W")
    for kind in kinds:
        missing = [f"{kind.value}{mb}c{c}" for mb, c in items if (mb, c) not in pos[kind]]
        if missing:
            why = " (the schedule splits B and W)" if kind == Kind.W else ""
            raise ScheduleError(f"stage {stage}: missing {', '.join(missing[:8])}{why}")
    for earlier, later in pairwise(kinds):
        for mb, c in items:
            if pos[later][(mb, c)] < pos[earlier][(mb, c)]:
                raise ScheduleError(
                    f"stage {stage}: {later.value}{mb}c{c} (action #{pos[later][(mb, c)]}) runs "
                    f"before its {earlier.value}{mb}c{c} (action #{pos[earlier][(mb, c)]})"
                )
    in_flight = pending = peak_f = peak_w = 0
    for a in actions:
        in_flight += {Kind.F: 1, Kind.B: -1}.get(a.kind, 0)
        pending += {Kind.B: 1, Kind.W: -1}.get(a.kind, 0) if splits_w else 0
        peak_f, peak_w = max(peak_f, in_flight), max(peak_w, pending)
    return peak_f, peak_w


def _check_comm(stage: int, actions: Sequence[Action], pp: int, vp: int,
                placement: str) -> None:
    """Each F/B has exactly the receives before and sends after that its virtual stage needs."""
    last = pp * vp - 1
    # (comm kind, compute kind, needed(v), must come before the compute)
    rules = (
        (Kind.RECV_F, Kind.F, lambda v: v > 0, True),
        (Kind.SEND_F, Kind.F, lambda v: v < last, False),
        (Kind.RECV_B, Kind.B, lambda v: v < last, True),
        (Kind.SEND_B, Kind.B, lambda v: v > 0, False),
    )
    for comm_kind, kind, needed, before in rules:
        comm_pos = _positions(stage, actions, comm_kind)
        for item, i in _positions(stage, actions, kind).items():
            v = virtual_stage(stage, item[1], pp, placement)
            name = f"{kind.value}{item[0]}c{item[1]} (virtual stage {v}, action #{i})"
            if not needed(v):
                if item in comm_pos:
                    raise ScheduleError(f"stage {stage}: {name} must have no {comm_kind.value}")
                continue
            j = comm_pos.get(item)
            if j is None or (j > i if before else j < i):
                where = "before" if before else "after"
                raise ScheduleError(
                    f"stage {stage}: {name} needs its {comm_kind.value} {where} it"
                    + ("" if j is None else f", found at action #{j}")
                )


def check_schedule(lists: Sequence[Sequence[Action]], pp: int, vp: int, m: int,
                   placement: str = "loop") -> ScheduleReport:
    """Check completeness, dependencies, FIFO matching and deadlock freedom (module docstring)
    of lists in ``placement`` (:mod:`~colonnade.pipeline.actions`)."""
    _check_shape(lists, pp, vp, m, placement)
    splits_w = any(a.kind == Kind.W for actions in lists for a in actions)
    peaks = [_check_compute(s, actions, vp, m, splits_w) for s, actions in enumerate(lists)]
    replay(lists, lambda stage, a: 1.0, placement=placement)
    for s, actions in enumerate(lists):
        _check_comm(s, actions, pp, vp, placement)
    return ScheduleReport(
        pp=pp,
        vp=vp,
        microbatches=m,
        splits_w=splits_w,
        num_actions=tuple(len(a) for a in lists),
        num_compute=tuple(sum(x.is_compute for x in a) for a in lists),
        peak_in_flight=tuple(p[0] for p in peaks),
        peak_pending_w=tuple(p[1] for p in peaks),
    )
