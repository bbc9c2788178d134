"""Per-round ratios of two sides timed in the same rounds: their median and quartiles.

Every benchmark compares Colonnade with a peer round by round (interleaved, same load), so
the ratio of one round cancels load that drifts over seconds on a shared machine; the median
over rounds is the headline number and the quartiles [q1, q3] show how far a single run of
the table can move. Load also drifts over minutes, so a table may repeat every benchmark
(``peer_table.py --repeat N``) and pool the rounds of its runs (:func:`pooled_row`). The one
place the benchmarks compute them.
"""

from __future__ import annotations

import statistics
from typing import Any


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of ``values`` (all three the value itself for a single value)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


def ratio_stats(num: list[float], den: list[float]) -> dict[str, Any]:
    """Median and quartiles over rounds of num[i] / den[i]: keys ratio, ratio_q1, ratio_q3,
    and the per-round ratios themselves (ratio_rounds, for pooling runs)."""
    rounds = [a / b for a, b in zip(num, den, strict=True)]
    q1, med, q3 = quartiles(rounds)
    return {"ratio": med, "ratio_q1": q1, "ratio_q3": q3, "ratio_rounds": rounds}


def pooled_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from the same layout's rows of several runs of a benchmark.

    ratio, ratio_q1, ratio_q3: median and quartiles over the rounds of every run together
    (each round against its own run's fastest peer; a run whose row has no ``ratio_rounds``
    counts as one round, its median); ratio_cpu likewise over ``ratio_cpu_rounds``;
    colonnade / peer_tokens_per_s: medians over the runs; run_ratios: each run's own median;
    the peer named is the one fastest in most runs. Other fields come from the last run.
    """
    rounds = [x for r in runs for x in r.get("ratio_rounds", [r["ratio"]])]
    cpu = [x for r in runs for x in (r.get("ratio_cpu_rounds") or [r.get("ratio_cpu")])
           if x is not None]
    q1, med, q3 = quartiles(rounds)
    peers = [r["peer"] for r in runs]
    return {**runs[-1], "ratio": med, "ratio_q1": q1, "ratio_q3": q3, "ratio_rounds": rounds,
            "ratio_cpu": statistics.median(cpu) if cpu else None, "ratio_cpu_rounds": cpu,
            "colonnade": statistics.median(r["colonnade"] for r in runs),
            "peer": max(peers, key=peers.count),
            "peer_tokens_per_s": statistics.median(r["peer_tokens_per_s"] for r in runs),
            "run_ratios": [r["ratio"] for r in runs]}


def cpu_ratios(stats: dict[str, Any]) -> dict[str, Any]:
    """:func:`ratio_stats` of CPU times as a row's ratio_cpu (median) and ratio_cpu_rounds."""
    return {"ratio_cpu": stats["ratio"], "ratio_cpu_rounds": stats["ratio_rounds"]}
