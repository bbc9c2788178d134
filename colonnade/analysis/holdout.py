"""The planner against every published figure it knows, fitted-on rows marked.

Throughput (tokens per second per GPU, or TFLOP/s per GPU for Narayanan et al. Table 1, whose
micro-batch the planner picks): the A100's efficiency is fitted on Table 1 and the H100 / H200
GEMM curve on :data:`~colonnade.analysis.published.MPT_H100_FIT`; every other row is held
out: llm-foundry's other H100 rows and its A100 table, torchtitan's A100 and H100 tables and
colonnade's own H200 run (:mod:`colonnade.analysis.sources`).  The error is predicted /
published - 1.

Memory: every published configuration trained, so the planner's memory for its layout, with
what it used (recomputation, sp as Megatron ran it, FSDP's fp32 states, micro-batch 1 where
unpublished), must fit its device (:func:`memory_checks`, ``asserted``).  Two kinds of run are
printed but not asserted, because colonnade cannot run what they ran: torchtitan's per-op
selective checkpointing (it recomputes every second matmul and the elementwise ops; colonnade's
selective recompute only the attention core, so its memory is an over-estimate), and the
torchtitan Llama 2 13B run without checkpointing, whose layer code (unfused RMSNorm, complex
RoPE) colonnade's per-layer model does not describe to the byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colonnade.analysis.estimate import estimate, on_cluster
from colonnade.analysis.hardware import GIB, PRESETS, Cluster
from colonnade.analysis.memory import memory_per_device
from colonnade.analysis.published import HELD_OUT_H100, MPT_A100, MPT_H100_FIT, TABLE1, MPTRow
from colonnade.analysis.sources import PUBLISHED_RUNS

MPT_URL = ("https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/"
           "README.md")
NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473) Table 1"


@dataclass(frozen=True)
class Check:
    """One published throughput next to the planner's prediction."""

    source: str
    label: str
    device: str
    fitted: bool
    """True: the row is in the fit of its device's constants."""
    published: float
    predicted: float
    unit: str = "tokens/s/GPU"

    @property
    def error(self) -> float:
        """predicted / published - 1."""
        return self.predicted / self.published - 1


@dataclass(frozen=True)
class MemoryCheck:
    """The planner's memory per GPU of one published configuration against its device."""

    source: str
    label: str
    device: str
    predicted_gib: float
    capacity_gib: float
    """Usable device memory (capacity minus the runtime reserve)."""
    published_gib: float | None
    asserted: bool
    """False: printed, not asserted (see the module docstring)."""

    @property
    def fits(self) -> bool:
        """The planner says the configuration fits its device."""
        return self.predicted_gib <= self.capacity_gib


def mpt_check(row: MPTRow, cluster: Cluster, fitted: bool) -> Check:
    """One llm-foundry row on ``cluster``."""
    est = estimate(row.workload(), row.layout(), cluster)
    return Check(f"llm-foundry {cluster.name}", row.label(), cluster.name, fitted,
                 row.tokens_per_s_per_gpu, est.tokens_per_s / row.gpus)


def throughput_checks(table1: bool = True) -> list[Check]:
    """Every published throughput (``table1``: with Table 1's ten rows, which search the
    micro-batch and take ~1 s)."""
    from colonnade.analysis.fit import predict_row  # the search: only where Table 1 is asked

    a100, h100 = PRESETS["a100-80gb"], PRESETS["h100-sxm"]
    out = []
    if table1:
        out += [Check(NARAYANAN, f"{r.params_b}B", a100.name, True, r.tflops,
                      predict_row(r, a100).tflops_per_device, "TFLOP/s/GPU") for r in TABLE1]
    out += [mpt_check(r, h100, True) for r in MPT_H100_FIT]
    out += [mpt_check(r, h100, False) for r in HELD_OUT_H100]
    out += [mpt_check(r, a100, False) for r in MPT_A100]
    for run in PUBLISHED_RUNS:
        if run.tokens_per_s_per_gpu is None:
            continue
        est = estimate(run.workload, run.timed_layout, run.cluster)
        out.append(Check(run.source, run.label, run.cluster.name, False,
                         run.tokens_per_s_per_gpu, est.tokens_per_s / run.layout.world))
    return out


def held_out_worst(checks: list[Check]) -> dict[str, float]:
    """Largest |error| of the held-out rows per device."""
    worst: dict[str, float] = {}
    for c in checks:
        if not c.fitted:
            worst[c.device] = max(worst.get(c.device, 0.0), abs(c.error))
    return worst


NOT_ASSERTED = ("Llama 3.1 8B 8gpu sel", "Llama 3.1 8B 128gpu sel", "Llama 2 13B 64gpu")
"""torchtitan runs whose memory is printed, not asserted (module docstring)."""


def memory_checks() -> list[MemoryCheck]:
    """The planner's memory of every published configuration: Table 1 at micro-batch 1 and
    one chunk (the least it could have used), llm-foundry's rows at ZeRO-3, the runs of
    :mod:`colonnade.analysis.sources`."""
    a100, h100 = PRESETS["a100-80gb"], PRESETS["h100-sxm"]
    out = []
    for r in TABLE1:
        mem = memory_per_device(on_cluster(r.workload(), a100), r.layout(1, 1)).total
        out.append(MemoryCheck(NARAYANAN, f"{r.params_b}B", a100.name, mem / GIB,
                               a100.memory_bytes / GIB, None, True))
    for c, rows in ((h100, MPT_H100_FIT + HELD_OUT_H100), (a100, MPT_A100)):
        for row in rows:
            mem = memory_per_device(on_cluster(row.workload(), c), row.memory_layout()).total
            out.append(MemoryCheck(f"llm-foundry {c.name}", row.label(), c.name, mem / GIB,
                                   c.memory_bytes / GIB, None, True))
    for run in PUBLISHED_RUNS:
        mem = memory_per_device(on_cluster(run.workload, run.cluster), run.layout).total
        out.append(MemoryCheck(run.source, run.label, run.cluster.name, mem / GIB,
                               run.cluster.memory_bytes / GIB, run.memory_gib,
                               run.label not in NOT_ASSERTED))
    return out


def report(table1: bool = True) -> tuple[list[str], dict[str, Any]]:
    """(printed lines, JSON records) of the held-out report: every throughput per source and
    row (fitted rows marked), the held-out worst per device, every configuration's memory
    against its device (``colonnade plan --validate``, benchmarks/planner.py)."""
    checks, mems = throughput_checks(table1), memory_checks()
    head = (f"{'source':<30} {'row':<28} {'device':<22} {'set':<8} {'published':>10} "
            f"{'predicted':>10} {'error':>7}")
    lines = ["Throughput per GPU: predicted against published (sources: "
             "colonnade/analysis/sources.py, published.py)", head, "-" * len(head)]
    lines += [f"{c.source[:30]:<30} {c.label:<28} {c.device:<22} "
              f"{'fit' if c.fitted else 'held-out':<8} {c.published:>10.0f} "
              f"{c.predicted:>10.0f} {c.error:>+7.1%}  {c.unit}" for c in checks]
    worst = held_out_worst(checks)
    lines += [f"held-out max |error| on {d}: {e:.1%}" for d, e in worst.items()]
    lines += ["", "Memory per GPU of every published configuration (planner, GiB) against the "
              "usable device memory, and the published peak where there is one"]
    for m in mems:
        pub = f"{m.published_gib:.1f}" if m.published_gib is not None else "-"
        err = (f"{m.predicted_gib / m.published_gib - 1:+.1%}" if m.published_gib is not None
               else "")
        verdict = ("fits" if m.fits else "DOES NOT FIT") + ("" if m.asserted
                                                             else " (not asserted)")
        lines.append(f"{m.source[:30]:<30} {m.label:<28} {m.predicted_gib:>6.1f} / "
                     f"{m.capacity_gib:>5.1f}  published {pub:>5} {err:>7}  {verdict}")
    records = {"throughput": [dict(vars(c), error=c.error) for c in checks],
               "held_out_worst": worst,
               "memory": [dict(vars(m), fits=m.fits) for m in mems]}
    return lines, records
