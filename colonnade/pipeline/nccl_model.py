"""NCCL's point-to-point semantics, modelled without a GPU.

NCCL runs a rank's p2p operations in order on one stream: a batched group (``batch_isend_irecv``)
starts only when every earlier group of that rank has completed, and completes only when every
operation in it has matched. On each directed (src, dst) channel the k-th send matches the k-th
receive (NCCL ignores tags). An operation matches when its group and its counterpart's group are
both at the head of their ranks' streams. Gloo's independent receives hide orderings that NCCL
cannot complete; this model finds them.

`executor_groups` takes each rank's groups from :func:`colonnade.pipeline.p2p.p2p_program`, the
code the executor (:class:`~colonnade.pipeline.p2p.PipeComm`) posts, in posting order.
`run_groups` replays the groups of all ranks and raises `ScheduleError` naming the stuck ranks
and groups on a deadlock. It also checks what the posting relies on beyond the stream order: a
group is posted only after the computes before its point, so every receive those computes
consume must sit in an earlier group (else the rank would wait on itself).
"""

from __future__ import annotations

from collections.abc import Sequence

from colonnade.pipeline.actions import Action, ScheduleError
from colonnade.pipeline.p2p import Group, Op, StageProgram, p2p_program

Slot = tuple[int, str, int, int]  # (rank, kind, peer, k-th op of that kind on the channel)

__all__ = ["Group", "Op", "check_nccl", "executor_groups", "run_groups"]


def _check_points(program: StageProgram) -> None:
    """Each receive is consumed after the point its group is posted at (module docstring)."""
    for point, groups in enumerate(program.posts):
        for group in groups:
            for op in group:
                if op.kind == "recv" and program.consumer_point(op) < point:
                    raise ScheduleError(f"stage {program.stage}: {op} is consumed at compute "
                                        f"{program.consumer_point(op)} but posted at {point}")


def executor_groups(lists: Sequence[Sequence[Action]], overlap: bool,
                    placement: str = "loop") -> list[list[Group]]:
    """Per stage, the ordered p2p groups the executor posts for ``lists`` (in ``placement``;
    local messages take no p2p operation)."""
    programs = p2p_program(tuple(tuple(a) for a in lists), overlap, placement)
    for program in programs:
        _check_points(program)
    return [program.groups for program in programs]


def _channel_index(groups: Sequence[Sequence[Group]]) -> dict[Slot, tuple[int, int]]:
    """(rank, kind, peer, k) -> (group index, op index) for the k-th op of a kind on a channel."""
    index: dict[Slot, tuple[int, int]] = {}
    for rank, rank_groups in enumerate(groups):
        count: dict[tuple[str, int], int] = {}
        for g, group in enumerate(rank_groups):
            for o, op in enumerate(group):
                k = count.get((op.kind, op.peer), 0)
                count[(op.kind, op.peer)] = k + 1
                index[(rank, op.kind, op.peer, k)] = (g, o)
    return index


def _counterparts(groups: Sequence[Sequence[Group]]) -> dict[tuple[int, int, int], tuple[int, int]]:
    """(rank, group, op) -> (peer rank, peer group index) of the matching op; checks payloads."""
    index = _channel_index(groups)
    out: dict[tuple[int, int, int], tuple[int, int]] = {}
    for (rank, kind, peer, k), (g, o) in index.items():
        other = "recv" if kind == "send" else "send"
        if (peer, other, rank, k) not in index:
            raise ScheduleError(f"rank {rank}: {groups[rank][g][o]} (#{k} on its channel) has no "
                                f"matching {other} on rank {peer}")
        pg, po = index[(peer, other, rank, k)]
        if groups[peer][pg][po].msg != groups[rank][g][o].msg:
            raise ScheduleError(f"rank {rank} {groups[rank][g][o]} would match rank {peer} "
                                f"{groups[peer][pg][po]}: different messages")
        out[(rank, g, o)] = (peer, pg)
    return out


def run_groups(groups: Sequence[Sequence[Group]]) -> int:
    """Replay every rank's groups under NCCL's in-order semantics; returns the number of rounds.

    Raises `ScheduleError` naming each stuck rank, its head group and its unmatched ops.
    """
    match = _counterparts(groups)
    head = [0] * len(groups)
    done: set[tuple[int, int, int]] = set()
    rounds = 0
    while True:
        progress = False
        for rank, rank_groups in enumerate(groups):
            if head[rank] >= len(rank_groups):
                continue
            g = head[rank]
            for o in range(len(rank_groups[g])):
                peer, pg = match[(rank, g, o)]
                if head[peer] == pg:
                    done.add((rank, g, o))
        for rank, rank_groups in enumerate(groups):
            g = head[rank]
            if g < len(rank_groups) and all((rank, g, o) in done
                                            for o in range(len(rank_groups[g]))):
                head[rank] += 1
                progress = True
        if not progress:
            break
        rounds += 1
    stuck = [r for r, gs in enumerate(groups) if head[r] < len(gs)]
    if stuck:
        lines = []
        for r in stuck:
            g = head[r]
            waiting = [f"{op} (peer at group {head[op.peer]}, needs {match[(r, g, o)][1]})"
                       for o, op in enumerate(groups[r][g]) if (r, g, o) not in done]
            lines.append(f"rank {r} group {g}/{len(groups[r])} waits on: " + "; ".join(waiting))
        raise ScheduleError("NCCL p2p deadlock (in-order stream per rank):\n" + "\n".join(lines))
    return rounds


def check_nccl(lists: Sequence[Sequence[Action]], overlap: bool,
               placement: str = "loop") -> int:
    """Prove the executor's posting for ``lists`` (in ``placement``) completes under NCCL;
    returns the rounds taken."""
    return run_groups(executor_groups(lists, overlap, placement))
