"""Exposed expert all-to-all time of MoE training on gloo CPU ranks: how much there is to hide.

    .venv/bin/python benchmarks/moe_exposed_a2a.py [--parts layer,model] [--reps 20]
        [--rounds 5] [--steps 3] [--layouts ep2-pp1,ep4-pp1,ep2-pp2,ep4-pp2] [--hidden 64]
        [--experts 8] [--expert-ffn 128] [--seq 64] [--batch 2] [--microbatches 4]
        [--quick] [--json PATH]

The model: tiny llama, 2 layers, every layer MoE (8 experts, top-2, dropless, the
'all_to_all' dispatcher), fp32, micro-batch 2 x seq 64 = 128 tokens per rank, one compute
thread per rank; ep folded into dp (every dp rank an ep rank).

Part 1, layer (:func:`layer_rank`): one MoE layer on ep 2 and ep 4 ranks, forward and forward
+ backward, each repetition after a barrier so that the ranks start together: the exposed
all-to-all time is then the exchanges' own cost (counts + dispatch + combine forward, their
adjoints backward), not another rank's lateness. Also the forward's CPU time on the rank's
thread and over the whole process (gloo's threads included).

Part 2, model (:func:`run_variant`): ``Trainer.train_step`` in four layouts, run one after
another in every round (order rotated):

  ep2-pp1   2 ranks (dp 2)          ep4-pp1   4 ranks (dp 4)
  ep2-pp2   4 ranks (dp 2 x pp 2)   ep4-pp2   8 ranks (dp 4 x pp 2), 1F1B, m micro-batches

Per step: wall time; the ep all-to-all time the forward and the backward waited for
(exposed; every exchange is synchronous today, so in flight = exposed); their share of the
step; and ``own_ms``, what the exchanges themselves cost by part 1 (the layer's exposed
forward + backward times the MoE layers on a stage times the micro-batches): the rest of the
exposed time (``late_ms``) is waiting for ranks that arrive later at the exchange (their load,
the machine's noise, the pipeline's stagger). An overlap of the exchange with compute can hide
at most the first; the second hides behind nothing on the waiting rank.

Medians over rounds of the ranks' medians. Writes benchmarks/results/moe_exposed_a2a.json
(``--quick``: a temporary file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from workloads import Workload, batches, colonnade_config

from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPools

RESULTS = Path(__file__).resolve().parent / "results" / "moe_exposed_a2a.json"
LAYOUTS: dict[str, tuple[int, int]] = {"ep2-pp1": (2, 1), "ep4-pp1": (4, 1),
                                       "ep2-pp2": (2, 2), "ep4-pp2": (4, 2)}
"""Layout name -> (ep = dp, pp); ranks = ep x pp."""
FORWARD_OPS = ("moe_counts", "moe_dispatch", "moe_combine")
"""The forward's ep all-to-alls (the backward's carry a '_grad' suffix)."""
LAYERS = 2
"""MoE layers of the model (LAYERS / pp on a stage)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The benchmark model and batch."""

    hidden: int = 64
    experts: int = 8
    expert_ffn: int = 128
    seq: int = 64
    batch: int = 2
    microbatches: int = 4

    def workload(self, dp: int, layers: int = LAYERS) -> Workload:
        """The llama workload: 4 heads, dp x batch x microbatches samples per step."""
        return Workload(name="moe_exposed_a2a", arch="llama", hidden=self.hidden,
                        layers=layers, heads=4, kv_heads=4, vocab=256, seq_len=self.seq,
                        global_batch=dp * self.batch * self.microbatches, lr=1e-3,
                        weight_decay=0.0)


QUICK = Shape(hidden=32, experts=4, expert_ffn=32, seq=16, batch=2, microbatches=2)


def overrides(shape: Shape, ep: int, pp: int) -> list[str]:
    """The MoE and layout fields of one layout."""
    return [f"--model.num_experts={shape.experts}", "--model.moe_top_k=2",
            f"--model.moe_ffn_hidden_size={shape.expert_ffn}", f"--parallel.ep={ep}",
            f"--parallel.pp={pp}", "--parallel.moe_dispatcher=all_to_all"]


def ep_times(snap: dict[str, dict[str, float]], steps: int) -> dict[str, float]:
    """Per step: exposed seconds of the ep all-to-alls, forward and backward, and calls."""
    out = {"a2a_fwd_s": 0.0, "a2a_bwd_s": 0.0, "a2a_calls": 0.0}
    for key, v in snap.items():
        if key.startswith("ep/all_to_all/"):
            side = "a2a_fwd_s" if key.rsplit("/", 1)[-1] in FORWARD_OPS else "a2a_bwd_s"
            out[side] += v["waited_s"] / steps
            out["a2a_calls"] += v["calls"] / steps
    return out


def layer_rank(ep: int, shape: Shape, reps: int) -> dict[str, Any]:
    """Rank function, part 1: one MoE layer (module docstring); medians over ``reps``
    repetitions after one warm-up."""
    from colonnade.models.build import build_chunks

    torch.set_num_threads(1)
    cfg = colonnade_config(shape.workload(ep, layers=1), shape.batch, ep, overrides(shape, ep, 1))
    groups = ProcessGroups.build(ParallelDims.from_config(cfg.parallel, ep), experts=True)
    (chunk,) = build_chunks(cfg, groups)
    layer = next(m for m in chunk.modules() if hasattr(m, "dispatcher"))
    gen = torch.Generator().manual_seed(groups.rank)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=gen,
                    requires_grad=True)  # [b, s, h]: the batch-first residual stream
    samples: dict[str, list[float]] = {}
    for rep in range(reps + 1):
        groups.stats.reset()
        dist.barrier()
        start, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
        y = layer(x)
        mid = time.perf_counter()
        cpu, proc = time.thread_time() - cpu, time.process_time() - proc
        y.sum().backward()
        end = time.perf_counter()
        if rep:  # the first repetition warms up
            row = {"fwd_s": mid - start, "fwd_bwd_s": end - start, "fwd_thread_cpu_s": cpu,
                   "fwd_process_cpu_s": proc, **ep_times(groups.stats.snapshot(), 1)}
            for key, value in row.items():
                samples.setdefault(key, []).append(value)
    return {"rank": groups.rank, **{k: statistics.median(v) for k, v in samples.items()}}


def run_variant(name: str, shape: Shape, warmup: int, steps: int) -> dict[str, Any]:
    """Rank function, part 2: ``warmup`` + ``steps`` train steps of layout ``name``; step
    seconds and the ep all-to-all times per step."""
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    torch.set_num_threads(1)
    ep, pp = LAYOUTS[name]
    world = ep * pp
    w = shape.workload(ep)
    cfg = colonnade_config(w, shape.batch, world, overrides(shape, ep, pp))
    groups = ProcessGroups.build(ParallelDims.from_config(cfg.parallel, world), experts=True)
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    data = batches(w, warmup + steps, shape.batch, dp=ep, rank=groups.dp_rank)
    for b in data[:warmup]:
        trainer.train_step(b)
    groups.stats.reset()
    times = []
    for b in data[warmup:]:
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(b)
        times.append(time.perf_counter() - start)
    return {"name": name, "rank": groups.rank, "times": times,
            **ep_times(groups.stats.snapshot(), steps)}


# ----------------------------------------------------------------------------- summary


def layer_row(results: list[dict[str, Any]], ep: int) -> dict[str, Any]:
    """Part 1 row: the median over ranks of each rank's medians."""
    keys = [k for k in results[0] if k != "rank"]
    return {"name": f"layer-ep{ep}", "ranks": ep,
            **{k: statistics.median(r[k] for r in results) for k in keys}}


def per_round(results: list[dict[str, Any]], world: int, key: str) -> list[float]:
    """Per round (``world`` consecutive rank results): the median over ranks of ``key``
    (of a rank's median step time for 'times')."""
    out = []
    for i in range(0, len(results), world):
        ranks = results[i:i + world]
        out.append(statistics.median(statistics.median(r["times"]) if key == "times"
                                     else r[key] for r in ranks))
    return out


def model_rows(runs: dict[str, list[dict[str, Any]]], layers: dict[int, dict[str, Any]],
               shape: Shape) -> list[dict[str, Any]]:
    """Part 2 rows: medians over rounds; ``own_s`` from the part 1 row of the same ep."""
    rows = []
    for name, results in runs.items():
        ep, pp = LAYOUTS[name]
        world = ep * pp
        row: dict[str, Any] = {"name": name, "ranks": world}
        for key in ("times", "a2a_fwd_s", "a2a_bwd_s"):
            row["step_s" if key == "times" else key] = statistics.median(
                per_round(results, world, key))
        exposed = row["a2a_fwd_s"] + row["a2a_bwd_s"]
        row |= {"a2a_calls": results[0]["a2a_calls"], "share": exposed / row["step_s"]}
        layer = layers.get(ep)
        if layer is not None:
            own = (layer["a2a_fwd_s"] + layer["a2a_bwd_s"]) * (LAYERS // pp) * shape.microbatches
            row |= {"own_s": own, "late_s": max(exposed - own, 0.0)}
        rows.append(row)
    return rows


def print_tables(payload: dict[str, Any]) -> None:
    """The two tables."""
    if payload.get("layer"):
        print(f"\n{'one MoE layer':<14}{'ranks':>6}{'fwd ms':>9}{'fwd+bwd ms':>12}"
              f"{'a2a fwd ms':>12}{'a2a bwd ms':>12}{'fwd cpu ms':>12}{'+gloo cpu':>11}")
        for r in payload["layer"]:
            print(f"{r['name']:<14}{r['ranks']:>6}{r['fwd_s'] * 1e3:>9.2f}"
                  f"{r['fwd_bwd_s'] * 1e3:>12.2f}{r['a2a_fwd_s'] * 1e3:>12.2f}"
                  f"{r['a2a_bwd_s'] * 1e3:>12.2f}{r['fwd_thread_cpu_s'] * 1e3:>12.2f}"
                  f"{r['fwd_process_cpu_s'] * 1e3:>11.2f}")
    if payload.get("model"):
        print(f"\n{'training step':<14}{'ranks':>6}{'step ms':>10}{'a2a fwd ms':>12}"
              f"{'a2a bwd ms':>12}{'share':>8}{'calls':>7}{'own ms':>9}{'late ms':>9}")
        for r in payload["model"]:
            own = f"{r['own_s'] * 1e3:.2f}" if "own_s" in r else ""
            late = f"{r['late_s'] * 1e3:.2f}" if "late_s" in r else ""
            print(f"{r['name']:<14}{r['ranks']:>6}{r['step_s'] * 1e3:>10.2f}"
                  f"{r['a2a_fwd_s'] * 1e3:>12.2f}{r['a2a_bwd_s'] * 1e3:>12.2f}"
                  f"{r['share']:>8.1%}{r['a2a_calls']:>7.0f}{own:>9}{late:>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="layer,model")
    parser.add_argument("--reps", type=int, default=20, help="part 1 repetitions")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    for field in dataclasses.fields(Shape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 round, 1 step")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else Shape()
    shape = dataclasses.replace(shape, **{f.name: getattr(args, f.name)
                                          for f in dataclasses.fields(Shape)
                                          if getattr(args, f.name) is not None})
    if args.quick:
        args.rounds, args.steps, args.reps = 1, 1, 2
    if args.json is None:
        args.json = (Path(tempfile.gettempdir()) / "moe_exposed_a2a_quick.json" if args.quick
                     else RESULTS)
    names = args.layouts.split(",")
    parts = args.parts.split(",")
    payload: dict[str, Any] = {"shape": dataclasses.asdict(shape), "rounds": args.rounds,
                               "steps": args.steps, "reps": args.reps,
                               "cores": os.cpu_count(), "torch": torch.__version__}
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    layers: dict[int, dict[str, Any]] = {}
    pools = RankPools(timeout_s=1800.0)
    try:
        if "layer" in parts:
            for ep in sorted({LAYOUTS[n][0] for n in names}):
                layers[ep] = layer_row(pools.run(ep, layer_rank, ep, shape, args.reps), ep)
            payload["layer"] = list(layers.values())
        for rnd in range(args.rounds if "model" in parts else 0):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                ep, pp = LAYOUTS[name]
                runs[name] += pools.run(ep * pp, run_variant, name, shape, 1, args.steps)
            print(f"round {rnd + 1}/{args.rounds} done ({time.strftime('%X')})", flush=True)
    finally:
        pools.close()
    if "model" in parts:
        payload["model"] = model_rows(runs, layers, shape)
    print_tables(payload)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
