"""Predict Narayanan et al. 2021 Table 1 and fit the one A100 efficiency constant to it.

For a row, the published choices are fixed (tp, pp, dp = GPUs/(tp pp), global batch, full
recompute, no sp, no ZeRO, 1F1B or interleaved); micro-batch and vp are not published, so the
planner picks the fastest that fits.  Predicted TFLOP/s per GPU = F / (T N) with F the row's
FLOPs including recomputation (eq. 3) and T the predicted step time.

Calibration (:func:`fit_efficiency`): the cluster's ``efficiency`` is the single free constant.
It is chosen by golden-section search to minimise the largest relative error over all ten rows
(minimax, so no row is sacrificed for the others); every other constant is a spec-sheet value.
"""

from __future__ import annotations

import dataclasses

from colonnade.planner.estimate import Estimate
from colonnade.planner.hardware import Cluster
from colonnade.planner.published import TABLE1, Table1Row
from colonnade.planner.search import Constraints, plan

MEGATRON_2021 = {"recompute": ("full",), "sp": (False,), "zero1": (False,),
                 "schedules": ("1f1b", "interleaved_1f1b")}
"""The feature set of the 2021 system: what Table 1's layouts could use."""


def predict_row(row: Table1Row, cluster: Cluster) -> Estimate:
    """Best prediction of the row's published layout (micro-batch and vp chosen)."""
    cons = Constraints(tp=row.tp, pp=row.pp, dp=row.dp, **MEGATRON_2021)
    return plan(row.workload(), cluster, row.gpus, cons).best


def relative_errors(cluster: Cluster, rows: tuple[Table1Row, ...] = TABLE1) -> list[float]:
    """predicted / published - 1 of the TFLOP/s per GPU, per row."""
    return [predict_row(r, cluster).tflops_per_device / r.tflops - 1 for r in rows]


def fit_efficiency(cluster: Cluster, rows: tuple[Table1Row, ...] = TABLE1,
                   lo: float = 0.3, hi: float = 1.0, tol: float = 1e-3) -> float:
    """The efficiency minimising max |relative error| over ``rows`` (golden-section search)."""

    def worst(eff: float) -> float:
        c = dataclasses.replace(cluster, efficiency=eff)
        return max(abs(e) for e in relative_errors(c, rows))

    ratio = (5**0.5 - 1) / 2
    a, b = lo, hi
    x1, x2 = b - ratio * (b - a), a + ratio * (b - a)
    f1, f2 = worst(x1), worst(x2)
    while b - a > tol:
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - ratio * (b - a)
            f1 = worst(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + ratio * (b - a)
            f2 = worst(x2)
    return (a + b) / 2
