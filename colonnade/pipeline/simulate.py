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

from colonnade.pipeline.actions import Action, Kind, ScheduleError, virtual_stage

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
