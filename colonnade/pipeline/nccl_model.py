"""NCCL's point-to-point semantics, modelled without a GPU.

NCCL runs a rank's p2p operations in order on one stream: a batched group (``batch_isend_irecv``)
starts only when every earlier group of that rank has completed, and completes only when every
operation in it has matched. On each directed (src, dst) channel the k-th send matches the k-th
receive (NCCL ignores tags). An operation matches when its group and its counterpart's group are
both at the head of their ranks' streams. Gloo's independent receives hide orderings that NCCL
cannot complete; this model finds them.

`executor_groups` derives each rank's groups from the executor's own batching
(:func:`colonnade.pipeline.p2p.post_plan` and :class:`~colonnade.pipeline.p2p.RecvOrder`, the
code :class:`~colonnade.pipeline.p2p.PipeComm` runs), as posted when the backend is NCCL: one
group per ``post`` call with its sends and receives. `run_groups` replays the groups of all ranks
and raises `ScheduleError` naming the stuck ranks and groups on a deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from colonnade.pipeline.actions import Action, ScheduleError
from colonnade.pipeline.p2p import Message, RecvOrder, post_plan, received_message


@dataclass(frozen=True)
class Op:
    """One p2p operation of a rank: ``send`` to or ``recv`` from ``peer`` carrying ``msg``."""

    kind: str
    peer: int
    msg: Message

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        m = self.msg
        return f"{self.kind}{arrow}{self.peer} {m.direction}{m.microbatch}.{m.chunk}"


Group = tuple[Op, ...]
Slot = tuple[int, str, int, int]  # (rank, kind, peer, k-th op of that kind on the channel)


def executor_groups(lists: Sequence[Sequence[Action]], overlap: bool) -> list[list[Group]]:
    """Per stage, the ordered p2p groups the executor posts under NCCL for ``lists``."""
    pp = len(lists)
    out: list[list[Group]] = []
    for stage, actions in enumerate(lists):
        order = RecvOrder(lists, stage)
        groups: list[Group] = []
        for post in post_plan(actions, overlap):
            ops = [Op("send", *received_message(a, stage, pp)) for a in post.sends]
            ops += [Op("recv", peer, msg) for msg, peer in order.take(post.recvs)]
            if ops:
                groups.append(tuple(ops))
        left = order.unposted()
        if left:
            raise ScheduleError(f"stage {stage}: receives never posted {left}")
        out.append(groups)
    return out


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


def check_nccl(lists: Sequence[Sequence[Action]], overlap: bool) -> int:
    """Prove the executor's posting for ``lists`` completes under NCCL; returns rounds taken."""
    return run_groups(executor_groups(lists, overlap))
