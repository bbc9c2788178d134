"""Muon against AdamW on the tiny GPT-2 workload, on CPU: step time, the Newton-Schulz share of
the step, the bytes the Muon exchange moves, and the loss after N steps from the same seed.

    .venv/bin/python benchmarks/muon.py [--workload gpt2-tiny] [--pairs 20] [--warmup 3]
        [--ns-repeats 20] [--exchange-steps 3] [--loss-steps 200] [--data DIR] [--quick]
        [--json PATH]

Four measurements, each side by side in one run (this machine is noisy: medians and ratios):

* step time: one process, one thread, ``Trainer.train_step`` (what ``colonnade train`` runs)
  with ``optim.name=adamw`` and ``optim.name=muon``, same initial weights and batches; single
  steps alternate (order swapped every pair) after a warm-up; per side the median step time,
  and the median and quartiles of the per-pair ratio t_muon / t_adamw;
* Newton-Schulz share: NS (``colonnade.optim.muon.newton_schulz``, ``optim.muon_ns_steps``
  iterations, fp32) of every Muon matrix of the model (``muon_matrices``: the shapes one
  optimizer step orthogonalises), each timed alone (median of ``--ns-repeats``), summed per
  step and divided by the median Muon step;
* exchange bytes: tp2 x dp2 with ZeRO-1 on 4 gloo ranks (every Muon matrix split in 4 pieces:
  its tp shards, each split over dp by the bucket ranges): wire bytes per step summed over all
  ranks and groups (``CommStats``), Muon minus AdamW (the same gradient reductions and
  parameter gathers otherwise), against the theory: the owner of a matrix of n elements of e
  bytes receives the pieces it lacks and sends each holder its piece of the result back, 2 (n
  - n_owner) e; the exchange's own per-rank formula (``DistributedOrthogonalizer.
  exchange_elements``: its plan's owners and piece sizes, every stage), summed over ranks,
  should equal the count; and no exchange that orthogonalises each matrix on one rank can move
  less than 2 (n - the largest piece) e per matrix (the bound, from the pieces every rank
  reports);
* loss after N steps: both optimizers from the same seed on the same data (``--data``: a
  prepared dataset, e.g. `colonnade prepare --model.vocab_size=1024
  --data.prepared_dir=DIR`; default: uniform random tokens, which no optimizer can learn):
  the mean training loss of the last 10 steps, the final step's, and the validation loss
  (``Trainer.evaluate``) with real data. The workload's constant LR and weight decay serve
  both (``optim.muon_scale='match_adamw'`` makes AdamW's values carry over).

Prints a table and writes benchmarks/results/muon_<workload>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from ratios import quartiles
from workloads import WORKLOADS, Batch, Workload, batches, colonnade_config

from colonnade.config.sections import Config
from colonnade.optim.muon import muon_matrices, newton_schulz
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import spawn_ranks
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime, build_data

RESULTS_DIR = Path(__file__).resolve().parent / "results"
OPTIMIZERS = ("adamw", "muon")
EXCHANGE_LAYOUT = ("--parallel.tp=2", "--parallel.zero_stage=1")
"""The exchange's layout on 4 ranks: tp2 x dp2 (dp derived), ZeRO-1."""
EXCHANGE_WORLD = 4
EXCHANGE_DP = 2
LAST = 10
"""Steps whose mean training loss is reported."""
StepFn = Callable[[list[Batch]], float]


def config_of(w: Workload, micro: int, name: str, world: int = 1,
              extra: tuple[str, ...] = ()) -> Config:
    """The workload's validated config with ``optim.name=name``."""
    return colonnade_config(w, micro, world, [f"--optim.name={name}", *extra])


def trainer_of(cfg: Config, groups: ProcessGroups | None = None, data: Any = None) -> Trainer:
    """A Trainer of ``cfg`` on this process's groups (one process: the single groups)."""
    return Trainer(Runtime(cfg, torch.device("cpu"), groups or ProcessGroups.single()), data)


# ----------------------------------------------------------------------------- step time


def step_times(w: Workload, micro: int, pairs: int, warmup: int) -> dict[str, Any]:
    """Alternated single steps of both optimizers (see the module docstring)."""
    torch.set_num_threads(1)
    sides: dict[str, StepFn] = {}
    for name in OPTIMIZERS:
        trainer = trainer_of(config_of(w, micro, name))
        sides[name] = lambda b, t=trainer: t.train_step(b)["loss"]
    data = batches(w, max(8, warmup), micro)
    first = {n: fn(data[0]) for n, fn in sides.items()}  # the same weights: the same loss
    if abs(first["muon"] - first["adamw"]) > 1e-6 * abs(first["adamw"]):
        raise AssertionError(f"first losses differ: {first}")
    for i in range(warmup):
        for fn in sides.values():
            fn(data[(i + 1) % len(data)])
    times: dict[str, list[float]] = {n: [] for n in sides}
    for i in range(pairs):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in order:
            start = time.perf_counter()
            sides[name](data[i % len(data)])
            times[name].append(time.perf_counter() - start)
    ratios = [m / a for m, a in zip(times["muon"], times["adamw"], strict=True)]
    q1, med, q3 = quartiles(ratios)
    return {"pairs": pairs, "warmup": warmup, "first_loss": first["adamw"],
            "step_s": {n: statistics.median(t) for n, t in times.items()},
            "ratio": med, "ratio_q1": q1, "ratio_q3": q3, "ratio_rounds": ratios,
            "times_s": times}


# ----------------------------------------------------------------------------- Newton-Schulz


def muon_shapes(w: Workload, micro: int) -> list[tuple[int, int]]:
    """[A, B] of every Muon matrix one step orthogonalises (one per expert of a stack)."""
    trainer = trainer_of(config_of(w, micro, "muon"))
    out: list[tuple[int, int]] = []
    for chunk in trainer.chunks:
        for p in chunk.parameters():
            found = muon_matrices(p)
            if found is not None:
                out += [found.shape] * found.count
    return out


def ns_time(w: Workload, micro: int, repeats: int, ns_steps: int) -> dict[str, Any]:
    """NS of every Muon matrix, each shape timed alone (median of ``repeats``), summed."""
    torch.set_num_threads(1)
    shapes = muon_shapes(w, micro)
    gen = torch.Generator().manual_seed(0)
    per_shape: dict[str, float] = {}
    for a, b in sorted(set(shapes)):
        u = torch.randn(a, b, generator=gen)  # [A, B] fp32
        newton_schulz(u, ns_steps)  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            newton_schulz(u, ns_steps)
            seconds.append(time.perf_counter() - start)
        per_shape[f"{a}x{b}"] = statistics.median(seconds)
    total = sum(per_shape[f"{a}x{b}"] for a, b in shapes)
    return {"matrices": len(shapes), "elements": sum(a * b for a, b in shapes),
            "ns_steps": ns_steps, "per_shape_s": per_shape, "per_step_s": total}


# ----------------------------------------------------------------------------- exchange bytes


def exchange_rank(w: Workload, micro: int, name: str, steps: int) -> dict[str, Any]:
    """Rank function: tp2 x dp2 ZeRO-1 Trainer of ``name``; one untimed step, then the wire
    bytes of ``steps`` steps per (group/op) key, per step."""
    torch.set_num_threads(1)
    cfg = config_of(w, micro, name, EXCHANGE_WORLD, EXCHANGE_LAYOUT)
    par = cfg.parallel
    groups = ProcessGroups.build(ParallelDims(tp=par.tp, pp=par.pp, dp=int(par.dp or 1)))
    trainer = trainer_of(cfg, groups)
    data = batches(w, steps + 1, micro, dp=groups.dp.size, rank=groups.dp.rank)
    trainer.train_step(data[0])
    groups.stats.reset()
    for step in data[1:]:
        trainer.train_step(step)
    snap = groups.stats.snapshot()
    muon = trainer.optimizer.muon
    formula = getattr(muon.orthogonalizer, "exchange_elements", None) if muon else None
    sent = sum(a for a, _ in formula().values()) if formula is not None else 0
    pieces = [(s.param.sharding.key, s.index, s.hi - s.lo,
               math.prod(found.shape) if (found := muon_matrices(s.param)) else 0)
              for s in (muon.slots if muon else [])]
    return {"rank": groups.world.rank, "formula_sent_elements": sent, "pieces": pieces,
            "wire_bytes": {k: v["wire_bytes"] / steps for k, v in snap.items()},
            "payload_bytes": {k: v["payload_bytes"] / steps for k, v in snap.items()},
            "calls": {k: v["calls"] / steps for k, v in snap.items()}}


def exchange_bound(pieces: list[tuple[str, int | None, int, int]], elem: int) -> float:
    """Bytes per step over all ranks that no one-owner exchange can go below: each matrix's
    elements not in its largest piece go to the owner and back, 2 (n - max piece) e.
    ``pieces``: (key, expert index, piece elements, matrix elements n) from every rank."""
    largest: dict[tuple[str, int | None], int] = {}
    size: dict[tuple[str, int | None], int] = {}
    for key, index, count, n in pieces:
        largest[(key, index)] = max(largest.get((key, index), 0), count)
        size[(key, index)] = n
    return float(sum(2 * (size[m] - largest[m]) * elem for m in size))


def exchange_bytes(w: Workload, micro: int, steps: int) -> dict[str, Any]:
    """Both optimizers on 4 ranks; Muon minus AdamW wire bytes against the theory."""
    micro = min(micro, w.global_batch // EXCHANGE_DP)  # a dp rank's share at most
    per: dict[str, list[dict[str, Any]]] = {
        name: spawn_ranks(EXCHANGE_WORLD, exchange_rank, w, micro, name, steps, timeout_s=900)
        for name in OPTIMIZERS}
    totals = {name: sum(sum(r["wire_bytes"].values()) for r in rs) for name, rs in per.items()}
    keys: dict[str, float] = {}
    for name, sign in (("muon", 1.0), ("adamw", -1.0)):
        for r in per[name]:
            for k, v in r["wire_bytes"].items():
                keys[k] = keys.get(k, 0.0) + sign * v
    extra = {k: v for k, v in keys.items() if abs(v) > 0.5}
    bound = exchange_bound([tuple(p) for r in per["muon"] for p in r["pieces"]], 4)
    formula = 4 * sum(r["formula_sent_elements"] for r in per["muon"])
    measured = totals["muon"] - totals["adamw"]
    return {"layout": "tp2 x dp2 ZeRO-1, 4 ranks", "steps": steps,
            "wire_bytes_per_step": totals, "muon_extra_bytes": measured,
            "muon_extra_by_key": extra, "bound_bytes": bound, "formula_bytes": formula,
            "measured_over_bound": measured / bound if bound else float("nan"),
            "measured_over_formula": measured / formula if formula else float("nan"),
            "per_rank": per}


# ----------------------------------------------------------------------------- loss after N


def corpus_trainer(w: Workload, micro: int, name: str, data_dir: Path, steps: int) -> Trainer:
    """A Trainer of ``name`` that reads the prepared dataset ``data_dir`` (its sampler: the
    workload's seed, so both optimizers see the same samples in the same order)."""
    cfg = config_of(w, micro, name, extra=(f"--data.prepared_dir={data_dir}",
                                           f"--training.steps={steps}"))
    return trainer_of(cfg, data=build_data(cfg, ProcessGroups.single()))


def loss_after(w: Workload, micro: int, steps: int, data_dir: Path | None) -> dict[str, Any]:
    """Train both optimizers ``steps`` steps from the same weights on the same data."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"steps": steps,
                           "data": str(data_dir) if data_dir else "uniform random tokens"}
    fixed = batches(w, steps, micro, seed=1) if data_dir is None else None
    for name in OPTIMIZERS:
        if data_dir is None:
            trainer = trainer_of(config_of(w, micro, name))
            assert fixed is not None
            losses = [trainer.train_step(b)["loss"] for b in fixed]
            valid = None
        else:
            trainer = corpus_trainer(w, micro, name, data_dir, steps)
            losses = [trainer.train_step(trainer.next_batches())["loss"] for _ in range(steps)]
            valid = trainer.evaluate()
        out[name] = {"last_mean": statistics.fmean(losses[-LAST:]), "final": losses[-1],
                     "valid": valid, "losses": losses}
    return out


# ----------------------------------------------------------------------------- driver


def run(w: Workload, micro: int, pairs: int, warmup: int, ns_repeats: int,
        exchange_steps: int, loss_steps: int, data_dir: Path | None) -> dict[str, Any]:
    """Every measurement of the module docstring (``exchange_steps`` 0 leaves the exchange
    out; ``loss_steps`` 0 the loss)."""
    ns_steps = config_of(w, micro, "muon").optim.muon_ns_steps
    out: dict[str, Any] = {"workload": w.name, "micro_batch": micro,
                           "tokens_per_step": w.tokens_per_step, "device": "cpu",
                           "torch": torch.__version__, "threads": 1}
    out["step_time"] = step_times(w, micro, pairs, warmup)
    ns = ns_time(w, micro, ns_repeats, ns_steps)
    ns["share_of_muon_step"] = ns["per_step_s"] / out["step_time"]["step_s"]["muon"]
    out["newton_schulz"] = ns
    if exchange_steps:
        out["exchange"] = exchange_bytes(w, micro, exchange_steps)
    if loss_steps:
        out["loss"] = loss_after(w, micro, loss_steps, data_dir)
    return out


def table(res: dict[str, Any]) -> str:
    """The printed summary."""
    st, ns = res["step_time"], res["newton_schulz"]
    lines = [f"workload {res['workload']} ({res['tokens_per_step']} tokens/step), 1 process, "
             "1 thread, CPU",
             f"step time   adamw {st['step_s']['adamw'] * 1e3:8.1f} ms   muon "
             f"{st['step_s']['muon'] * 1e3:8.1f} ms   muon/adamw {st['ratio']:.3f} "
             f"[{st['ratio_q1']:.3f}, {st['ratio_q3']:.3f}] ({st['pairs']} pairs)",
             f"Newton-Schulz {ns['matrices']} matrices, {ns['elements']:,} elements: "
             f"{ns['per_step_s'] * 1e3:.1f} ms/step = {ns['share_of_muon_step']:.1%} of the "
             "Muon step"]
    if "exchange" in res:
        ex = res["exchange"]
        lines.append(f"exchange    {ex['layout']}: Muon adds {ex['muon_extra_bytes']:,.0f} "
                     f"wire bytes/step (all ranks); the exchange's formula "
                     f"{ex['formula_bytes']:,.0f} ({ex['measured_over_formula']:.3f}x); one-owner "
                     f"bound {ex['bound_bytes']:,.0f} ({ex['measured_over_bound']:.3f}x)")
    if "loss" in res:
        lo = res["loss"]
        for name in OPTIMIZERS:
            r = lo[name]
            valid = f", valid {r['valid']:.4f}" if r["valid"] is not None else ""
            lines.append(f"loss        {name:<5} after {lo['steps']} steps: final "
                         f"{r['final']:.4f}, mean of last {LAST} {r['last_mean']:.4f}{valid}")
        lines.append(f"            data: {lo['data']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="gpt2-tiny", choices=sorted(WORKLOADS))
    p.add_argument("--pairs", type=int, default=20, help="timed steps per optimizer")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=0, help="0: the whole global batch")
    p.add_argument("--ns-repeats", type=int, default=20)
    p.add_argument("--exchange-steps", type=int, default=3, help="0: no exchange run")
    p.add_argument("--loss-steps", type=int, default=200, help="0: no loss run")
    p.add_argument("--data", default=None, help="a prepared dataset for the loss run")
    p.add_argument("--quick", action="store_true",
                   help="5 pairs, 1 warm-up, 5 NS repeats, 1 exchange step, 20 loss steps")
    p.add_argument("--json", default=None, help="default benchmarks/results/muon_<workload>.json")
    args = p.parse_args(argv)
    if args.quick:
        args.pairs, args.warmup, args.ns_repeats = 5, 1, 5
        args.exchange_steps, args.loss_steps = min(args.exchange_steps, 1), min(args.loss_steps,
                                                                                20)
    w = WORKLOADS[args.workload]
    res = run(w, args.micro_batch or w.global_batch, args.pairs, args.warmup, args.ns_repeats,
              args.exchange_steps, args.loss_steps, Path(args.data) if args.data else None)
    print(table(res))
    path = Path(args.json or RESULTS_DIR / f"muon_{w.name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
