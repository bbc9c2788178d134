"""`colonnade plan --calibrate`: measure this machine and predict tiny CPU layouts.

Measured (each the median of several repeats, one thread per rank as training runs them):
  matmul   fp32 GFLOP/s of [s b, h] x [h, 4h] at the tiny model's shapes -> peak_tflops_fp32
           (efficiency is then 1: the measurement already is the achieved rate);
  memory   bandwidth of an elementwise add on 4M floats (3 x 4 bytes per element) -> hbm_gbps;
  dispatch host time per tensor op: one decoder layer's fwd+bwd at 4 tokens (1 vs 3 layer
           models, difference / 2) / (3 * OPS_PER_LAYER) -> op_overhead_us;
  layer    the same at the workload's micro-batch x seq tokens -> ``efficiency``, the one fitted
           constant (see :func:`fit_cpu_efficiency`): no layout's step time is used;
  gloo     with 2 local processes: half the round trip of a 4-byte send/recv -> p2p latency, a
           4 MB send/recv -> p2p bandwidth; all-reduces of the tp message (tokens x h floats)
           and of 4 MB fitted to S / W + 2 alpha -> collective latency alpha and bandwidth W
           (intra- and inter-"node" links are the same here); all-gather and reduce-scatter of
           the tp message -> their own latencies (gloo: ~0.3 ms and ~1.7 ms vs ~1.2 ms);
  skew     on 2 and 4 ranks: time lost waiting at a barrier after each of a series of
           1-layer fwd+bwd segments, as a fraction of the segment -> sync_skew_2/_4;
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
from colonnade.planner.timing import OPS_PER_LAYER, layer_forward_s

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


def _layer_fwd_bwd_s(model: ModelConfig, micro_batch: int, seq_len: int) -> float:
    """Seconds of one decoder layer's forward + backward (single process, fp32, one thread).

    The reference model is built with 1 and with 3 layers; half the difference of their
    fwd+bwd times is one layer (embedding, head and loss cancel)."""
    import torch

    from colonnade.config.sections import Config
    from colonnade.models.build import build_reference

    times = []
    for layers in (1, 3):
        net = build_reference(Config(model=dataclasses.replace(model, num_layers=layers)),
                              torch.float32)
        tokens = torch.randint(0, model.vocab_size, (micro_batch, seq_len))  # [b, s]
        times.append(_median_time(lambda net=net, tokens=tokens: net(tokens, tokens).backward(),
                                  repeats=7, inner=3))
    return (times[1] - times[0]) / 2


def measure_local(model: ModelConfig, tokens: int, micro_batch: int = 4,
                  seq_len: int = 128) -> dict[str, float]:
    """This process (one thread): matmul GFLOP/s, memory GB/s, host us per op, layer seconds.

    ``op_us``: one layer's fwd+bwd at 4 tokens (compute negligible) / (3 * OPS_PER_LAYER);
    ``layer_s``: one layer's fwd+bwd at ``micro_batch`` x ``seq_len`` tokens (for
    :func:`fit_cpu_efficiency`)."""
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
        op = _layer_fwd_bwd_s(model, 1, 4) / (3 * OPS_PER_LAYER)
        layer = _layer_fwd_bwd_s(model, micro_batch, seq_len)
    finally:
        torch.set_num_threads(threads)
    return {"matmul_gflops": 2.0 * tokens * h * 4 * h / mm / 1e9,
            "memory_gbps": 12.0 * 4_000_000 / add / 1e9, "op_us": op * 1e6, "layer_s": layer}


def fit_cpu_efficiency(cluster: Cluster, w: Workload, micro_batch: int,
                       layer_s: float) -> float:
    """The one fitted CPU constant: achieved fraction of the measured matmul/memory peaks.

    Chosen so the model's time of one layer's fwd+bwd (tp = 1) equals the measured
    ``layer_s``: 3 roofline / eff + 3 host = layer_s (clamped to [0.05, 1]).  The micro-
    benchmark peaks are reached by one big GEMM; real layers (small GEMMs, attention,
    norms, autograd bookkeeping) reach a fraction of them."""
    base = dataclasses.replace(cluster, efficiency=1.0)
    roof, host = layer_forward_s(w, Layout(micro_batch=micro_batch), base)
    spare = layer_s - 3 * host
    return min(1.0, max(0.05, 3 * roof / spare)) if spare > 0 else 0.05


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


def _gloo_all_reduce(numel: int) -> dict[str, float]:
    """Run on 2 ranks: fit the ring model t = S / W + 2 alpha to all-reduces of ``numel``
    floats (the tp message) and of 1M floats.  Gloo's all-reduce costs far more per call
    than a send/recv round trip (~1 ms vs ~0.1 ms here), so tp/dp collectives use this."""
    import torch
    import torch.distributed as dist

    times = {}
    for n in (numel, 1_000_000):
        buf = torch.zeros(n)
        times[n] = _median_time(lambda buf=buf: dist.all_reduce(buf), repeats=5, inner=5)
    full, half = torch.zeros(2 * (numel // 2)), torch.zeros(numel // 2)
    t_ag = _median_time(lambda: dist.all_gather_single(full, half), repeats=5, inner=5)
    t_rs = _median_time(lambda: dist.reduce_scatter_single(half, full), repeats=5, inner=5)
    s1, s2 = 4.0 * numel, 4.0e6
    bw = (s2 - s1) / max(times[1_000_000] - times[numel], 1e-9)  # bytes/s
    alpha = max((times[numel] - s1 / bw) / 2, 1e-6)
    return {"ar_latency_us": alpha * 1e6, "ar_gbps": bw / 1e9,
            "ag_latency_us": max(t_ag - s1 / 2 / bw, 1e-6) * 1e6,
            "rs_latency_us": max(t_rs - s1 / 2 / bw, 1e-6) * 1e6}


def _parallel_work(model: ModelConfig, micro_batch: int, seq_len: int) -> float:
    """Run on 2 ranks: seconds of a fixed training workload (fwd+bwd of the 2-layer model at
    the workload's micro-batch) when both ranks run it at once, divided by the seconds when
    rank 0 runs it alone (rank 1 idle in a barrier).  Shared caches and memory bandwidth,
    and other processes, make it > 1 even when both ranks have a core."""
    import torch
    import torch.distributed as dist

    from colonnade.config.sections import Config
    from colonnade.models.build import build_reference

    torch.set_num_threads(1)
    net = build_reference(Config(model=dataclasses.replace(model, num_layers=2)), torch.float32)
    tokens = torch.randint(0, model.vocab_size, (micro_batch, seq_len))  # [b, s]

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(3):
            net(tokens, tokens).backward()
        return time.perf_counter() - t0

    work()
    ratios = []
    for _ in range(5):
        dist.barrier()
        alone = work() if dist.get_rank() == 0 else 0.0
        dist.barrier()
        both = work()
        dist.barrier()
        ratios.append(both / alone if alone else 0.0)
    return statistics.median(ratios)


def _sync_skew(model: ModelConfig, micro_batch: int, seq_len: int, iters: int = 12) -> float:
    """Run on n ranks: the fraction of a compute segment lost waiting at a barrier after it.

    Each rank runs ``iters`` x [the 1-layer model's fwd+bwd at the workload's micro-batch (one
    segment: between a tp collective's ~1 ms and a dp step's ~50 ms of compute), barrier],
    timing its own segments.  Wait per segment = loop time / iters - own
    mean segment - a bare barrier's time; returned divided by the mean segment."""
    import torch
    import torch.distributed as dist

    from colonnade.config.sections import Config
    from colonnade.models.build import build_reference

    torch.set_num_threads(1)
    net = build_reference(Config(model=dataclasses.replace(model, num_layers=1)), torch.float32)
    tokens = torch.randint(0, model.vocab_size, (micro_batch, seq_len))  # [b, s]

    def seg() -> float:
        t0 = time.perf_counter()
        net(tokens, tokens).backward()
        return time.perf_counter() - t0

    seg()
    dist.barrier()
    bare = _median_time(dist.barrier, repeats=5, inner=10)
    dist.barrier()
    t0 = time.perf_counter()
    own = []
    for _ in range(iters):
        own.append(seg())
        dist.barrier()
    loop = (time.perf_counter() - t0) / iters
    mean = statistics.fmean(own)
    return max(loop - mean - bare, 0.0) / mean


def measure_skew(pools: dict[int, object], model: ModelConfig | None = None,
                 micro_batch: int = 4, seq_len: int = 128) -> dict[str, float]:
    """``sync_skew_2`` / ``sync_skew_4``: :func:`_sync_skew` averaged over the ranks of a 2- and
    a 4-rank pool (a missing pool: the other's value)."""
    out: dict[str, float] = {}
    for n in (2, 4):
        if n in pools:
            got = pools[n].run(_sync_skew, model or ModelConfig(), micro_batch,  # type: ignore
                               seq_len)
            out[f"sync_skew_{n}"] = statistics.fmean(got)
    if not out:
        raise ValueError("measure_skew: pass a 2- or a 4-rank pool in `pools`")
    out.setdefault("sync_skew_2", out.get("sync_skew_4", 0.0))
    out.setdefault("sync_skew_4", out["sync_skew_2"])
    return out


def measure_cores(pool: object, model: ModelConfig | None = None, micro_batch: int = 4,
                  seq_len: int = 128) -> float:
    """Cores our ranks effectively have now: 2 / slowdown of 2 concurrent ranks, in
    [1, cpu_count].  On a shared machine other processes take part of the cores; this is what
    ``compute_units`` (ranks beyond it time-share) should be."""
    run = pool.run  # type: ignore[attr-defined]
    slow = max(run(_parallel_work, model or ModelConfig(), micro_batch, seq_len)[0], 1.0)
    return max(1.0, min(float(os.cpu_count() or 1), 2.0 / slow))


def measure_gloo(pool: object | None = None, numel: int = 32768) -> dict[str, float]:
    """Gloo between 2 local processes: send/recv latency and bandwidth (pipeline p2p) and the
    all-reduce fit of :func:`_gloo_all_reduce` (tp/dp collectives); ``pool``: a 2-rank
    RankPool to use (else one is started)."""
    from colonnade.testing import RankPool

    if pool is not None:
        run = pool.run  # type: ignore[attr-defined]
        return {**run(_gloo_pingpong)[0], **run(_gloo_all_reduce, numel)[0]}
    with RankPool(2, timeout_s=120.0) as own:
        return measure_gloo(own, numel)


def calibrated_cluster(local: dict[str, float], gloo: dict[str, float],
                       w: Workload | None = None, micro_batch: int = 4,
                       cores: float | None = None) -> Cluster:
    """The cpu-local cluster from measurements (efficiency fitted when ``layer_s`` is known)."""
    c = dataclasses.replace(
        PRESETS["cpu-local"], peak_tflops=local["matmul_gflops"] / 1e3,
        peak_tflops_fp32=local["matmul_gflops"] / 1e3, hbm_gbps=local["memory_gbps"],
        intra_node_gbps=gloo.get("ar_gbps", gloo["gbps"]),
        inter_node_gbps=gloo.get("ar_gbps", gloo["gbps"]) * PRESETS["cpu-local"].gpus_per_node,
        intra_latency_us=gloo.get("ar_latency_us", gloo["latency_us"]),
        inter_latency_us=gloo.get("ar_latency_us", gloo["latency_us"]),
        p2p_latency_us=gloo["latency_us"], p2p_gbps=gloo["gbps"], op_overhead_us=local["op_us"],
        all_gather_latency_us=gloo.get("ag_latency_us"),
        reduce_scatter_latency_us=gloo.get("rs_latency_us"),
        efficiency=1.0, compute_units=cores or os.cpu_count() or 1,
        sync_skew_2=gloo.get("sync_skew_2", 0.0), sync_skew_4=gloo.get("sync_skew_4", 0.0))
    if "layer_s" not in local:
        return c
    eff = fit_cpu_efficiency(c, w or tiny_workload(), micro_batch, local["layer_s"])
    return dataclasses.replace(c, efficiency=eff)


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
    local = measure_local(w.model, tokens=w.seq_len * 4, micro_batch=4, seq_len=w.seq_len)
    print(f"matmul {local['matmul_gflops']:.1f} GFLOP/s (1 thread), memory "
          f"{local['memory_gbps']:.1f} GB/s, {local['op_us']:.1f} us per op, one layer "
          f"fwd+bwd {local['layer_s'] * 1e3:.2f} ms")
    from colonnade.testing import RankPool

    with RankPool(2, timeout_s=120.0) as two, RankPool(4, timeout_s=120.0) as four:
        gloo = measure_gloo(two, numel=w.seq_len * 4 * w.model.hidden_size)
        gloo |= measure_skew({2: two, 4: four}, w.model, 4, w.seq_len)
    print(f"sync skew: {gloo['sync_skew_2']:.1%} (2 ranks), {gloo['sync_skew_4']:.1%} (4 ranks)")
    print(f"gloo: send/recv latency {gloo['latency_us']:.0f} us, {gloo['gbps']:.2f} GB/s; "
          f"all-reduce latency {gloo['ar_latency_us']:.0f} us, {gloo['ar_gbps']:.2f} GB/s")
    cluster = calibrated_cluster(local, gloo, w)
    print(f"fitted CPU efficiency {cluster.efficiency:.3f}")
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
