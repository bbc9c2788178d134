"""Where a Colonnade training step's time goes, by category, per layout (the peer table's).

Builds Colonnade's ``Trainer`` for a workload of :mod:`benchmarks.workloads` on a layout
(1 process, or 2 ranks of the rank pool with gloo, 1 thread each), runs ``--warmup`` steps, times
``--steps`` unprofiled steps (thread CPU time and wall time, rank 0), then runs ``--steps`` more
under ``torch.profiler`` on rank 0 and attributes every profiled op's *self* time to one
category:

  matmul/linear       mm, addmm, bmm, matmul, linear (forward and backward)
  attention           scaled-dot-product attention and its kernels, softmax
  loss                cross entropy / log-softmax / nll (forward and backward nodes)
  optimizer           everything under ``colonnade::optimizer`` (norm, AdamW, casts)
  communication       c10d / gloo / nccl calls and waits, and the self time of Colonnade's
                      communicating autograd functions (tp's f / g operators, sp's gathers
                      and scatters, the all-to-all: their blocking waits, which gloo does not
                      report as an op of their own)
  copies/layout       copy_, clone, contiguous, cat, transpose/permute materialised
  elementwise+norm    every other aten op (adds, GELU, norms, embedding, fills, zero_)
  autograd engine     self time of the autograd engine's node evaluation (hooks included)
  host rest           profiled step time minus all of the above (Python, plan, schedule)

An op under an ``autograd::engine`` node keeps its own category; an op under the optimizer
range counts as optimizer whatever it is. Profiler times are wall time on rank 0's main thread;
``step_cpu_ms`` / ``step_wall_ms`` are the unprofiled medians (the profiler adds overhead, which
lands mostly in "host rest"). Every category is a per-step mean over the profiled steps.

    .venv/bin/python benchmarks/profile_step.py --layout single dp2 --workload gpt2-tiny
    .venv/bin/python benchmarks/profile_step.py --layout all --label after

Results merge into ``benchmarks/results/profile_step.json`` under
``<label>/<workload>/<layout>`` (run it at two commits with two labels for a before/after).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
from workloads import WORKLOADS, Workload, batches, colonnade_config

from colonnade.config.choices import tied_across_stages
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPool
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime

RESULTS = Path(__file__).resolve().parent / "results" / "profile_step.json"
LAYOUTS: dict[str, tuple[int, int, list[str]]] = {
    # name: (world, micro-batches per rank and step, config overrides)
    "single": (1, 1, []),
    "dp2": (2, 1, []),
    "dp2-zero1": (2, 1, ["--parallel.use_distributed_optimizer=true"]),
    "tp2": (2, 1, ["--parallel.tp=2"]),
    "tp2-sp": (2, 1, ["--parallel.tp=2", "--parallel.sp=true"]),
    "pp2-1f1b": (2, 4, ["--parallel.pp=2", "--parallel.schedule=1f1b"]),
    "pp2-interleaved": (2, 4, ["--parallel.pp=2", "--parallel.vp=2",
                               "--parallel.schedule=interleaved_1f1b"]),
    "pp2-zb": (2, 4, ["--parallel.pp=2", "--parallel.schedule=zb_h1"]),
    "pp2-zbv": (2, 4, ["--parallel.pp=2", "--parallel.vp=2", "--parallel.schedule=zbv"]),
}
"""Issue 19's layouts (and ZB-V, pp2-zbv): world size, micro-batches per rank per step,
overrides."""
CATEGORIES = ("matmul/linear", "attention", "elementwise+norm", "copies/layout", "loss",
              "optimizer", "communication", "autograd engine", "host rest")
OPTIM_RANGE = "colonnade::optimizer"

_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
           "aten::baddbmm", "aten::_addmm_activation", "aten::addmv", "aten::mv", "aten::dot")
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "softmax",
              "_safe_softmax")
_LOSS = ("cross_entropy", "log_softmax", "nll_loss", "crossentropy", "logsoftmax", "nllloss")
_COMM = ("c10d", "gloo", "nccl", "record_param_comms", "all_reduce", "allreduce", "allgather",
         "all_gather", "reduce_scatter", "_reduce_scatter", "broadcast", "barrier",
         "aten::wait", "send", "recv", "work")
_COPIES = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::_to_copy",
           "aten::to", "aten::stack", "aten::_unsafe_view", "aten::reshape", "aten::permute",
           "aten::transpose", "aten::view", "aten::as_strided", "aten::t", "aten::expand",
           "aten::split", "aten::narrow", "aten::slice", "aten::select", "aten::unsqueeze",
           "aten::squeeze", "aten::flatten", "aten::detach", "aten::alias")
_ENGINE = "autograd::engine::evaluate_function"
COMM_FUNCTIONS = ("OpF", "OpG", "OpGSeq", "OpGBarSeq", "OpSplitSeq", "OpGatherLast",
                  "OpSplitLast", "GatheredLinears", "LinearReduceScatter", "OpAllToAll")
"""Colonnade's autograd functions that run a collective (forward, or backward as
"<name>Backward"): their self time is the collective's blocking wait (their matmuls and copies
are child ops with categories of their own)."""


def _leaf_category(name: str) -> str | None:
    """The category an op's name alone decides (None: elementwise unless an ancestor says)."""
    low = name.lower()
    if name.startswith(_ENGINE):
        return "autograd engine"
    if any(k in low for k in _COMM) or name.removesuffix("Backward") in COMM_FUNCTIONS:
        return "communication"
    if name in _MATMUL or low.startswith(("mmbackward", "addmmbackward", "bmmbackward")):
        return "matmul/linear"
    if any(k in low for k in _LOSS):  # before attention: log_softmax contains 'softmax'
        return "loss"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if name in _COPIES:
        return "copies/layout"
    return None


def _category(event: Any) -> str:
    """Category of one profiler event's self time (ancestors: optimizer range, loss nodes)."""
    own = _leaf_category(event.name)
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == OPTIM_RANGE:
            return "optimizer"
        if own is None and _leaf_category(parent.name) == "loss":
            own = "loss"
        parent = parent.cpu_parent
    return own or "elementwise+norm"


def categorize(events: list[Any], steps: int, step_ms: float) -> dict[str, float]:
    """Per-step ms per category from the profiler's function events; 'host rest' is
    ``step_ms`` (profiled, per step) minus every op's self time."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.name == OPTIM_RANGE:
            continue
        out[_category(event)] += event.self_cpu_time_total / 1e3 / steps
    out["host rest"] = max(0.0, step_ms - sum(out.values()))
    return out


def _instrument(trainer: Trainer) -> None:
    """Wrap the optimizer's step in the ``colonnade::optimizer`` range (this process only)."""
    step: Callable[[], dict[str, float]] = trainer.optimizer.step

    def ranged() -> dict[str, float]:
        with record_function(OPTIM_RANGE):
            return step()

    trainer.optimizer.step = ranged  # type: ignore[method-assign]


def run_layout(workload: str, layout: str, warmup: int, steps: int) -> dict[str, Any]:
    """Rank function (or the single process): build, warm up, time, profile on rank 0."""
    torch.set_num_threads(1)
    world, micro, extra = LAYOUTS[layout]
    w: Workload = WORKLOADS[workload]
    cfg = _config(w, world, micro, extra)
    if world == 1:
        groups = ProcessGroups.single()
    else:
        dims = ParallelDims.from_config(cfg.parallel, world)
        groups = ProcessGroups.build(dims, cfg.parallel.timeout_s,
                                     tied_embeddings=tied_across_stages(
                                         cfg.model.tie_embeddings, cfg.parallel.schedule))
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    dp, dp_rank = groups.dp_cp.size, groups.dp_rank
    data = batches(w, warmup + 2 * steps, w.global_batch // (dp * micro), dp=dp, rank=dp_rank)
    for b in data[:warmup]:
        trainer.train_step(b)
    cpu, wall = [], []
    for b in data[warmup:warmup + steps]:
        c0, w0 = time.thread_time(), time.perf_counter()
        trainer.train_step(b)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    _instrument(trainer)
    profiled = data[warmup + steps:]
    rank0 = groups.rank == 0
    out: dict[str, Any] = {"rank": groups.rank, "step_cpu_ms": 1e3 * statistics.median(cpu),
                           "step_wall_ms": 1e3 * statistics.median(wall)}
    if rank0:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            w0 = time.perf_counter()
            for b in profiled:
                trainer.train_step(b)
            profiled_ms = 1e3 * (time.perf_counter() - w0) / steps
        out["categories_ms"] = categorize(list(prof.events()), steps, profiled_ms)
        out["profiled_step_ms"] = profiled_ms
        top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        out["top_ops"] = top
    else:
        for b in profiled:
            trainer.train_step(b)
    if world > 1:
        dist.barrier()
    return out


def _config(w: Workload, world: int, micro: int, extra: list[str]) -> Any:
    tp_pp = 2 if any(e.startswith(("--parallel.tp=", "--parallel.pp=")) for e in extra) else 1
    dp = world // tp_pp
    return colonnade_config(w, w.global_batch // (dp * micro), world, extra)


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """One column per layout, one row per category (ms per step on rank 0)."""
    names = list(results)
    print(f"{'ms / step (rank 0)':<20}" + "".join(f"{n:>16}" for n in names))
    for cat in CATEGORIES:
        print(f"{cat:<20}" + "".join(f"{results[n]['categories_ms'][cat]:16.1f}" for n in names))
    for key in ("profiled_step_ms", "step_wall_ms", "step_cpu_ms"):
        print(f"{key:<20}" + "".join(f"{results[n][key]:16.1f}" for n in names))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", nargs="+", default=["single"],
                   choices=[*LAYOUTS, "all"], help="layouts to profile ('all': every one)")
    p.add_argument("--workload", default="gpt2-tiny", choices=list(WORKLOADS))
    p.add_argument("--steps", type=int, default=5, help="timed steps, then as many profiled")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--label", default="current", help="key of this run in the JSON")
    p.add_argument("--top", action="store_true", help="print rank 0's top ops per layout")
    p.add_argument("--json", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    layouts = list(LAYOUTS) if "all" in args.layout else args.layout
    results: dict[str, dict[str, Any]] = {}
    pool: RankPool | None = None
    try:
        for layout in layouts:
            if LAYOUTS[layout][0] == 1:
                res = run_layout(args.workload, layout, args.warmup, args.steps)
            else:
                if pool is None:
                    pool = RankPool(2, timeout_s=1800.0)
                res = pool.run(run_layout, args.workload, layout, args.warmup, args.steps)[0]
            results[layout] = res
            if args.top:
                print(f"--- {layout}\n{res['top_ops']}")
    finally:
        if pool is not None:
            pool.close()
    print_table(results)
    stored = json.loads(args.json.read_text()) if args.json.exists() else {}
    for layout, res in results.items():
        res = {k: v for k, v in res.items() if k != "top_ops"}
        stored.setdefault(args.label, {}).setdefault(args.workload, {})[layout] = res
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.json} [{args.label}/{args.workload}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
