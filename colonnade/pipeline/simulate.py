"""Event-driven replay of pipeline action lists: FIFO message matching, deadlock detection, timing.

Execution model (what an executor does): each stage runs its list in order; a send posts its
message and continues (it takes no time on the sender, the message arrives t_comm later); a
receive blocks until the next message on its channel (src stage, dst stage, direction) has
arrived, messages being matched in FIFO order. Compute durations: F -> t_f, W -> t_w,
B -> t_b on a stage that runs W actions (split backward), else t_b + t_w.

Per stage: busy = sum of compute durations, idle = makespan - busy,
bubble fraction = idle / makespan. :func:`one_stage_bound` is the least makespan that any
schedule with one stage per rank can reach on given stage times, whatever its order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from colonnade.pipeline.actions import (
    COMPUTE_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    Action,
    Kind,
    ScheduleError,
    virtual_stage,
)

Channel = tuple[int, int, str]  # (src stage, dst stage, "F" | "B")


@dataclass(frozen=True)
class TimedAction:
    """One executed action: `index` in its stage's list, [start, end] in time units."""

    stage: int
    index: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Timing of a schedule. Tuples are indexed by stage."""

    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    timeline: tuple[tuple[TimedAction, ...], ...]

    @property
    def max_bubble_fraction(self) -> float:
        return max(self.bubble_fraction)


def _check_payload(sent: Action, src: int, recv: Action, dst: int, pp: int, k: int,
                   placement: str) -> None:
    """The k-th message on a channel must be what the k-th receive expects (FIFO matching)."""
    step = 1 if recv.direction == "F" else -1
    v_sent = virtual_stage(src, sent.chunk, pp, placement)
    v_want = virtual_stage(dst, recv.chunk, pp, placement) - step
    if sent.microbatch != recv.microbatch or v_sent != v_want:
        raise ScheduleError(
            f"FIFO mismatch on channel {recv.direction} {src}->{dst}: message #{k} was sent by "
            f"stage {src} as {sent} (micro-batch {sent.microbatch}, virtual stage {v_sent}) but "
            f"receive {recv} on stage {dst} expects micro-batch {recv.microbatch} from virtual "
            f"stage {v_want}; receives must be posted in the sender's send order"
        )


def _deadlock_message(
    lists: Sequence[Sequence[Action]], pos: list[int], sent: dict[Channel, list], used: dict
) -> str:
    lines = ["deadlock: no stage can make progress (async sends, blocking receives)"]
    for s, actions in enumerate(lists):
        if pos[s] == len(actions):
            lines.append(f"  stage {s}: finished all {len(actions)} actions")
            continue
        a = actions[pos[s]]
        key = (a.peer, s, a.direction)
        got = len(sent.get(key, []))
        lines.append(
            f"  stage {s}: blocked at action #{pos[s]} {a}, waiting for message "
            f"#{used.get(key, 0)} on channel {a.direction} {a.peer}->{s} "
            f"(stage {a.peer} has sent {got} so far)"
        )
    return "\n".join(lines)


def replay(
    lists: Sequence[Sequence[Action]],
    duration: Callable[[int, Action], float],
    t_comm: float = 0.0,
    placement: str = "loop",
) -> list[list[TimedAction]]:
    """Run all stages under the execution model; return the timeline of every stage.
    ``placement``: the virtual-stage placement the lists follow (:mod:`~colonnade.pipeline.
    actions`); a local message (sender = receiver, the "v" turn) is a channel like any other.

    Raises `ScheduleError` on a bad peer, a FIFO payload mismatch, a deadlock (with the stuck
    state of every stage) or a message that is sent but never received.
    """
    pp = len(lists)
    pos, clock = [0] * pp, [0.0] * pp
    sent: dict[Channel, list[tuple[float, Action]]] = {}
    used: dict[Channel, int] = {}
    timeline: list[list[TimedAction]] = [[] for _ in range(pp)]
    runnable = list(range(pp))
    while runnable:
        s = runnable.pop()
        actions = lists[s]
        while pos[s] < len(actions):
            a = actions[pos[s]]
            start = clock[s]
            if a.is_comm and not 0 <= a.peer_stage < pp:
                raise ScheduleError(f"stage {s}: {a} names peer stage {a.peer} outside [0, {pp})")
            if a.is_recv:
                key = (a.peer_stage, s, a.direction)
                k = used.get(key, 0)
                if k >= len(sent.get(key, [])):
                    break  # blocked; the sender re-queues this stage when it posts
                arrival, msg = sent[key][k]
                _check_payload(msg, a.peer_stage, a, s, pp, k, placement)
                used[key] = k + 1
                end = max(start, arrival)
            elif a.is_send:
                key = (s, a.peer_stage, a.direction)
                sent.setdefault(key, []).append((start + t_comm, a))
                if a.peer_stage not in runnable:
                    runnable.append(a.peer_stage)
                end = start
            else:
                end = start + duration(s, a)
            clock[s] = end
            timeline[s].append(TimedAction(s, pos[s], a, start, end))
            pos[s] += 1
    if any(pos[s] < len(lists[s]) for s in range(pp)):
        raise ScheduleError(_deadlock_message(lists, pos, sent, used))
    for (src, dst, d), msgs in sorted(sent.items()):
        if used.get((src, dst, d), 0) < len(msgs):
            extra = msgs[used.get((src, dst, d), 0)][1]
            raise ScheduleError(
                f"stage {src} sends {len(msgs)} messages on channel {d} {src}->{dst} but stage "
                f"{dst} receives only {used.get((src, dst, d), 0)}; first unreceived: {extra}"
            )
    return timeline


@dataclass(frozen=True)
class Dag:
    """Valid action lists compiled once into the graph that :func:`replay` walks, so that many
    sets of durations can be timed fast (the planner prices ZB-V this way for every layout).

    Node n is one action; ``order`` lists the nodes so that every node comes after the nodes it
    waits for; ``prev[n]`` is the action before it on its stage (-1 for a stage's first) and
    ``sender[n]`` the send a receive is matched to (FIFO per channel, -1 for any other action).
    Under the execution model: end[n] = max(end[prev[n]], end[sender[n]] + t_comm) + duration,
    the duration of a communication action being 0 and a missing predecessor counting as 0.
    """

    actions: tuple[tuple[int, Action], ...]
    prev: tuple[int, ...]
    sender: tuple[int, ...]
    order: tuple[int, ...]
    last: tuple[int, ...]

    @classmethod
    def of(cls, lists: Sequence[Sequence[Action]], placement: str = "loop") -> Dag:
        """Compile ``lists``. Lists :func:`replay` rejects (a bad peer, a FIFO mismatch, a
        deadlock, an unreceived message) raise its error, with the stuck state it names."""
        actions = [(s, a) for s, stage in enumerate(lists) for a in stage]
        prev: list[int] = []
        for stage in lists:
            base = len(prev)
            prev.extend(base + j - 1 if j else -1 for j in range(len(stage)))
        sends: dict[tuple[int, int, Kind], list[int]] = {}
        for i, (s, a) in enumerate(actions):
            if a.kind in SEND_KINDS:
                sends.setdefault((s, a.peer or 0, _REPLY[a.kind]), []).append(i)
        sender = [-1] * len(actions)
        order = _topological(prev, sender) if _match(lists, actions, sends, sender,
                                                      placement) else ()
        if len(order) < len(actions):
            replay(lists, lambda _s, _a: 0.0, 0.0, placement)  # raises, naming the fault
            raise ScheduleError("Dag.of rejected lists that replay accepts: a bug in Dag.of")
        last = tuple(i for i in range(len(prev)) if i + 1 == len(prev) or prev[i + 1] == -1)
        return cls(tuple(actions), tuple(prev), tuple(sender), order, last)

    def makespan(self, duration: Callable[[int, Action], float], t_comm: float = 0.0) -> float:
        """The makespan :func:`replay` gives with these durations, in one pass over ``order``."""
        cost = [duration(s, a) if a.kind in COMPUTE_KINDS else 0.0 for s, a in self.actions]
        end = [0.0] * len(cost)
        prev, sender = self.prev, self.sender
        for n in self.order:
            p, q = prev[n], sender[n]
            start = end[p] if p >= 0 else 0.0
            if q >= 0 and end[q] + t_comm > start:
                start = end[q] + t_comm
            end[n] = start + cost[n]
        return max((end[n] for n in self.last), default=0.0)


_REPLY = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}


def _match(lists: Sequence[Sequence[Action]], actions: Sequence[tuple[int, Action]],
           sends: dict[tuple[int, int, Kind], list[int]], sender: list[int],
           placement: str) -> bool:
    """Fill ``sender[i]`` for every receive i with the send it takes (the k-th receive on a
    channel takes its k-th send); False if a receive finds no send or the wrong payload, or a
    send is never received (:func:`replay` then names the fault)."""
    pp, taken = len(lists), dict.fromkeys(sends, 0)
    for i, (s, a) in enumerate(actions):
        if a.kind not in RECV_KINDS:
            continue
        key = (a.peer if a.peer is not None else -1, s, a.kind)
        k = taken.get(key, 0)
        if k >= len(sends.get(key, ())):
            return False
        src, sent = actions[sends[key][k]]
        step = 1 if a.kind is Kind.RECV_F else -1
        if sent.microbatch != a.microbatch or (virtual_stage(src, sent.chunk, pp, placement)
                                               != virtual_stage(s, a.chunk, pp, placement) - step):
            return False
        sender[i], taken[key] = sends[key][k], k + 1
    return all(taken[key] == len(queue) for key, queue in sends.items())


def _topological(prev: Sequence[int], sender: Sequence[int]) -> tuple[int, ...]:
    """Kahn's order of the nodes whose edges are prev[n] -> n and sender[n] -> n."""
    waiting = [(p >= 0) + (q >= 0) for p, q in zip(prev, sender, strict=True)]
    after: list[list[int]] = [[] for _ in prev]
    for n, (p, q) in enumerate(zip(prev, sender, strict=True)):
        for d in (p, q):
            if d >= 0:
                after[d].append(n)
    ready = [n for n, w in enumerate(waiting) if w == 0]
    order: list[int] = []
    while ready:
        n = ready.pop()
        order.append(n)
        for k in after[n]:
            waiting[k] -= 1
            if waiting[k] == 0:
                ready.append(k)
    return tuple(order)


def simulate(
    lists: Sequence[Sequence[Action]],
    t_f: float,
    t_b: float,
    t_w: float,
    t_comm: float = 0.0,
    placement: str = "loop",
) -> SimResult:
    """Time a schedule with per-action durations (see module docstring) and return a SimResult.

    Example: 1F1B with t_f=1, t_b=2, t_w=0 has makespan 3 (m + p - 1) and bubble fraction
    (p - 1) / (m + p - 1) on every stage.
    """
    for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w), ("t_comm", t_comm)):
        if value < 0:
            raise ScheduleError(f"simulate: {name} must be >= 0, got {value}")
    splits = [any(a.kind == Kind.W for a in actions) for actions in lists]
    cost = {Kind.F: t_f, Kind.W: t_w}

    def duration(stage: int, a: Action) -> float:
        if a.kind == Kind.B:
            return t_b if splits[stage] else t_b + t_w
        return cost[a.kind]

    return timing(lists, duration, t_comm, placement)


def timing(
    lists: Sequence[Sequence[Action]],
    duration: Callable[[int, Action], float],
    t_comm: float = 0.0,
    placement: str = "loop",
) -> SimResult:
    """:func:`replay` with any per-action ``duration(stage, action)`` (measured times, say),
    summarised: makespan, busy / idle time and bubble fraction per stage."""
    timeline = replay(lists, duration, t_comm, placement)
    makespan = max((t[-1].end for t in timeline if t), default=0.0)
    busy = tuple(sum(e.end - e.start for e in t if e.action.is_compute) for t in timeline)
    idle = tuple(makespan - b for b in busy)
    frac = tuple(i / makespan if makespan > 0 else 0.0 for i in idle)
    return SimResult(makespan, busy, idle, frac, tuple(tuple(t) for t in timeline))


def one_stage_bound(stage_times: Sequence[Mapping[str, float]], m: int) -> float:
    """Least makespan of ANY schedule that runs one stage per rank (vp = 1) over m micro-batches,
    stage s taking ``stage_times[s]["F"]``, ``["B"]`` and ``["W"]`` per micro-batch (a missing
    kind takes 0; an unsplit backward is B with W = 0), with free communication.

    Stage s runs no forward before the first micro-batch has gone forward through stages
    0 .. s - 1, and then runs all m (T_F + T_B + T_W) of its own work one action at a time:

        makespan >= max_s ( sum_{r < s} T_F(r) + m (T_F(s) + T_B(s) + T_W(s)) )

    whatever the order of the actions and however much memory the schedule holds (GPipe,
    1F1B, ZB-H1, ZB-H2 alike). ZB-H1 reaches it when the last stage is the busiest and has
    enough W passes to fill the time its predecessors spend on the last micro-batch's
    backward (issue 19's gpt2-tiny at pp = 2). A schedule with several stages per rank (the
    V placement of ZB-V) is not bound by it: the rank holding the last stage also holds the
    first and starts at once.
    """
    if m < 1:
        raise ScheduleError(f"one_stage_bound: m must be >= 1, got {m}")
    best, head = 0.0, 0.0
    for times in stage_times:
        work = m * sum(times.get(kind, 0.0) for kind in ("F", "B", "W"))
        best = max(best, head + work)
        head += times.get("F", 0.0)
    return best
