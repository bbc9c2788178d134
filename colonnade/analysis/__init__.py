"""Analysis: the planner (memory and step time of any layout on any cluster, the best layout),
the one activation-memory model and the tools that measure it.

    from colonnade.analysis import Workload, get_cluster, plan
    result = plan(workload, get_cluster("a100-80gb"), gpus=64)
    result.best.layout, result.best.step_s, result.best.memory.gib()

Modules: ``activations`` (bytes a layer keeps for backward, Korthikanti et al. per term),
``measure`` (saved-tensor and peak-memory meters that check it), ``memory`` (ZeRO accounting,
activations per stage and schedule),
``timing`` (compute, tp/pp/dp communication, bubble), ``zbv`` (ZB-V's step: its action lists
replayed with each chunk's costs), ``efficiency`` (a GEMM's achieved
fraction of peak against its arithmetic intensity), ``search`` (enumeration, ranking, errors),
``fit`` (Narayanan et al. Table 1, the efficiency fits, published H100 runs), ``report``
(table, JSON, plot), ``calibrate`` (this machine), ``cli`` (`colonnade plan`).  Parameter and
FLOP counts live low, in :mod:`colonnade.models.counts` (training's MFU needs them too).
"""

from colonnade.analysis.estimate import Estimate, estimate
from colonnade.analysis.hardware import PRESETS, Cluster, get_cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import Memory, memory_per_device, zero_paper_bytes
from colonnade.analysis.search import Constraints, Plan, PlanError, explain, plan
from colonnade.analysis.timing import Timing, step_time

__all__ = [
    "PRESETS", "Cluster", "Constraints", "Estimate", "Layout", "Memory", "Plan", "PlanError",
    "Timing", "Workload", "estimate", "explain", "get_cluster", "memory_per_device", "plan",
    "step_time", "zero_paper_bytes",
]
