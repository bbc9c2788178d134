"""ZB-V in the planner: its step by replaying the schedule's own action lists.

ZB-V (``parallel.schedule = "zbv"``, vp = 2, :mod:`colonnade.pipeline.zbv`) places two chunks
of l / (2 pp) layers on each stage in a V: stage s holds virtual stages s and 2 pp - 1 - s, so
stage 0 holds the embedding (virtual stage 0) and the head + loss (virtual stage 2 pp - 1).

Time (:func:`zbv_makespan`): the makespan of the real lists
(:func:`colonnade.pipeline.schedules.schedule_lists`, built in O(pp m)) replayed by
:func:`colonnade.pipeline.simulate.replay` (compiled once per (pp, m) into a
:class:`~colonnade.pipeline.simulate.Dag`) (placement "v", communication free: p2p is
charged by the time model separately) with each chunk's own durations per micro-batch:
F = its forward, B = its backward minus its weight-gradient GEMMs (the input gradient),
W = those GEMMs; on the first virtual stage (stage 0, chunk 0, whose input is the tokens)
B does nothing and W runs the whole backward, as the executor does
(:mod:`colonnade.pipeline.split_backward`). No closed form: with unequal chunks (stage 0
carries the embedding and the head) the replay is what the executor's order does. With
F = B = W = 1/2 on every chunk (a stage's F = B = W = 1) and pp dividing m >= 2 pp the
replayed idle time is (pp - 1) / 2: half of ZB-H1's pp - 1 and a sixth of 1F1B's 3 (pp - 1);
pricing the executor's split on stage 0 (B empty, W = B + W) leaves it so
(``tests/analysis/test_zbv.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from colonnade.pipeline.actions import Action, Kind
from colonnade.pipeline.schedules import schedule_lists
from colonnade.pipeline.simulate import Dag

Chunk = tuple[float, float, float]
"""(forward, whole backward, of which weight-gradient GEMMs) seconds of one chunk for one
micro-batch on one device."""


def _durations(chunks: Sequence[tuple[Chunk, Chunk]]) -> tuple[tuple[Chunk, Chunk], ...]:
    """(F, B, W) per stage and chunk, as the executor splits them: B = backward - W, and on
    the first virtual stage (stage 0, chunk 0) B = 0 and W = the whole backward."""
    out = []
    for s, pair in enumerate(chunks):
        row = []
        for c, (fwd, bwd, wgrad) in enumerate(pair):
            first = s == 0 and c == 0
            row.append((fwd, 0.0, bwd) if first else (fwd, bwd - wgrad, wgrad))
        out.append((row[0], row[1]))
    return tuple(out)


@lru_cache(maxsize=64)
def _dag(pp: int, m: int) -> Dag:
    """The zbv lists of pp stages and m micro-batches, compiled once."""
    return Dag.of(schedule_lists("zbv", pp, 2, m), "v")


@lru_cache(maxsize=4096)
def _replay(durations: tuple[tuple[Chunk, Chunk], ...], m: int) -> float:
    """Makespan of the zbv lists for pp = len(durations) stages and m micro-batches."""
    index = {Kind.F: 0, Kind.B: 1, Kind.W: 2}

    def duration(stage: int, action: Action) -> float:
        return durations[stage][action.chunk][index[action.kind]]

    return _dag(len(durations), m).makespan(duration)


def zbv_makespan(chunks: Sequence[tuple[Chunk, Chunk]], m: int) -> float:
    """Seconds from the first forward to the last weight gradient of ZB-V with pp =
    len(chunks) stages, m micro-batches, ``chunks[s][c]`` = (forward, backward, weight-gradient
    GEMMs) of stage s's chunk c: the replay of the lists (module docstring)."""
    return _replay(_durations(chunks), m)
