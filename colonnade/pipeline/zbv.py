"""The compute order of ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"):
zero-bubble pipelining over two chunks per stage in the "v" placement.

Stage s holds virtual stages s (chunk 0) and 2 pp - 1 - s (chunk 1), so the first and the last
virtual stage (embedding, and head + loss) are both on stage 0, and a micro-batch's forward runs
down the stages and back up. The backward is split as in ZB-H1: B computes only the input
gradient (what the previous virtual stage waits for), W the weight gradient (which nobody
waits for), so W fills the idle slots a 1F1B order leaves.

The order is built by list scheduling on unit-time actions (F = B = W = 1, communication free):
at every time step each stage starts one action whose dependencies have finished -
F(k, v) after F(k, v - 1), B(k, v) after F(k, v) and B(k, v + 1), W(k, v) after B(k, v) - by
priority B, then F (chunk 1 before chunk 0), then W, each (kind, virtual stage) in micro-batch
order. Memory is bounded by ``cap``: at most ``cap`` micro-batches whose chunk-0 forward ran and
whose chunk-0 weight gradient did not may be in flight on a stage (chunk-1 forwards are never
held back: the micro-batch is already in). :func:`zbv_orders` tries every cap and keeps the
shortest order whose peak (chunk-activations with F done and W not done) is at most 2 pp: the
activation memory of 1F1B on its first stage (pp micro-batches of layers / pp), with chunks of
layers / (2 pp). The orders are pure data; `check_schedule` proves them (FIFO, no deadlock)
like every schedule, and ``tests/pipeline/test_zbv.py`` bounds their bubble.
"""

from __future__ import annotations

from functools import lru_cache

from colonnade.pipeline.actions import Action, Kind, ScheduleError, compute

Order = tuple[tuple[Action, ...], ...]  # per stage, compute actions only


def _list_schedule(pp: int, m: int, cap: int) -> tuple[Order, int, int]:
    """(per-stage orders, makespan, peak chunk-activations) of the list schedule with ``cap``."""
    last = 2 * pp - 1
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, micro-batch, v) -> finish time
    nxt = {(kind, v): 0 for kind in (Kind.F, Kind.B, Kind.W) for v in range(last + 1)}
    orders: list[list[Action]] = [[] for _ in range(pp)]
    held, entered, peak = [0] * pp, [0] * pp, 0
    total, t = 3 * (last + 1) * m, 0

    def ready(kind: Kind, v: int, now: int) -> int | None:
        k = nxt[(kind, v)]
        if k >= m:
            return None
        if kind == Kind.F:
            ok = v == 0 or done.get((Kind.F, k, v - 1), now + 1) <= now
        elif kind == Kind.B:
            ok = (done.get((Kind.F, k, v), now + 1) <= now
                  and (v == last or done.get((Kind.B, k, v + 1), now + 1) <= now))
        else:
            ok = done.get((Kind.B, k, v), now + 1) <= now
        return k if ok else None

    while len(done) < total:
        if t > 4 * total:
            raise ScheduleError(f"zbv: no order found for pp={pp}, m={m}, cap={cap}")
        for s in range(pp):
            v0, v1 = s, last - s
            choices = [(Kind.B, v1), (Kind.B, v0), (Kind.F, v1)]
            if entered[s] < cap:
                choices.append((Kind.F, v0))
            choices += [(Kind.W, v1), (Kind.W, v0)]
            for kind, v in choices:
                k = ready(kind, v, t)
                if k is None:
                    continue
                done[(kind, k, v)] = t + 1
                nxt[(kind, v)] += 1
                orders[s].append(compute(kind, k, 0 if v == v0 else 1))
                held[s] += {Kind.F: 1, Kind.W: -1}.get(kind, 0)
                entered[s] += {(Kind.F, v0): 1, (Kind.W, v0): -1}.get((kind, v), 0)
                peak = max(peak, held[s])
                break
        t += 1
    makespan = max(done.values())
    return tuple(tuple(o) for o in orders), makespan, peak


@lru_cache(maxsize=32)
def zbv_orders(pp: int, m: int) -> Order:
    """Every stage's ZB-V compute order for pp stages and m micro-batches (module docstring):
    the shortest list schedule over caps 1 .. 2 pp whose peak is at most 2 pp
    chunk-activations (the smallest such cap on a tie)."""
    best: tuple[int, Order] | None = None
    for cap in range(1, 2 * pp + 1):
        orders, makespan, peak = _list_schedule(pp, m, cap)
        if peak <= 2 * pp and (best is None or makespan < best[0]):
            best = (makespan, orders)
    if best is None:
        raise ScheduleError(f"zbv: no order within 2 pp chunk-activations for pp={pp}, m={m}")
    return best[1]
