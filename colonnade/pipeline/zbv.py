"""The compute order of ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
section 6): zero-bubble pipelining over two chunks per stage in the "v" placement.

Stage s holds virtual stages s (chunk 0) and 2 pp - 1 - s (chunk 1), so the first and the last
virtual stage (embedding, and head + loss) are both on stage 0, and a micro-batch's forward runs
down the stages and back up. The backward is split as in ZB-H1: B computes only the input
gradient (what the previous virtual stage waits for), W the weight gradient (which nobody
waits for).

The order of stage s, over n = max(2 pp - 1, m) micro-batch slots (a slot k >= m is dropped
afterwards: its actions are idle slots of the pattern), writing X0 / X1 for action X of chunk 0 /
chunk 1, each kind and chunk in micro-batch order:

  warm-up   2 (pp - s) - 1 times F0; s times (F1, F0); pp - s times (F1, B1, W1)
  steady    while chunk-1 forwards lag or chunk-0 slots remain: F0 (if any left), B0, W0,
            F1, B1, W1
  cool-down s times (B0, B1); pp - s times (B0, W0); the remaining W1, then the remaining W0

The warm-up fills the V: the chunk-0 forwards of stage s reach the turn and come back up to its
chunk 1 just as it is ready for them, and from then on every stage alternates one F, B and W of
each chunk, W right after its B (so a weight gradient's saved tensors are freed at once). The
deferred W's of the cool-down fill the tail that 1F1B leaves idle. Memory: at most 2 pp
chunk-activations held from F until W on any stage, each layers / (2 pp), i.e. 1F1B's first
stage (pp micro-batches of layers / pp). Timed with F = B = W = 1/2 per chunk (a stage's
F = B = W = 1, ZB-H1's unit) the replayed makespan is 3 m + (pp - 1) / 2 whenever pp divides
m >= 2 pp, never above ZB-H1's 3 m + pp - 1, and below it for every m > pp
(``tests/pipeline/test_zbv.py``). With the executor's costs (stage 0's chunk 0 has no input
gradient: its B is empty and its W does the whole backward) W right after B also keeps that
stage's long W's from delaying the next micro-batch; on issue 19's gpt2-tiny (pp = 2, m = 4)
this order ran a step in ~282 ms where a unit-time list schedule took ~314 ms. The orders are
pure data; `check_schedule` proves them (FIFO, no deadlock) like every schedule.
"""

from __future__ import annotations

from functools import lru_cache

from colonnade.pipeline.actions import Action, Kind, ScheduleError, compute

Order = tuple[tuple[Action, ...], ...]  # per stage, compute actions only
Slot = tuple[Kind, int, int]  # (kind, micro-batch slot, local chunk)


class _StageOrder:
    """The growing order of one stage: per (kind, chunk) the next micro-batch slot."""

    def __init__(self) -> None:
        self.ops: list[Slot] = []
        self.count: dict[tuple[Kind, int], int] = {
            (kind, c): 0 for kind in (Kind.F, Kind.B, Kind.W) for c in (0, 1)}

    def add(self, *items: tuple[Kind, int]) -> None:
        for kind, c in items:
            self.ops.append((kind, self.count[(kind, c)], c))
            self.count[(kind, c)] += 1

    def behind(self, kind: Kind, c: int, other: Kind, oc: int) -> bool:
        """Whether (kind, c) has run fewer slots than (other, oc)."""
        return self.count[(kind, c)] < self.count[(other, oc)]


def stage_order(pp: int, m: int, stage: int) -> tuple[Action, ...]:
    """The compute order of ``stage`` (module docstring), slots >= m dropped."""
    n = max(2 * pp - 1, m)
    o = _StageOrder()
    F, B, W = Kind.F, Kind.B, Kind.W
    for _ in range(2 * (pp - stage) - 1):
        o.add((F, 0))
    for _ in range(stage):
        o.add((F, 1), (F, 0))
    for _ in range(pp - stage):
        o.add((F, 1), (B, 1), (W, 1))
    while o.behind(F, 1, F, 0) or o.count[(F, 0)] < n:
        if o.count[(F, 0)] < n:
            o.add((F, 0))
        o.add((B, 0), (W, 0), (F, 1), (B, 1), (W, 1))
    for _ in range(stage):
        o.add((B, 0), (B, 1))
    for _ in range(pp - stage):
        o.add((B, 0), (W, 0))
    while o.behind(W, 1, B, 1):
        o.add((W, 1))
    while o.behind(W, 0, B, 0):
        o.add((W, 0))
    if any(o.count[(kind, c)] != n for kind in (F, B, W) for c in (0, 1)):
        raise ScheduleError(f"zbv: stage {stage} of pp={pp}, m={m} did not run every slot once")
    return tuple(compute(kind, k, c) for kind, k, c in o.ops if k < m)


@lru_cache(maxsize=64)
def zbv_orders(pp: int, m: int) -> Order:
    """Every stage's ZB-V compute order for pp stages and m micro-batches (module docstring)."""
    if pp < 1 or m < 1:
        raise ScheduleError(f"zbv: pp and m must be >= 1, got pp={pp}, m={m}")
    return tuple(stage_order(pp, m, s) for s in range(pp))
