"""Pipeline schedules: measured bubble next to theory, stashed micro-batches, tokens/s vs torch.

    .venv/bin/python benchmarks/pipeline.py [--pp 2 4] [--microbatches 8] [--rounds 5] [--quick]
    .venv/bin/python benchmarks/pipeline.py --workload gpt2-tiny|llama-tiny [--rounds 15]

``--workload gpt2-tiny`` / ``llama-tiny`` (the peer-table workloads): FULL training steps (AdamW
inside the timed step) at pp = 2 with 4 micro-batches, Colonnade's 1f1b / interleaved_1f1b /
zb_h1 / zbv against torch.distributed.pipelining's Schedule1F1B / ScheduleInterleaved1F1B /
ScheduleZBVZeroBubble (one run, the peer of both zb_h1 and zbv) on cuts of the plain torch.nn
model, in benchmarks/pipeline_train.py (its docstring says how), written to
benchmarks/results/pipeline_<workload>.json with a top-level "rows" list. The default
``--workload layers`` is the bubble analysis below (no optimizer).

For each pp, one pool of gloo CPU ranks (1 thread each) runs every variant on the same llama
model and the same m micro-batches: Colonnade's gpipe, 1f1b, interleaved_1f1b (vp = 2), zb_h1
and zbv (vp = 2, V placement: rank r holds virtual stages r and 2p - 1 - r), and
torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (vp = 2,
same layer placement) and ScheduleZBVZeroBubble (2 V-placed stages per rank: zbv's placement;
built and timed once, the "vs torch" of both zb_h1 and zbv). A step is forward + backward of
all micro-batches (no optimizer). Variants are interleaved round by round (order rotated, and
reversed every other round) after warm-up; numbers are medians over rounds.

Step time = last rank's end - first rank's start (one machine: perf_counter is one clock);
tokens/s = m b s / step time. CPU time = process time summed over ranks (gloo threads included):
on a shared, oversubscribed machine the wall clock mostly measures the other tenants, while
CPU seconds per step measure the work each implementation does; both are compared to torch.
Bubble of a stage = idle / step = 1 - busy / step, busy = the stage's summed compute time
(F, B, W, timestamped by the executor). Theory, as idle / step:
* formula (equal stages): x / (1 + x) with x = idle / ideal = (p - 1) / m (gpipe, 1F1B),
  (p - 1) / (v m) (interleaved), (p - 1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W)) (ZB-H1,
  T_* the measured mean durations of the stages after the first); zbv has no closed form
  here: its "formula" is its action lists replayed (colonnade.pipeline.simulate.simulate,
  placement "v") with every stage at those mean chunk durations T_F, T_B, T_W (equal stages;
  ~0 for m >= 2p when T_F = T_B = T_W);
* sim: the same action lists replayed (colonnade.pipeline.simulate.timing) with each stage's
  measured mean F / B / W durations and free communication: what the schedule costs on this
  model's actual (unequal: embedding on the first stage, head + loss on the last) stages.
Peak stashed = most micro-batches (chunk-activations) whose F ran and B did not, per stage,
as counted by the executor, next to the checker's proof (check_schedule). Writes
benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from colonnade.config.choices import schedule_placement
from colonnade.config.sections import Config, ModelConfig, ParallelConfig, TrainingConfig
from colonnade.models.build import build_chunks, make_context
from colonnade.models.gpt import ModelChunk
from colonnade.models.stages import virtual_stage_layers
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPool
from colonnade.pipeline.checker import check_schedule
from colonnade.pipeline.executor import execute
from colonnade.pipeline.plan import ExecOptions, StepPlan
from colonnade.pipeline.schedules import build_schedule
from colonnade.pipeline.simulate import simulate, timing

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"
OURS = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}
"""Colonnade schedule -> virtual stages per rank (vp)."""
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
         "interleaved_1f1b": "ScheduleInterleaved1F1B", "zb_h1": "ScheduleZBVZeroBubble",
         "zbv": "ScheduleZBVZeroBubble"}
"""Colonnade schedule -> its torch.distributed.pipelining peer; a class is run once, under the
first schedule that names it (ZBV under zb_h1)."""
Batch = tuple[torch.Tensor, torch.Tensor]


def make_config(args: dict[str, Any], pp: int, vp: int, schedule: str) -> Config:
    model = ModelConfig(arch="llama", num_layers=args["layers"], hidden_size=args["hidden"],
                        num_heads=args["heads"], vocab_size=args["vocab"],
                        max_seq_len=args["seq"])
    par = ParallelConfig(pp=pp, vp=vp, dp=1, schedule=schedule)
    tr = TrainingConfig(seq_len=args["seq"], micro_batch_size=args["micro"],
                        microbatches=args["m"], precision="fp32", eval_interval=0)
    return Config(model=model, parallel=par, training=tr)


def make_batches(args: dict[str, Any]) -> list[Batch]:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, args["vocab"], (args["m"], args["micro"], args["seq"] + 1),
                         generator=gen)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _zero(modules: list[torch.nn.Module]) -> None:
    for mod in modules:
        for p in mod.parameters():
            p.grad = None


def colonnade_runner(args: dict[str, Any], groups: ProcessGroups, schedule: str
                     ) -> Callable[[], dict[str, Any]]:
    vp = OURS[schedule]
    cfg = make_config(args, groups.pp.size, vp, schedule)
    chunks = build_chunks(cfg, groups)
    batches = make_batches(args)
    opts = ExecOptions(overlap=True, record=True)

    def step() -> dict[str, Any]:
        _zero(chunks)
        res = execute(chunks, batches, StepPlan(groups, 0, schedule), options=opts)
        kinds: dict[str, list[float]] = {}
        for t in res.timeline:
            kinds.setdefault(t.action.kind.value, []).append(t.end - t.start)
        return {"busy": res.busy, "recv_wait": res.recv_wait,
                "mean": {k: statistics.mean(v) for k, v in kinds.items()},
                "peak_stashed": res.peak_stashed, "peak_pending_w": res.peak_pending_w}

    return step


def torch_runner(args: dict[str, Any], groups: ProcessGroups, schedule: str
                 ) -> Callable[[], dict[str, Any]]:
    from torch.distributed import pipelining as tpp

    p, rank, m = groups.pp.size, groups.pp_rank, args["m"]
    cfg = make_config(args, p, 2, "interleaved_1f1b")
    ctx = make_context(cfg, groups)
    if schedule in ("gpipe", "1f1b"):
        (chunk,) = build_chunks(make_config(args, p, 1, schedule), groups)
        vstages = [(rank, chunk)]
    else:
        layers = virtual_stage_layers(args["layers"], p, 2)
        ids = [rank, p + rank] if schedule == "interleaved_1f1b" else [rank, 2 * p - 1 - rank]
        vstages = [(v, ModelChunk(cfg.model, ctx, layers[v], first=v == 0, last=v == 2 * p - 1))
                   for v in ids]
    num = p if len(vstages) == 1 else 2 * p
    stages = [tpp.PipelineStage(mod, v, num, torch.device("cpu"), group=groups.pp.pg)
              for v, mod in vstages]
    vocab = args["vocab"]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), labels.t().reshape(-1))

    cls = getattr(tpp, TORCH[schedule])
    sched = (cls(stages[0], m, loss_fn=loss_fn) if len(stages) == 1
             else cls(stages, m, loss_fn=loss_fn))
    batches = make_batches(args)
    tokens = torch.cat([t for t, _ in batches])  # [m b, s]
    labels = torch.cat([lab for _, lab in batches])
    first = any(v == 0 for v, _ in vstages)
    last = any(v == num - 1 for v, _ in vstages)
    modules = [mod for _, mod in vstages]

    def step() -> dict[str, Any]:
        _zero(modules)
        inputs = (tokens,) if first else ()
        sched.step(*inputs, target=labels if last else None, losses=[] if last else None)
        return {}

    return step


def bench_rank(args: dict[str, Any]) -> dict[str, Any]:
    """On every rank: build every variant, warm up, run interleaved rounds; raw timings."""
    torch.set_num_threads(args["threads"])
    groups = ProcessGroups.build(ParallelDims(pp=args["pp"]))
    runners: dict[str, Callable[[], dict[str, Any]]] = {}
    built: set[str] = set()  # torch classes with a runner
    for sched in args["schedules"]:
        runners[f"colonnade/{sched}"] = colonnade_runner(args, groups, sched)
        if args["torch"] and TORCH[sched] not in built:  # ZBV once: zb_h1's and zbv's peer
            built.add(TORCH[sched])
            runners[f"torch/{sched}"] = torch_runner(args, groups, sched)
    names = list(runners)
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args["warmup"] + args["rounds"]):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for name in order[::-1] if r % 2 else order:  # each pair runs in both orders
            groups.world.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            info = runners[name]()
            t1, c1 = time.perf_counter(), time.process_time()
            if r >= args["warmup"]:
                out[name].append({"t0": t0, "t1": t1, "cpu": c1 - c0, **info})
    return {"stage": groups.pp_rank, "runs": out}


def _formula(schedule: str, p: int, m: int, means: dict[str, float]) -> float:
    """Textbook bubble as idle / step for equal stages (module docstring)."""
    if schedule == "zbv":
        lists = build_schedule("zbv", p, 2, m)
        sim = simulate(lists, means.get("F", 0.0), means.get("B", 0.0), means.get("W", 0.0),
                       placement="v")
        return statistics.mean(sim.bubble_fraction)
    if schedule == "interleaved_1f1b":
        x = (p - 1) / (2 * m)
    elif schedule == "zb_h1":
        tf, tb, tw = means.get("F", 0.0), means.get("B", 0.0), means.get("W", 0.0)
        x = (p - 1) * (tf + tb - tw) / (m * (tf + tb + tw))
    else:
        x = (p - 1) / m
    return x / (1 + x)


def _simulated(schedule: str, p: int, m: int, stage_means: list[dict[str, float]]) -> float:
    """Mean idle / makespan of the schedule replayed with each stage's measured durations."""
    lists = build_schedule(schedule, p, OURS[schedule], m)

    def duration(stage: int, a: Any) -> float:
        return stage_means[stage].get(a.kind.value, 0.0)

    sim = timing(lists, duration, placement=schedule_placement(schedule))
    return statistics.mean(sim.bubble_fraction)


def summarise(args: dict[str, Any], ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant: median step time and tokens/s; for Colonnade bubble, theory, peaks."""
    p, m = args["pp"], args["m"]
    tokens = m * args["micro"] * args["seq"]
    rows = []
    for name in ranks[0]["runs"]:
        impl, sched = name.split("/")
        rounds = len(ranks[0]["runs"][name])
        steps = [max(r["runs"][name][i]["t1"] for r in ranks)
                 - min(r["runs"][name][i]["t0"] for r in ranks) for i in range(rounds)]
        step = statistics.median(steps)
        cpu = statistics.median(sum(r["runs"][name][i]["cpu"] for r in ranks)
                                for i in range(rounds))
        row: dict[str, Any] = {"pp": p, "m": m, "impl": impl, "schedule": sched,
                               "torch_class": TORCH[sched] if impl == "torch" else None,
                               "step_s": step, "tokens_per_s": tokens / step,
                               "cpu_s": cpu, "tokens_per_cpu_s": tokens / cpu,
                               "step_s_all": steps}
        if impl == "colonnade":
            per_stage = sorted(ranks, key=lambda r: r["stage"])
            bubbles = [statistics.median(1 - run["busy"] / steps[i]
                                         for i, run in enumerate(r["runs"][name]))
                       for r in per_stage]
            means = [{k: statistics.median(run["mean"][k] for run in r["runs"][name])
                      for k in r["runs"][name][0]["mean"]} for r in per_stage]
            # ZB-H1's first stage has no input gradient: its B is empty and W is the whole
            # backward, so T_F, T_B, T_W of the formula come from the other stages (zbv's
            # stage 0 holds that virtual stage too, and the head: the others are typical).
            split = sched in ("zb_h1", "zbv")
            typical = means[1:] if split and len(means) > 1 else means
            overall = {k: statistics.mean(s[k] for s in typical) for k in typical[0]}
            report = check_schedule(build_schedule(sched, p, OURS[sched], m), p, OURS[sched], m,
                                    schedule_placement(sched))
            row.update({
                "bubble_measured": statistics.mean(bubbles),
                "bubble_measured_per_stage": bubbles,
                "bubble_theory_formula": _formula(sched, p, m, overall),
                "bubble_theory_sim": _simulated(sched, p, m, means),
                "mean_action_s": overall,
                "peak_stashed": [r["runs"][name][0]["peak_stashed"] for r in per_stage],
                "peak_stashed_checker": list(report.peak_in_flight),
                "peak_pending_w": [r["runs"][name][0]["peak_pending_w"] for r in per_stage],
            })
        rows.append(row)
    for row in rows:
        twin = [r for r in rows
                if r["impl"] == "torch" and r["torch_class"] == TORCH[row["schedule"]]]
        if row["impl"] == "colonnade" and twin:
            row["speedup_vs_torch"] = twin[0]["step_s"] / row["step_s"]
            row["cpu_efficiency_vs_torch"] = twin[0]["cpu_s"] / row["cpu_s"]
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'pp':>2} {'impl':9} {'schedule':17} {'tok/s':>7} {'vs torch':>8} {'tok/cpu-s':>9} "
          f"{'vs torch':>8} {'bubble':>7} "
          f"{'formula':>7} {'sim':>6} {'meas/form':>9}  peak stashed (checker)")
    for r in rows:
        line = (f"{r['pp']:>2} {r['impl']:9} {r['schedule']:17} {r['tokens_per_s']:>7.0f} "
                f"{r.get('speedup_vs_torch', float('nan')):>8.2f} {r['tokens_per_cpu_s']:>9.0f} "
                f"{r.get('cpu_efficiency_vs_torch', float('nan')):>8.2f}")
        if r["impl"] == "colonnade":
            ratio = r["bubble_measured"] / r["bubble_theory_formula"]
            line += (f" {r['bubble_measured']:>7.3f} {r['bubble_theory_formula']:>7.3f} "
                     f"{r['bubble_theory_sim']:>6.3f} {ratio:>9.2f}  {r['peak_stashed']} "
                     f"({r['peak_stashed_checker']})")
        else:
            line += f"   ({r['torch_class']})"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (15 with --workload)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (smoke test)")
    ap.add_argument("--steps", type=int, default=2, help="steps per round (--workload)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--workload", default="layers", choices=["layers", "gpt2-tiny", "llama-tiny"],
                    help="layers: the bubble analysis (no optimizer); a workload name: full "
                         "training steps of that model at pp = 2 (pipeline_train.py)")
    ap.add_argument("--peer-optimizer", default="fused", choices=["fused", "foreach"],
                    help="--workload: the torch peers' AdamW kernels")
    a = ap.parse_args()
    if a.workload != "layers":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from pipeline_train import run

        run(a.workload, 2 if a.quick else a.rounds or 15, 1 if a.quick else a.steps, a.json,
            a.peer_optimizer)
        return
    a.json, a.rounds = a.json or RESULTS, a.rounds or 3
    args = {"m": a.microbatches, "rounds": a.rounds, "warmup": a.warmup, "hidden": a.hidden,
            "layers": a.layers, "seq": a.seq, "micro": a.micro, "vocab": a.vocab, "heads": 4,
            "threads": a.threads, "torch": not a.no_torch, "schedules": list(OURS)}
    if a.quick:
        args.update(rounds=2, warmup=1, hidden=64, seq=32, vocab=128)
    rows: list[dict[str, Any]] = []
    began, load = time.perf_counter(), os.getloadavg()
    for p in a.pp:
        spec = {**args, "pp": p}
        with RankPool(p, timeout_s=900.0) as pool:
            ranks = pool.run(bench_rank, spec)
        rows += summarise(spec, ranks)
    print_table(rows)
    machine = {"cpus": os.cpu_count(), "loadavg_start": load, "loadavg_end": os.getloadavg(),
               "torch": torch.__version__, "wall_s": time.perf_counter() - began}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"args": args, "machine": machine, "rows": rows}, indent=1))
    print(f"wrote {a.json} in {machine['wall_s']:.0f} s (load average {machine['loadavg_end']})")


if __name__ == "__main__":
    main()
