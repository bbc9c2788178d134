"""Per-round ratios of two sides timed in the same rounds: their median and quartiles.

Every benchmark compares Colonnade with a peer round by round (interleaved, same load), so
the ratio of one round cancels load that drifts over seconds on a shared machine; the median
over rounds is the headline number and the quartiles [q1, q3] show how far a single run of
the table can move. The one place the benchmarks compute them.
"""

from __future__ import annotations

import statistics


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of ``values`` (all three the value itself for a single value)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


def ratio_stats(num: list[float], den: list[float]) -> dict[str, float]:
    """Median and quartiles over rounds of num[i] / den[i]: keys ratio, ratio_q1, ratio_q3."""
    q1, med, q3 = quartiles([a / b for a, b in zip(num, den, strict=True)])
    return {"ratio": med, "ratio_q1": q1, "ratio_q3": q3}
