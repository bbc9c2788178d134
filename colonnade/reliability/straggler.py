"""Straggler detection: which rank holds a synchronous job back, and in which part of its step.

Each rank splits its training steps into four parts, in seconds per step over a window of
``logging.straggler_interval`` steps:

  data       waiting for the step's micro-batches (``Trainer.next_batches``);
  compute    forward, backward and the gradient reductions, minus the time blocked in
             collectives during them;
  comm       time blocked in collectives over the whole step (the exposed time
             :class:`~colonnade.parallel.comm_stats.CommStats` measures, per phase);
  optimizer  the optimizer step, minus the time blocked in its collectives.

Timing follows the backend's clock (:func:`~colonnade.parallel.comm_stats.clock_for`): wall
clock on gloo, CUDA events on the compute stream with NCCL (so a GPU ahead of the host shows
no data wait, a GPU idling for the host does). The marks are read only at the window's end,
which is a log step: the loop synchronises there anyway, so the hot path gains no sync. At the
window's end every rank's four numbers go to every rank in one small all-gather of the world
group (``[world, 4]`` floats), and every rank applies the same pure rule
(:func:`slow_ranks`), so they agree without another collective.

The rule. In a synchronous job every rank's step takes the same wall time: a slow rank's peers
wait for it in collectives. So the straggler is not the rank with the longest step but the one
that works the longest and waits the least. With ``own = data + compute + optimizer`` (the
time a rank spends on its own work) and peers = the other ranks of its pipeline stage (ranks
of one stage do the same work; different stages legitimately do not), rank r is slow in a
window when

    own_r >= threshold x median(own of its peers)   and   comm_r <= median(comm of its peers)

and the part named is the one with the largest excess over its peers' median,
``argmax_p (x_rp - median_p)`` over data, compute, optimizer, reported as the ratio
``x_rp / median_p``. A rank slow for ``logging.straggler_windows`` consecutive windows is
named in the log and in metrics.jsonl (field ``stragglers``), again every that many windows
while it stays slow. A stage of one rank (pipeline parallel with no other axis) has no peers
and is never judged; a slow network link shows as long comm on the ranks using it, which this
rule does not name.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import torch

from colonnade.parallel.comm import CommGroup
from colonnade.parallel.comm_stats import Clock, CommStats, Mark

PARTS: tuple[str, ...] = ("data", "compute", "comm", "optimizer")
"""The parts of a step, in the order of a rank's timing row."""
OWN_PARTS: tuple[str, ...] = ("data", "compute", "optimizer")
"""The parts that are the rank's own work (not waiting for others)."""
TINY_S = 1e-9
"""Seconds below which a median is treated as this (a ratio over nothing)."""


def node_name() -> str:
    """This process's node: Slurm's node name when run by slurmd (several node daemons may share
    a host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _median(x: torch.Tensor) -> torch.Tensor:
    """Median along dim 0 (the mean of the two middle values for an even count)."""
    return torch.quantile(x, 0.5, dim=0)


def slow_ranks(times: torch.Tensor, stages: list[list[int]], threshold: float
               ) -> dict[int, tuple[str, float]]:
    """The ranks slow in one window: ``{rank: (part, ratio)}`` by the rule of this module.

    ``times``: ``[world, len(PARTS)]`` seconds per step; ``stages``: the ranks of each pipeline
    stage (peers are compared inside a stage only); ``threshold``: e.g. 1.2 = own work at
    least 20% above the peers' median.
    """
    times = times.double()
    own_cols = [PARTS.index(p) for p in OWN_PARTS]
    comm_col = PARTS.index("comm")
    out: dict[int, tuple[str, float]] = {}
    for stage in stages:
        if len(stage) < 2:
            continue
        for r in stage:
            peers = times[[q for q in stage if q != r]]  # [n-1, parts]
            med = _median(peers)  # [parts]
            own = times[r, own_cols].sum()
            own_med = _median(peers[:, own_cols].sum(dim=1, keepdim=True))[0]
            if own < threshold * max(float(own_med), TINY_S) or times[r, comm_col] > med[comm_col]:
                continue
            excess = times[r, own_cols] - med[own_cols]  # [3]
            k = int(torch.argmax(excess))
            part = OWN_PARTS[k]
            out[r] = (part, float(times[r, own_cols[k]]) / max(float(med[own_cols[k]]), TINY_S))
    return out


@dataclass(frozen=True)
class Straggler:
    """A rank named as a straggler."""

    rank: int
    node: str
    part: str
    """The slow part of its step (one of :data:`OWN_PARTS`)."""
    ratio: float
    """That part's seconds per step over the median of its peers' (this window)."""
    windows: int
    """Consecutive windows it has been slow."""

    def describe(self) -> str:
        """'rank 3 (node n2) is a straggler: compute 1.45x the median of its peers over the
        last 3 windows'."""
        return (f"rank {self.rank} (node {self.node}) is a straggler: {self.part} "
                f"{self.ratio:.2f}x the median of its peers over the last {self.windows} windows")


@dataclass
class Streaks:
    """Consecutive slow windows per rank; names a rank every ``windows`` slow windows in a row.

    Pure (no process group): the 200-step no-false-positive test drives it over synthetic
    timings.
    """

    stages: list[list[int]]
    threshold: float
    windows: int
    nodes: list[str]
    count: dict[int, int] = field(default_factory=dict)

    def update(self, times: torch.Tensor) -> list[Straggler]:
        """Judge one window's ``[world, len(PARTS)]`` timings; the stragglers to report now."""
        slow = slow_ranks(times, self.stages, self.threshold)
        self.count = {r: self.count.get(r, 0) + 1 for r in slow}
        return [Straggler(r, self.nodes[r], part, ratio, self.count[r])
                for r, (part, ratio) in sorted(slow.items())
                if self.count[r] % self.windows == 0]


class StepTimer:
    """Marks the phases of this rank's steps and sums them over a window.

    Per step: :meth:`start` before the batches are fetched, then :meth:`phase` 'compute' once
    they are here, 'optimizer' before the optimizer step, and :meth:`end` after it. Marks come
    from ``clock`` (wall clock or CUDA events) and are read only in :meth:`window`. The phase
    is also set on ``stats`` so that exposed collective time is split by phase.
    """

    def __init__(self, clock: Clock, stats: CommStats) -> None:
        self.clock, self.stats = clock, stats
        self.marks: list[tuple[str, Mark]] = []
        self.steps = 0
        self.comm_base = dict(stats.waited_by_phase)

    def start(self) -> None:
        """A step begins (its data is fetched next)."""
        self.marks.append(("start", self.clock.mark()))
        self.stats.phase = "data"

    def phase(self, name: str) -> None:
        """The step enters ``name`` ('compute' or 'optimizer')."""
        self.marks.append((name, self.clock.mark()))
        self.stats.phase = name

    def end(self) -> None:
        """The step's optimizer update is done."""
        self.marks.append(("end", self.clock.mark()))
        self.stats.phase = ""
        self.steps += 1

    def window(self) -> torch.Tensor:
        """``[len(PARTS)]`` seconds per step since the last window (host-waits for the marks:
        call at a synchronising log step), and start a new window."""
        spans = dict.fromkeys(("data", "compute", "optimizer"), 0.0)
        for (name, mark), (_, after) in zip(self.marks, self.marks[1:], strict=False):
            if name != "end":
                after.wait()
                spans["data" if name == "start" else name] += after.seconds_since(mark)
        self.stats.settle()
        now = dict(self.stats.waited_by_phase)
        comm = {p: now.get(p, 0.0) - self.comm_base.get(p, 0.0) for p in ("data", "compute",
                                                                          "optimizer")}
        n = max(self.steps, 1)
        row = [spans["data"] - comm["data"], spans["compute"] - comm["compute"],
               sum(comm.values()), spans["optimizer"] - comm["optimizer"]]
        self.marks, self.steps, self.comm_base = [], 0, now
        return torch.tensor([max(x, 0.0) / n for x in row], dtype=torch.float64)


class StragglerWatch:
    """One rank's detector: its :class:`StepTimer`, and at each window's end the all-gather of
    every rank's timings and the shared :class:`Streaks`."""

    def __init__(self, world: CommGroup, stages: list[list[int]], threshold: float,
                 windows: int, device: torch.device) -> None:
        self.world, self.device = world, device
        self.timer = StepTimer(world.clock, world.stats)
        nodes = [str(n) for n in world.all_gather_object(node_name())]
        self.streaks = Streaks(stages, threshold, windows, nodes)

    def check(self) -> list[Straggler]:
        """Collective over the world group: gather every rank's window and judge it."""
        row = self.timer.window().to(self.device)  # [parts]
        out = torch.empty(self.world.size * len(PARTS), dtype=row.dtype, device=self.device)
        self.world.all_gather_into(out, row, name="straggler")
        return self.streaks.update(out.view(self.world.size, len(PARTS)).cpu())
