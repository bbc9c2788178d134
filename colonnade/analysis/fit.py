"""Predict Narayanan et al. 2021 Table 1 and fit the one A100 efficiency constant to it.

For a row, the published choices are fixed (tp, pp, dp = GPUs/(tp pp), global batch, full
recompute, no sp, no ZeRO, 1F1B or interleaved); micro-batch and vp are not published, so the
planner picks the fastest that fits.  Predicted TFLOP/s per GPU = F / (T N) with F the row's
FLOPs including recomputation (eq. 3) and T the predicted step time.

Calibration (:func:`fit_efficiency`): the cluster's ``efficiency`` is the single free constant.
It is chosen by golden-section search to minimise the largest relative error over all ten rows
(minimax, so no row is sacrificed for the others); every other constant is a spec-sheet value.
Table 1 does not identify a size dependence of the A100's GEMMs (its rows are flat, 135-163
TFLOP/s, and every one is large-GEMM bound): a knee (:mod:`colonnade.analysis.efficiency`) of up
to 0.1 x the A100's balance leaves the minimax error at 5.2%, larger knees raise it
(``benchmarks/planner.py --fit`` scans it), so the A100 keeps ``gemm_knee_balance = 0``.

H100 (:func:`fit_gemm_curve`): ``efficiency`` and ``gemm_knee_balance`` minimise the largest
relative error of the predicted tokens/s per GPU over :data:`~colonnade.analysis.published.
MPT_H100_FIT` (golden-section search over the knee, the efficiency fitted at each knee); the
rows of :data:`~colonnade.analysis.published.HELD_OUT_H100` are the check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from colonnade.analysis.estimate import Estimate, estimate
from colonnade.analysis.hardware import Cluster
from colonnade.analysis.published import MPT_H100_FIT, TABLE1, MPTRow, Table1Row
from colonnade.analysis.search import Constraints, plan

MEGATRON_2021 = {"recompute": ("full",), "sp": (False,), "zero": (0,),
                 "schedules": ("1f1b", "interleaved_1f1b")}
"""The feature set of the 2021 system: what Table 1's layouts could use."""


def predict_row(row: Table1Row, cluster: Cluster) -> Estimate:
    """Best prediction of the row's published layout (micro-batch and vp chosen)."""
    cons = Constraints(tp=row.tp, pp=row.pp, dp=row.dp, **MEGATRON_2021)
    return plan(row.workload(), cluster, row.gpus, cons).best


def relative_errors(cluster: Cluster, rows: tuple[Table1Row, ...] = TABLE1) -> list[float]:
    """predicted / published - 1 of the TFLOP/s per GPU, per row."""
    return [predict_row(r, cluster).tflops_per_device / r.tflops - 1 for r in rows]


def golden_min(fn: Callable[[float], float], lo: float, hi: float, tol: float) -> float:
    """The x in [lo, hi] minimising a unimodal ``fn`` to within ``tol`` (golden section)."""
    ratio = (5**0.5 - 1) / 2
    a, b = lo, hi
    x1, x2 = b - ratio * (b - a), a + ratio * (b - a)
    f1, f2 = fn(x1), fn(x2)
    while b - a > tol:
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - ratio * (b - a)
            f1 = fn(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + ratio * (b - a)
            f2 = fn(x2)
    return (a + b) / 2


def fit_efficiency(cluster: Cluster, rows: tuple[Table1Row, ...] = TABLE1,
                   lo: float = 0.3, hi: float = 1.0, tol: float = 1e-3) -> float:
    """The efficiency minimising max |relative error| over ``rows`` (golden-section search)."""

    def worst(eff: float) -> float:
        c = dataclasses.replace(cluster, efficiency=eff)
        return max(abs(e) for e in relative_errors(c, rows))

    return golden_min(worst, lo, hi, tol)


def h100_error(row: MPTRow, cluster: Cluster) -> float:
    """predicted / published - 1 of the tokens/s per GPU of ``row``'s published layout."""
    est = estimate(row.workload(), row.layout(), cluster)
    return est.tokens_per_s / row.gpus / row.tokens_per_s_per_gpu - 1


def h100_errors(cluster: Cluster, rows: tuple[MPTRow, ...]) -> list[float]:
    """:func:`h100_error` of each row."""
    return [h100_error(r, cluster) for r in rows]


def fit_gemm_curve(cluster: Cluster, rows: tuple[MPTRow, ...] = MPT_H100_FIT,
                   knee_hi: float = 4.0, tol: float = 1e-3) -> tuple[float, float]:
    """(efficiency, gemm_knee_balance) minimising max |relative error| over ``rows``: the
    knee by golden section in [0, knee_hi], the efficiency fitted by golden section at each."""

    def best_eff(knee: float) -> tuple[float, float]:
        c = dataclasses.replace(cluster, gemm_knee_balance=knee)

        def worst(eff: float) -> float:
            return max(abs(e) for e in h100_errors(dataclasses.replace(c, efficiency=eff),
                                                   rows))

        eff = golden_min(worst, 0.2, 1.2, tol / 4)
        return worst(eff), eff

    knee = golden_min(lambda k: best_eff(k)[0], 0.0, knee_hi, tol)
    return best_eff(knee)[1], knee
