"""One layout's full prediction: memory, time and the throughput figures derived from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from colonnade.analysis.hardware import GIB, Cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import Memory, memory_per_device
from colonnade.analysis.moe import moe_flops_delta_per_token
from colonnade.analysis.timing import Timing, step_time
from colonnade.models.counts import step_flops


@dataclass(frozen=True)
class Estimate:
    """Prediction for one layout of one workload on one cluster."""

    layout: Layout
    memory: Memory
    timing: Timing
    capacity: float
    """Usable bytes per device."""
    hardware_flops: float
    """FLOPs per step including recomputation (what Narayanan et al. report)."""
    model_flops: float
    """FLOPs per step without recomputation (for MFU)."""
    tokens: int
    """Tokens per step."""
    peak_flops: float
    """Peak FLOP/s of one device at the workload's precision."""

    @property
    def fits(self) -> bool:
        """Whether the fullest device's memory is within capacity."""
        return self.memory.total <= self.capacity

    @property
    def step_s(self) -> float:
        """Predicted seconds per step."""
        return self.timing.total

    @property
    def tokens_per_s(self) -> float:
        """Predicted tokens per second over the whole cluster."""
        return self.tokens / self.step_s

    @property
    def tflops_per_device(self) -> float:
        """Hardware TFLOP/s per device (recomputation counted, as in the paper's Table 1)."""
        return self.hardware_flops / self.step_s / self.layout.world / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (no recomputation counted) against the peak."""
        return self.model_flops / self.step_s / self.layout.world / self.peak_flops

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        lay = self.layout
        return {
            "layout": {"tp": lay.tp, "cp": lay.cp, "cp_attention": lay.cp_attention,
                       "cp_a2a_size": lay.cp_a2a_size,
                       "pp": lay.pp, "vp": lay.vp, "dp": lay.dp, "ep": lay.ep,
                       "expert_tp": lay.expert_tp, "micro_batch": lay.micro_batch, "zero": lay.zero,
                       "reshard_after_forward": lay.reshard if lay.zero == 3 else None,
                       "zero_shard_size": lay.zero_shard_size,
                       "recompute": lay.recompute, "sp": lay.sp, "schedule": lay.schedule},
            "overrides": lay.overrides(),
            "fits": self.fits,
            "memory_gib": self.memory.gib(),
            "memory_stage": self.memory.stage,
            "capacity_gib": self.capacity / GIB,
            "time_s": self.timing.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
        }


def moe_step_flops(w: Workload, recompute: str) -> float:
    """FLOPs per step the MoE layers add over the dense shape (active experts only: k of E,
    + router and shared expert, - the dense MLP): B s (3 + [full recompute]) x the forward
    delta per token (:func:`colonnade.analysis.moe.moe_flops_delta_per_token`)."""
    if not w.model.moe:
        return 0.0
    passes = 4.0 if recompute == "full" else 3.0
    return float(w.global_batch) * w.seq_len * passes * moe_flops_delta_per_token(w.model)


def on_cluster(w: Workload, cluster: Cluster) -> Workload:
    """``w`` with the activation model's kernel path of ``cluster``'s devices
    (``Cluster.kernels``: the memory of a plan is that of the device it is for)."""
    if w.kernels == cluster.kernels:
        return w
    return dataclasses.replace(w, kernels=cluster.kernels)


def estimate(w: Workload, layout: Layout, cluster: Cluster) -> Estimate:
    """Predict memory and step time of ``layout`` (assumed valid; see search.check_layout)
    on ``cluster``'s devices (their kernel path: :func:`on_cluster`)."""
    w = on_cluster(w, cluster)
    m = w.shape
    peak = (cluster.peak_tflops if w.mixed else cluster.peak_tflops_fp32) * 1e12
    return Estimate(
        layout=layout,
        memory=memory_per_device(w, layout),
        timing=step_time(w, layout, cluster),
        capacity=cluster.memory_bytes,
        hardware_flops=step_flops(m, w.seq_len, w.global_batch, layout.recompute)
        + moe_step_flops(w, layout.recompute),
        model_flops=step_flops(m, w.seq_len, w.global_batch, "none") + moe_step_flops(w, "none"),
        tokens=w.global_batch * w.seq_len,
        peak_flops=peak,
    )
