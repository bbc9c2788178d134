"""Planner vs this machine: predicted and measured step time of tiny CPU layouts.

    .venv/bin/python benchmarks/planner_cpu.py [--rounds 6] [--steps 3] [--warmup 2] [--json PATH]
        [--save-cluster configs/clusters/cpu-local.toml] [--extended]

1. Calibrate, at the start of every round (the machine's load changes): ``colonnade.analysis.
   calibrate`` measures one-thread matmul GFLOP/s, memory GB/s, host time per op, one
   decoder layer's fwd+bwd and the output layer + loss's (-> ``efficiency`` and
   ``head_efficiency``) in this process, gloo send/recv latency / bandwidth, all-reduce
   bandwidth and the in-situ cost of all-reduce / all-gather / reduce-scatter after a forward
   segment, the cores free for our ranks and the barrier skew on 2 and 4 ranks; that round's
   predictions use that ``cpu-local`` cluster (no layout's step time is ever used to fit
   anything).
2. Measure: every layout of ``calibrate.TINY_LAYOUTS`` (with ``--extended`` also
   ``calibrate.MORE_TINY_LAYOUTS``, each at its own micro-batch; tiny workload: default ModelConfig,
   llama h=64, 4 layers, vocab 2048, seq 128, global batch 16, micro-batch 4, fp32) trains on
   gloo CPU ranks (one thread each; persistent pools of 1, 2 and 4 ranks) with the real
   ``Trainer.train_step``.  Each run builds a fresh model, runs ``warmup`` steps (excluded),
   then ``steps`` steps each framed by world barriers; rank 0's step times are kept.  Layouts
   are interleaved round by round (order rotated) so slow phases of the shared machine hit all
   of them; the measured value is the median over all kept steps of all rounds, the predicted
   value the median of the rounds' predictions.
3. Compare: relative error predicted / measured - 1 per layout (target |err| <= 30%) and the
   Spearman rank correlation of the two orderings (target: identical ranking, rho = 1);
   for each pair of neighbours in the measured order, in how many rounds the per-round
   medians put them in that order (a pair the rounds disagree on is within the noise).
   The 1-minute load average before and after is reported: other processes share the cores.

Writes benchmarks/results/planner_cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from colonnade.analysis.calibrate import (
    MORE_TINY_LAYOUTS,
    TINY_LAYOUTS,
    calibrate_cpu,
    calibrated_cluster,
    tiny_workload,
)
from colonnade.analysis.estimate import estimate
from colonnade.analysis.hardware import Cluster, cluster_to_toml
from colonnade.analysis.layout import Layout, Workload
from colonnade.config.sections import Config, OptimConfig, TrainingConfig
from colonnade.config.validate import resolve, validate
from colonnade.data.synthetic import random_batches
from colonnade.parallel.pool import RankPool

RESULTS = Path(__file__).resolve().parent / "results" / "planner_cpu.json"
EXTENDED = RESULTS.with_name("planner_cpu_extended.json")
MICRO_BATCH = 4


def layout_config(layout: Layout, w: Workload) -> Config:
    """A runnable config of ``layout`` for the tiny workload (resolved and validated)."""
    base = Config(training=TrainingConfig(steps=1000, seq_len=w.seq_len, precision="fp32",
                                          seed=1, eval_interval=0),
                  optim=OptimConfig(lr=1e-4, warmup_steps=0, clip_grad=1.0))
    cfg = layout.to_config(base, w)
    return validate(resolve(cfg, layout.world), layout.world)


def _rank_batches(cfg: Config, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_batches(cfg, seed=100 + dp_rank)


def time_layout(cfg: Config, warmup: int, steps: int) -> list[float]:
    """Run on every rank: build a Trainer, warm up, return rank 0's per-step seconds."""
    from colonnade.parallel.dims import ParallelDims
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups = ProcessGroups.build(ParallelDims.from_config(cfg.parallel, world))
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    batches = _rank_batches(cfg, groups.dp.rank)
    times = []
    for k in range(warmup + steps):
        groups.world.barrier()
        t0 = time.perf_counter()
        trainer.train_step(batches)
        groups.world.barrier()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 1.0


def adjacent_pairs(rows: list[dict], times: dict[int, list[float]], rounds: int,
                   steps: int) -> list[dict]:
    """Neighbours in the measured order: their gap, in how many rounds the per-round medians
    order them the same way (how well measured the order is), and whether the prediction
    does (a pair the rounds disagree on is a tie within this machine's noise)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i]["measured_s"])
    out = []
    for a, b in itertools.pairwise(order):
        agree = sum(statistics.median(times[a][r * steps:(r + 1) * steps])
                    < statistics.median(times[b][r * steps:(r + 1) * steps])
                    for r in range(rounds))
        out.append({"faster": rows[a]["layout"], "slower": rows[b]["layout"],
                    "gap": rows[b]["measured_s"] / rows[a]["measured_s"] - 1,
                    "rounds_agreeing": agree, "rounds": rounds,
                    "predicted_agrees": rows[a]["predicted_s"] < rows[b]["predicted_s"]})
    return out


def calibrated_cluster_from(cal: dict[str, float], w: Workload) -> tuple[Cluster, float]:
    """The cluster of a (median) calibration record, and its fitted efficiency."""
    c = calibrated_cluster(cal, cal, w, MICRO_BATCH, cal["cores"])
    return c, c.efficiency


def measure(layouts: tuple[Layout, ...], w: Workload, pools: dict[int, RankPool], rounds: int,
            warmup: int, steps: int) -> tuple[dict[int, list[float]], dict[int, list[float]],
                                              list[dict[str, float]]]:
    """Interleaved rounds, each starting with a fresh calibration (the load changes).

    Returns (kept step times per layout, that round's predictions per layout, calibrations).
    """
    cfgs = [layout_config(lay, w) for lay in layouts]
    times: dict[int, list[float]] = {i: [] for i in range(len(layouts))}
    preds: dict[int, list[float]] = {i: [] for i in range(len(layouts))}
    cals = []
    for r in range(rounds):
        cluster, cal = calibrate_cpu(w, pools, MICRO_BATCH)
        cals.append(cal)
        for i, lay in enumerate(layouts):
            preds[i].append(estimate(w, lay, cluster).step_s)
        order = list(range(len(layouts)))
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            got = pools[layouts[i].world].run(time_layout, cfgs[i], warmup, steps)[0]
            times[i].extend(got)
        print(f"  round {r + 1}/{rounds}: load {os.getloadavg()[0]:.1f}, matmul "
              f"{cal['matmul_gflops']:.0f} GFLOP/s, op {cal['op_us']:.1f} us, layer "
              f"{cal['layer_s'] * 1e3:.2f} ms, head {cal['head_s'] * 1e3:.2f} ms -> efficiency "
              f"{cal['efficiency']:.3f}/{cal['head_efficiency']:.3f}, gloo "
              f"p2p {cal['latency_us']:.0f} us, all-reduce {cal['ar_latency_us']:.0f} us, "
              f"cores {cal['cores']:.2f}, skew {cal['sync_skew_2']:.1%}/"
              f"{cal['sync_skew_4']:.1%}", flush=True)
    return times, preds, cals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help=f"default {RESULTS.name} (with --extended "
                   f"{EXTENDED.name}) in {RESULTS.parent}")
    p.add_argument("--extended", action="store_true",
                   help="also measure calibrate.MORE_TINY_LAYOUTS (recompute, interleaved, "
                   "ZB-H1, other micro-batches, ZeRO-1 alone): 16 layouts, ~2x the time")
    p.add_argument("--save-cluster", help="write the median calibration as a cluster TOML "
                   "(e.g. configs/clusters/cpu-local.toml, the cpu-local preset)")
    args = p.parse_args()
    args.json = args.json or str(EXTENDED if args.extended else RESULTS)
    w = tiny_workload(global_batch=16)
    load_before = os.getloadavg()
    layouts = tuple(dataclasses.replace(lay, micro_batch=MICRO_BATCH) for lay in TINY_LAYOUTS)
    if args.extended:
        layouts += MORE_TINY_LAYOUTS
    pools = {n: RankPool(n, timeout_s=600.0) for n in sorted({lay.world for lay in layouts})}
    try:
        times, preds, cals = measure(layouts, w, pools, args.rounds, args.warmup, args.steps)
    finally:
        for pool in pools.values():
            pool.close()
    load_after = os.getloadavg()
    median_cal = {k: statistics.median(c[k] for c in cals) for k in cals[0]}
    cluster, _ = calibrated_cluster_from(median_cal, w)
    rows = []
    for i, lay in enumerate(layouts):
        meas, pred = statistics.median(times[i]), statistics.median(preds[i])
        rows.append({"layout": lay.short(), "world": lay.world, "measured_s": meas,
                     "measured_min_s": min(times[i]), "samples": len(times[i]),
                     "predicted_s": pred, "predicted_per_round_s": preds[i],
                     "relative_error": pred / meas - 1,
                     "predicted_breakdown_s": estimate(w, lay, cluster).timing.as_dict()})
    rho = spearman([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows])
    head = f"{'layout':<44} {'ranks':>5} {'measured ms':>11} {'predicted ms':>12} {'error':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        ok = "" if abs(r["relative_error"]) <= 0.30 else "  MISS"
        print(f"{r['layout']:<44} {r['world']:>5} {r['measured_s'] * 1e3:>11.1f} "
              f"{r['predicted_s'] * 1e3:>12.1f} {r['relative_error']:>+7.1%}{ok}")
    meas_rank = [r["layout"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    pred_rank = [r["layout"] for r in sorted(rows, key=lambda r: r["predicted_s"])]
    worst = max(abs(r["relative_error"]) for r in rows)
    pairs = adjacent_pairs(rows, times, args.rounds, args.steps)
    print("neighbours in the measured order (gap, rounds agreeing, prediction agrees):")
    for q in pairs:
        print(f"  {q['faster']:<40} < {q['slower']:<40} {q['gap']:>+6.1%} "
              f"{q['rounds_agreeing']}/{q['rounds']} {'yes' if q['predicted_agrees'] else 'NO'}")
    print(f"max |error| {worst:.1%} (target 30%); Spearman rho {rho:.3f}; same ranking: "
          f"{meas_rank == pred_rank}; load average {load_before[0]:.1f} -> {load_after[0]:.1f} "
          f"on {os.cpu_count()} cores")
    out = {"cluster_median_calibration": dataclasses.asdict(cluster), "calibrations": cals,
           "workload": {"seq_len": w.seq_len, "global_batch": w.global_batch,
                        "micro_batch": MICRO_BATCH, "precision": w.precision},
           "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
           "load_average_before": load_before, "load_average_after": load_after,
           "cores": os.cpu_count(), "rows": rows, "spearman": rho,
           "max_abs_error": worst, "measured_ranking": meas_rank,
           "predicted_ranking": pred_rank, "adjacent_pairs": pairs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    if args.save_cluster:
        Path(args.save_cluster).write_text(
            f"# median of {args.rounds} calibrations by benchmarks/planner_cpu.py on this "
            "machine\n# Re-measure with: colonnade plan --calibrate --save-cluster "
            "configs/clusters/cpu-local.toml\n" + cluster_to_toml(cluster))
        print(f"wrote {args.save_cluster}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
