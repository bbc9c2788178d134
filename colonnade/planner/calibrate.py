"""`colonnade plan --calibrate`: measure this machine and predict tiny CPU layouts.

Measured (each the median of several repeats, one thread per rank as training runs them):
  matmul   fp32 GFLOP/s of [s b, h] x [h, 4h] at the tiny model's shapes -> peak_tflops_fp32
           (efficiency is then 1: the measurement already is the achieved rate);
  memory   bandwidth of an elementwise add on 4M floats (3 x 4 bytes per element) -> hbm_gbps;
  dispatch host time of one small tensor op -> op_overhead_us;
  gloo     with 2 local processes: half the round trip of a 4-byte send/recv -> latency, and a
           4 MB send/recv -> bandwidth (intra- and inter-"node" links are the same here).
The cluster is ``cpu-local``: one node with as many ranks as asked, sharing ``os.cpu_count()``
cores.  The tiny layouts predicted are tp/pp/dp mixes on 1-4 ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from colonnade.config.sections import ModelConfig
from colonnade.planner.estimate import Estimate, estimate
from colonnade.planner.hardware import PRESETS, Cluster, cluster_to_toml
from colonnade.planner.layout import Layout, Workload

TINY_LAYOUTS: tuple[Layout, ...] = (
    Layout(),
    Layout(tp=2),
    Layout(pp=2),
    Layout(dp=2),
    Layout(tp=2, pp=2),
    Layout(tp=2, dp=2),
    Layout(pp=2, dp=2),
    Layout(tp=2, dp=2, sp=True, zero1=True),
)


def _median_time(fn: Callable[[], object], repeats: int = 7, inner: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def measure_local(model: ModelConfig, tokens: int) -> dict[str, float]:
    """Matmul GFLOP/s, memory GB/s and per-op microseconds of this process (one thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        h = model.hidden_size
        a, b = torch.randn(tokens, h), torch.randn(h, 4 * h)
        mm = _median_time(lambda: a @ b)
        x, y = torch.randn(4_000_000), torch.randn(4_000_000)
        out = torch.empty_like(x)
        add = _median_time(lambda: torch.add(x, y, out=out))
        s1, s2 = torch.randn(8), torch.randn(8)
        op = _median_time(lambda: s1 + s2, inner=200)
    finally:
        torch.set_num_threads(threads)
    return {"matmul_gflops": 2.0 * tokens * h * 4 * h / mm / 1e9,
            "memory_gbps": 12.0 * 4_000_000 / add / 1e9, "op_us": op * 1e6}


def _gloo_pingpong() -> dict[str, float]:
    """Run on 2 ranks: latency (half round trip, 4 bytes) and bandwidth (4 MB) of send/recv."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for name, numel in (("lat", 1), ("bw", 1_000_000)):
        buf = torch.zeros(numel)

        def roundtrip(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        out[name] = _median_time(roundtrip, repeats=5, inner=10 if numel == 1 else 3) / 2
    return {"latency_us": out["lat"] * 1e6, "gbps": 4e6 / max(out["bw"] - out["lat"], 1e-9) / 1e9}


def measure_gloo() -> dict[str, float]:
    """Gloo latency and bandwidth between 2 local processes."""
    from colonnade.testing import RankPool

    with RankPool(2, timeout_s=120.0) as pool:
        return pool.run(_gloo_pingpong)[0]


def calibrated_cluster(local: dict[str, float], gloo: dict[str, float]) -> Cluster:
    """The cpu-local cluster from measurements."""
    return dataclasses.replace(
        PRESETS["cpu-local"], peak_tflops=local["matmul_gflops"] / 1e3,
        peak_tflops_fp32=local["matmul_gflops"] / 1e3, hbm_gbps=local["memory_gbps"],
        intra_node_gbps=gloo["gbps"], inter_node_gbps=gloo["gbps"] * PRESETS[
            "cpu-local"].gpus_per_node, intra_latency_us=gloo["latency_us"],
        inter_latency_us=gloo["latency_us"], op_overhead_us=local["op_us"],
        efficiency=1.0, compute_units=os.cpu_count() or 1)


def tiny_workload(model: ModelConfig | None = None, seq_len: int = 128,
                  global_batch: int = 16) -> Workload:
    """The tiny CPU workload (fp32, default ModelConfig) whose layouts are predicted."""
    return Workload(model=model or ModelConfig(), seq_len=seq_len, global_batch=global_batch,
                    precision="fp32")


def predict_tiny(cluster: Cluster, w: Workload, micro_batch: int = 4) -> list[Estimate]:
    """Predictions of :data:`TINY_LAYOUTS` (micro-batch ``micro_batch``)."""
    return [estimate(w, dataclasses.replace(lay, micro_batch=micro_batch), cluster)
            for lay in TINY_LAYOUTS]


def run_calibrate(args: argparse.Namespace) -> int:
    """Measure, print the cluster, predict the tiny layouts; optionally save the cluster."""
    w = tiny_workload()
    local = measure_local(w.model, tokens=w.seq_len * 4)
    print(f"matmul {local['matmul_gflops']:.1f} GFLOP/s (1 thread), memory "
          f"{local['memory_gbps']:.1f} GB/s, {local['op_us']:.1f} us per op")
    gloo = measure_gloo()
    print(f"gloo: latency {gloo['latency_us']:.0f} us, bandwidth {gloo['gbps']:.2f} GB/s")
    cluster = calibrated_cluster(local, gloo)
    print(cluster_to_toml(cluster))
    if getattr(args, "save_cluster", None):
        Path(args.save_cluster).write_text(
            "# measured by `colonnade plan --calibrate` on this machine\n"
            + cluster_to_toml(cluster))
        print(f"wrote {args.save_cluster}")
    print("predicted step time of tiny CPU layouts (model defaults, seq 128, mb 4, batch 16):")
    for e in predict_tiny(cluster, w):
        print(f"  {e.layout.short():45s} {e.layout.world} ranks  {e.step_s * 1e3:8.1f} ms")
    return 0
