"""The compute order of ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"):
zero-bubble pipelining over two chunks per stage in the "v" placement.

Stage s holds virtual stages s (chunk 0) and 2 pp - 1 - s (chunk 1), so the first and the last
virtual stage (embedding, and head + loss) are both on stage 0, and a micro-batch's forward runs
down the stages and back up. The backward is split as in ZB-H1: B computes only the input
gradient (what the previous virtual stage waits for), W the weight gradient (which nobody
waits for), so W fills the idle slots a 1F1B order leaves.

The order is built by list scheduling on unit-time actions (F = B = W = 1, communication free):
at every time step each stage starts one action whose dependencies have finished -
F(k, v) after F(k, v - 1), B(k, v) after F(k, v) and B(k, v + 1), W(k, v) after B(k, v) - the
first ready one in a priority *rule* over (kind, chunk), each (kind, virtual stage) in
micro-batch order. Memory: a stage holds one chunk-activation from an F until its W, at most
L = 2 pp of them: the activation memory of 1F1B on its first stage (pp micro-batches of
layers / pp), with chunks of layers / (2 pp). Chunk-1 forwards are never held back (their
micro-batch is already in); a chunk-0 forward, which lets a new micro-batch in, is admitted by

* a cap: fewer than ``cap`` micro-batches on the stage with their chunk-0 F done and chunk-0 W
  not (the peak is measured afterwards and the order kept only if it is <= L), or
* a reservation: held + open + 2 <= L, held the chunk-activations (F done, W not), open the
  micro-batches whose chunk-0 F ran and chunk-1 F did not; each admitted micro-batch keeps room
  for its chunk-1 activation, so held <= L always and no chunk-1 forward waits for memory.

:func:`zbv_orders` runs the rule ``BACKWARD_FIRST`` with every cap 1 .. L and the rules
``FORWARD_FIRST`` and ``WEIGHT_FIRST`` with the reservation, and keeps the shortest order. Timed
with a stage's F = B = W = 1 (1/2 per chunk, ZB-H1's stage 1), no order beats 3 m + (pp - 1) / 2
(stage pp - 1 starts (pp - 1) / 2 late, then has 3 m of work); the caps reach it when pp divides m,
but for other m > pp they can take longer than ZB-H1's 3 m + pp - 1. The reservation rules were
found by trying all 720 priority orders over pp 2..8, m 1..3 pp + 1: ``FORWARD_FIRST`` is the only
one that alone never takes longer than ZB-H1 there and is shorter for every m >= pp, and
``WEIGHT_FIRST`` the order that, added to it, cuts the summed makespan most (the union stays below
ZB-H1 for every m >= pp measured, pp 2..8, m to 5 pp and 64). The orders are pure data;
`check_schedule` proves them (FIFO, no deadlock) like every schedule, and
``tests/pipeline/test_zbv.py`` checks their makespans against ZB-H1's.
"""

from __future__ import annotations

from functools import lru_cache

from colonnade.pipeline.actions import Action, Kind, ScheduleError, compute

Order = tuple[tuple[Action, ...], ...]  # per stage, compute actions only
Rule = tuple[tuple[Kind, int], ...]  # (kind, local chunk) by decreasing priority

BACKWARD_FIRST: Rule = ((Kind.B, 1), (Kind.B, 0), (Kind.F, 1), (Kind.F, 0), (Kind.W, 1),
                        (Kind.W, 0))
"""Backward first (the gradient chain is the critical path), then forward, then W."""
FORWARD_FIRST: Rule = ((Kind.F, 1), (Kind.F, 0), (Kind.B, 1), (Kind.W, 0), (Kind.B, 0),
                       (Kind.W, 1))
"""Forward as far as the reservation allows; chunk-0 W before chunk-0 B frees memory early."""
WEIGHT_FIRST: Rule = ((Kind.W, 1), (Kind.F, 1), (Kind.F, 0), (Kind.B, 1), (Kind.B, 0),
                      (Kind.W, 0))
"""The head's W first (stage 0's memory), then forward, backward, the other W."""


def _ready(done: dict[tuple[Kind, int, int], int], kind: Kind, k: int, v: int, last: int,
           now: int) -> bool:
    """Whether action (kind, micro-batch k, virtual stage v) may start at time ``now``."""
    def finished(key: tuple[Kind, int, int]) -> bool:
        return done.get(key, now + 1) <= now

    if kind == Kind.F:
        return v == 0 or finished((Kind.F, k, v - 1))
    if kind == Kind.B:
        return finished((Kind.F, k, v)) and (v == last or finished((Kind.B, k, v + 1)))
    return finished((Kind.B, k, v))


def _list_schedule(pp: int, m: int, rule: Rule, cap: int | None
                   ) -> tuple[Order, int, int] | None:
    """(per-stage orders, makespan, peak chunk-activations) of the list schedule with ``rule``
    and admission by ``cap`` (None: by reservation); None if it stalls."""
    last, limit = 2 * pp - 1, 2 * pp
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, micro-batch, v) -> finish time
    nxt = {(kind, v): 0 for kind in (Kind.F, Kind.B, Kind.W) for v in range(last + 1)}
    orders: list[list[Action]] = [[] for _ in range(pp)]
    held, entered, opened, peak = [0] * pp, [0] * pp, [0] * pp, 0
    total, t = 3 * (last + 1) * m, 0
    while len(done) < total:
        if t > 4 * total:
            return None
        for s in range(pp):
            admit = (entered[s] < cap if cap is not None
                     else held[s] + opened[s] + 2 <= limit)
            for kind, c in rule:
                v = s if c == 0 else last - s
                k = nxt[(kind, v)]
                if (k >= m or (kind == Kind.F and c == 0 and not admit)
                        or not _ready(done, kind, k, v, last, t)):
                    continue
                done[(kind, k, v)] = t + 1
                nxt[(kind, v)] += 1
                orders[s].append(compute(kind, k, c))
                step = {Kind.F: 1, Kind.W: -1}.get(kind, 0)
                held[s] += step
                entered[s] += step if c == 0 else 0
                opened[s] += (1 if c == 0 else -1) if kind == Kind.F else 0
                peak = max(peak, held[s])
                break
        t += 1
    return tuple(tuple(o) for o in orders), max(done.values()), peak


@lru_cache(maxsize=32)
def zbv_orders(pp: int, m: int) -> Order:
    """Every stage's ZB-V compute order for pp stages and m micro-batches (module docstring):
    the shortest list schedule whose peak is at most 2 pp chunk-activations, over
    ``BACKWARD_FIRST`` with caps 1 .. 2 pp, then ``FORWARD_FIRST`` and ``WEIGHT_FIRST`` with
    the reservation (the first of these on a tie)."""
    candidates: list[tuple[Rule, int | None]] = [(BACKWARD_FIRST, cap)
                                                 for cap in range(1, 2 * pp + 1)]
    candidates += [(FORWARD_FIRST, None), (WEIGHT_FIRST, None)]
    best: tuple[int, Order] | None = None
    for rule, cap in candidates:
        found = _list_schedule(pp, m, rule, cap)
        if found is None:
            continue
        orders, makespan, peak = found
        if peak <= 2 * pp and (best is None or makespan < best[0]):
            best = (makespan, orders)
    if best is None:
        raise ScheduleError(f"zbv: no order within 2 pp chunk-activations for pp={pp}, m={m}")
    return best[1]
