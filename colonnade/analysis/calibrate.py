"""`colonnade plan --calibrate`: measure this machine and predict tiny CPU layouts.

Measured (each the median of several repeats, one thread per rank as training runs them):
  matmul   fp32 GFLOP/s of [s b, h] x [h, 4h] at the tiny model's shapes -> peak_tflops_fp32
           (efficiency is then 1: the measurement already is the achieved rate);
  memory   bandwidth of an elementwise add on 4M floats (3 x 4 bytes per element) -> hbm_gbps;
  dispatch host time per tensor op: one decoder layer's fwd+bwd at 4 tokens (1 vs 3 layer
           models, difference / 2) / ((1 + backward_ratio) * OPS_PER_LAYER) -> op_overhead_us;
  layer    the same at the workload's micro-batch x seq tokens -> ``efficiency``, the fitted
           constant (see :func:`fit_cpu_efficiency`): no layout's step time is used; a 3-layer
           middle chunk forward vs forward + backward -> ``backward_ratio`` (~1.8 here);
  zb split a 2-layer middle chunk's backward split into B and W vs the plain one, per layer
           -> ``split_backward_us`` (~1 ms here);
  head     the 1-layer model's time minus that layer (embedding, output layer, cross entropy)
           -> ``head_efficiency`` by the same inversion: its one large GEMM and vocabulary-wide
           fp32 passes reach another fraction of the peaks than a layer's small ops do;
  gloo     with 2 local processes: half the round trip of a 4-byte send/recv -> p2p latency, a
           4 MB send/recv -> p2p bandwidth; isolated all-reduces of the tp message (tokens x h
           floats) and of 4 MB -> bandwidth W; all-reduce, all-gather and reduce-scatter of the
           tp message *in situ*, each after a forward of the 1-layer model, minus the forwards
           alone -> their latencies (arrival skew and waking on cold caches included: ~1 ms
           each here, 2-3x what back-to-back collectives show; intra- and inter-"node" links
           are the same here);
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
from typing import Any

from colonnade.analysis.estimate import Estimate, estimate
from colonnade.analysis.hardware import PRESETS, Cluster, cluster_to_toml
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.timing import OPS_PER_LAYER, head_fwd_bwd_s, layer_forward_s
from colonnade.config.sections import ModelConfig

TINY_LAYOUTS: tuple[Layout, ...] = (
    Layout(),
    Layout(tp=2),
    Layout(pp=2),
    Layout(dp=2),
    Layout(tp=2, pp=2),
    Layout(tp=2, dp=2),
    Layout(pp=2, dp=2),
    Layout(tp=2, dp=2, sp=True, zero=1),
)
"""The tp / pp / dp mixes (micro-batch set by the caller) that ``--calibrate`` predicts and
``benchmarks/planner_cpu.py`` measures."""

MORE_TINY_LAYOUTS: tuple[Layout, ...] = (
    Layout(micro_batch=2),
    Layout(micro_batch=4, recompute="full"),
    Layout(micro_batch=4, recompute="selective"),
    Layout(pp=2, vp=2, schedule="interleaved_1f1b", micro_batch=4),
    Layout(pp=2, schedule="zb_h1", micro_batch=4),
    Layout(pp=2, vp=2, schedule="zbv", micro_batch=4),
    Layout(pp=2, micro_batch=2),
    Layout(tp=2, micro_batch=8),
    Layout(dp=2, zero=1, micro_batch=4),
)
"""``planner_cpu.py --extended`` also measures these: recompute, the other schedules, other
micro-batches, ZeRO-1 alone (each with its own micro-batch)."""


def _median_time(fn: Callable[[], object], repeats: int = 7, inner: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _layer_fwd_bwd_s(model: ModelConfig, micro_batch: int,
                     seq_len: int) -> tuple[float, float]:
    """(one decoder layer's forward + backward seconds, the rest's (embedding, final norm,
    output layer, cross entropy) forward + backward seconds); single process, fp32, one
    thread.

    The reference model is built with 1 and with 3 layers: half the difference of their
    fwd+bwd times is one layer as it runs inside the model (embedding, head and loss cancel);
    the 1-layer time minus that is the rest."""
    import torch

    from colonnade.config.sections import Config
    from colonnade.models.build import build_reference

    times = []
    for layers in (1, 3):
        net = build_reference(Config(model=dataclasses.replace(model, num_layers=layers)),
                              torch.float32)
        tokens = torch.randint(0, model.vocab, (micro_batch, seq_len))  # [b, s]
        times.append(_median_time(lambda net=net, tokens=tokens: net(tokens, tokens).backward(),
                                  repeats=7, inner=3))
    layer = (times[1] - times[0]) / 2
    return layer, times[0] - layer


def _middle_chunk(model: ModelConfig, layers: int, micro_batch: int,
                  seq_len: int) -> tuple[Any, Any, Any]:
    """(a pipeline chunk of ``layers`` decoder layers without embedding or head, an input
    x [b, s, h] (the pipeline message of one rank) that needs a gradient, an output gradient
    dy [b, s, h])."""
    import torch

    from colonnade.config.sections import Config
    from colonnade.models.build import make_context
    from colonnade.models.gpt import ModelChunk
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.pipeline.p2p import message_shape

    cfg = Config(model=dataclasses.replace(model, num_layers=layers))
    body = ModelChunk(cfg.model, make_context(cfg, ProcessGroups.single(), dtype=torch.float32),
                      list(range(layers)), first=False, last=False)
    shape = message_shape((micro_batch, seq_len), model.hidden_size, 1, False)  # [b, s, h]
    x = torch.randn(shape, requires_grad=True)
    return body, x, torch.randn_like(x)


def _backward_ratio(model: ModelConfig, micro_batch: int, seq_len: int) -> float:
    """A layer's backward / forward time, from a 3-layer middle chunk timed forward (autograd
    recording, as in training) and forward + backward (a difference of whole-model forwards
    is too noisy for it); clamped to [0.5, 3]."""
    body, x, dy = _middle_chunk(model, 3, micro_batch, seq_len)
    both = _median_time(lambda: body(x).backward(dy), repeats=7, inner=3)
    forward = _median_time(lambda: body(x), repeats=7, inner=3)
    return min(3.0, max(0.5, both / forward - 1))


def _split_backward_s(model: ModelConfig, micro_batch: int, seq_len: int) -> float:
    """Seconds ZB-H1's B / W split adds to one layer's backward: a 2-layer middle chunk's
    forward + split backward (``backward_input`` then ``backward_weight``) minus forward +
    plain backward, / 2."""
    from colonnade.pipeline.split_backward import backward_input, backward_weight

    body, x, dy = _middle_chunk(model, 2, micro_batch, seq_len)
    params = list(body.parameters())

    def split() -> None:
        y = body(x)  # [s, b, h]
        backward_weight(backward_input(y, dy, x, params)[1])

    plain = _median_time(lambda: body(x).backward(dy), repeats=7, inner=3)
    return max(_median_time(split, repeats=7, inner=3) - plain, 0.0) / 2


def measure_local(model: ModelConfig, tokens: int, micro_batch: int = 4,
                  seq_len: int = 128) -> dict[str, float]:
    """This process (one thread): matmul GFLOP/s, memory GB/s, host us per op, layer seconds.

    ``op_us``: one layer's fwd+bwd at 4 tokens (compute negligible) / (3 * OPS_PER_LAYER);
    ``layer_s`` / ``head_s`` / ``backward_ratio``: one layer's, and the output layer + loss's,
    fwd+bwd, and the layer's backward / forward ratio, at
    ``micro_batch`` x ``seq_len`` tokens (for :func:`fit_cpu_efficiency`)."""
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
        layer, head = _layer_fwd_bwd_s(model, micro_batch, seq_len)
        ratio = _backward_ratio(model, micro_batch, seq_len)
        op = _layer_fwd_bwd_s(model, 1, 4)[0] / ((1 + ratio) * OPS_PER_LAYER)
    finally:
        torch.set_num_threads(threads)
    return {"matmul_gflops": 2.0 * tokens * h * 4 * h / mm / 1e9,
            "memory_gbps": 12.0 * 4_000_000 / add / 1e9, "op_us": op * 1e6, "layer_s": layer,
            "head_s": head, "backward_ratio": ratio,
            "split_backward_us": _split_backward_s(model, micro_batch, seq_len) * 1e6}


def _achieved(roof: float, host: float, measured: float) -> float:
    """The fraction f with roof / f + host = measured, clamped to [0.05, 1]."""
    spare = measured - host
    return min(1.0, max(0.05, roof / spare)) if spare > 0 else 0.05


def fit_cpu_efficiency(cluster: Cluster, w: Workload, micro_batch: int,
                       layer_s: float) -> float:
    """The fitted CPU constant: achieved fraction of the measured matmul/memory peaks.

    Chosen so the model's time of one layer's fwd+bwd (tp = 1) equals the measured
    ``layer_s``: (1 + r) (roofline / eff + host) = layer_s, r the cluster's
    ``backward_ratio`` (clamped to [0.05, 1]).  The micro-benchmark peaks are reached by one
    big GEMM; real layers (small GEMMs, attention, norms, autograd bookkeeping) reach a
    fraction of them."""
    base = dataclasses.replace(cluster, efficiency=1.0)
    roof, host = layer_forward_s(w, Layout(micro_batch=micro_batch), base)
    both = 1 + cluster.backward_ratio
    return _achieved(both * roof, both * host, layer_s)


def fit_cpu_head_efficiency(cluster: Cluster, w: Workload, micro_batch: int,
                            head_s: float) -> float:
    """``head_efficiency``: the same inversion for the output layer + cross entropy (tp = 1),
    whose one large GEMM and vocabulary-wide passes reach another fraction of the peaks."""
    base = dataclasses.replace(cluster, efficiency=1.0, head_efficiency=None)
    roof, host, _ = head_fwd_bwd_s(w, Layout(micro_batch=micro_batch), base)
    return _achieved(roof, host, head_s)


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


def _segment(model: ModelConfig, seq_len: int) -> Callable[[], None]:
    """A compute segment like the ones between tp collectives: the forward of the 1-layer
    reference model on one sequence (~1-2 ms here).  Its working set (weights, activations,
    logits) matters: after a collective the rank wakes on cold caches, which the in-situ
    cost includes (a small matmul segment hides ~0.5 ms of it)."""
    import torch

    from colonnade.config.sections import Config
    from colonnade.models.build import build_reference

    net = build_reference(Config(model=dataclasses.replace(model, num_layers=1)), torch.float32)
    tokens = torch.randint(0, model.vocab, (1, seq_len))  # [b, s]

    def run() -> None:
        with torch.no_grad():
            net(tokens, tokens)
    return run


def _gloo_all_reduce(numel: int, model: ModelConfig, seq_len: int,
                     iters: int = 20) -> dict[str, float]:
    """Run on 2 ranks: collective costs as training sees them.

    Bandwidth W: isolated all-reduces of ``numel`` floats (the tp message) and of 1M floats,
    t = S / W + 2 alpha.  Latencies *in situ*: each collective of the tp message follows a
    compute segment (:func:`_segment`, as tp collectives follow a layer's GEMMs); its cost is
    the loop's time minus the segments' alone; that includes the ranks' arrival skew and
    waking a sleeping peer, which back-to-back collectives hide (gloo here: ~1 ms in situ vs
    ~0.3-0.8 ms back to back).  alpha = (cost - bandwidth term) / ring steps."""
    import torch
    import torch.distributed as dist

    times = {}
    for n in (numel, 1_000_000):
        buf = torch.zeros(n)
        times[n] = _median_time(lambda buf=buf: dist.all_reduce(buf), repeats=5, inner=5)
    s1, s2 = 4.0 * numel, 4.0e6
    bw = max((s2 - s1) / max(times[1_000_000] - times[numel], 1e-9), s1 / times[numel])
    buf, full, half = torch.zeros(numel), torch.zeros(2 * (numel // 2)), torch.zeros(numel // 2)
    seg = _segment(model, seq_len)
    ops = {"none": lambda: None, "ar": lambda: dist.all_reduce(buf),
           "ag": lambda: dist.all_gather_single(full, half),
           "rs": lambda: dist.reduce_scatter_single(half, full)}
    loops: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(3):
        for name, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                seg()
                op()
            loops[name].append((time.perf_counter() - t0) / iters)
    cost = {k: statistics.median(v) - statistics.median(loops["none"]) for k, v in loops.items()}
    return {"ar_latency_us": max((cost["ar"] - s1 / bw) / 2, 1e-6) * 1e6, "ar_gbps": bw / 1e9,
            "ag_latency_us": max(cost["ag"] - s1 / 2 / bw, 1e-6) * 1e6,
            "rs_latency_us": max(cost["rs"] - s1 / 2 / bw, 1e-6) * 1e6}


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
    tokens = torch.randint(0, model.vocab, (micro_batch, seq_len))  # [b, s]

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
    tokens = torch.randint(0, model.vocab, (micro_batch, seq_len))  # [b, s]

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


def measure_gloo(pool: object | None = None, numel: int = 32768,
                 model: ModelConfig | None = None, seq_len: int = 128) -> dict[str, float]:
    """Gloo between 2 local processes: send/recv latency and bandwidth (pipeline p2p) and the
    collective costs of :func:`_gloo_all_reduce` (tp/dp collectives, in situ after a forward
    of ``model``); ``pool``: a 2-rank RankPool to use (else one is started)."""
    from colonnade.parallel.pool import RankPool

    if pool is not None:
        run = pool.run  # type: ignore[attr-defined]
        return {**run(_gloo_pingpong)[0],
                **run(_gloo_all_reduce, numel, model or ModelConfig(), seq_len)[0]}
    with RankPool(2, timeout_s=120.0) as own:
        return measure_gloo(own, numel, model, seq_len)


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
        backward_ratio=local.get("backward_ratio", PRESETS["cpu-local"].backward_ratio),
        split_backward_us=local.get("split_backward_us", 0.0),
        sync_skew_2=gloo.get("sync_skew_2", 0.0), sync_skew_4=gloo.get("sync_skew_4", 0.0))
    if "layer_s" not in local:
        return c
    w = w or tiny_workload()
    eff = fit_cpu_efficiency(c, w, micro_batch, local["layer_s"])
    head = (fit_cpu_head_efficiency(c, w, micro_batch, local["head_s"]) if "head_s" in local
            else None)
    return dataclasses.replace(c, efficiency=eff, head_efficiency=head)


def tiny_workload(model: ModelConfig | None = None, seq_len: int = 128,
                  global_batch: int = 16) -> Workload:
    """The tiny CPU workload (fp32, default ModelConfig) whose layouts are predicted."""
    return Workload(model=model or ModelConfig(), seq_len=seq_len, global_batch=global_batch,
                    precision="fp32")


def predict_tiny(cluster: Cluster, w: Workload, micro_batch: int = 4) -> list[Estimate]:
    """Predictions of :data:`TINY_LAYOUTS` (micro-batch ``micro_batch``)."""
    return [estimate(w, dataclasses.replace(lay, micro_batch=micro_batch), cluster)
            for lay in TINY_LAYOUTS]


def calibrate_cpu(w: Workload, pools: dict[int, Any],
                  micro_batch: int = 4) -> tuple[Cluster, dict[str, float]]:
    """One whole calibration of the ``cpu-local`` cluster for workload ``w``: every
    measurement above, on ``pools`` (RankPools of 2 and, for the 4-rank skew, 4 ranks).

    Returns the cluster and the flat record of what was measured (for JSON)."""
    local = measure_local(w.model, w.seq_len * micro_batch, micro_batch, w.seq_len)
    gloo = measure_gloo(pools[2], w.seq_len * micro_batch * w.model.hidden_size, w.model,
                        w.seq_len)
    cores = measure_cores(pools[2], w.model, micro_batch, w.seq_len)
    gloo |= measure_skew({n: pools[n] for n in (2, 4) if n in pools}, w.model, micro_batch,
                         w.seq_len)
    cluster = calibrated_cluster(local, gloo, w, micro_batch, cores)
    return cluster, {**local, **gloo, "cores": cores, "efficiency": cluster.efficiency,
                     "head_efficiency": cluster.head_efficiency or 0.0}


def run_calibrate(args: argparse.Namespace) -> int:
    """Measure, print the cluster, predict the tiny layouts; optionally save the cluster."""
    from colonnade.parallel.pool import RankPool

    w = tiny_workload()
    with RankPool(2, timeout_s=120.0) as two, RankPool(4, timeout_s=120.0) as four:
        cluster, cal = calibrate_cpu(w, {2: two, 4: four})
    print(f"matmul {cal['matmul_gflops']:.1f} GFLOP/s (1 thread), memory "
          f"{cal['memory_gbps']:.1f} GB/s, {cal['op_us']:.1f} us per op; fwd+bwd of one layer "
          f"{cal['layer_s'] * 1e3:.2f} ms, of the output layer + loss {cal['head_s'] * 1e3:.2f} "
          f"ms -> efficiency {cal['efficiency']:.3f} / {cal['head_efficiency']:.3f}; backward "
          f"/ forward {cal['backward_ratio']:.2f}; ZB-H1 split {cal['split_backward_us']:.0f} us "
          "per layer")
    print(f"cores free {cal['cores']:.2f}; sync skew {cal['sync_skew_2']:.1%} (2 ranks), "
          f"{cal['sync_skew_4']:.1%} (4 ranks)")
    print(f"gloo: send/recv latency {cal['latency_us']:.0f} us, {cal['gbps']:.2f} GB/s; "
          f"in situ: all-reduce {cal['ar_latency_us']:.0f} us per step ({cal['ar_gbps']:.2f} "
          f"GB/s), all-gather {cal['ag_latency_us']:.0f} us, reduce-scatter "
          f"{cal['rs_latency_us']:.0f} us")
    print(cluster_to_toml(cluster))
    if getattr(args, "save_cluster", None):
        Path(args.save_cluster).write_text(
            "# measured by `colonnade plan --calibrate` on this machine\n"
            "# Re-measure with: colonnade plan --calibrate --save-cluster "
            "configs/clusters/cpu-local.toml\n" + cluster_to_toml(cluster))
        print(f"wrote {args.save_cluster}")
    print("predicted step time of tiny CPU layouts (model defaults, seq 128, mb 4, batch 16):")
    for e in predict_tiny(cluster, w):
        print(f"  {e.layout.short():45s} {e.layout.world} ranks  {e.step_s * 1e3:8.1f} ms")
    return 0
