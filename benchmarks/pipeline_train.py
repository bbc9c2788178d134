"""Full training steps of an issue-19 workload at pp = 2: Colonnade against torch pipelining.

    .venv/bin/python benchmarks/pipeline.py --workload gpt2-tiny|llama-tiny
                                            [--rounds 15] [--steps 2] [--quick]

Two gloo CPU ranks (one thread each) train the SAME model (benchmarks/workloads.py: weights
copied out of Colonnade's single-process model, the same data, AdamW with Colonnade's
parameter groups, fp32, no clipping, no dropout) on the global batch split into 4
micro-batches (micro-batch = global batch / 4; dp = 1). One step = every micro-batch forward
and backward through the schedule, then AdamW (inside the timed step):

=================  ===============================  ==========================================
schedule           Colonnade (``Trainer``)          torch.distributed.pipelining
=================  ===============================  ==========================================
1f1b               1f1b, 2 layers per stage         Schedule1F1B, the same cut
interleaved_1f1b   interleaved_1f1b, vp = 2         ScheduleInterleaved1F1B: rank r holds
                   (rank r: chunks r, r + 2)        stages r, r + 2 (the same placement)
zb_h1              zb_h1 (vp = 1)                   ScheduleZBVZeroBubble: rank r holds stages
                                                    r, 3 - r (V placement), 1 layer each (the
                                                    issue's peer: a lower-bubble schedule);
                                                    and ScheduleInterleavedZeroBubble with one
                                                    stage per rank, the paper's ZB1P = ZB-H1
                                                    (same cut as 1f1b): row "pp2 ZB-H1 (torch
                                                    ZB1P)"
zbv                zbv, vp = 2 (rank r: chunks      the same ScheduleZBVZeroBubble variant
                   r, 3 - r: the V placement)       (one run serves both rows)
=================  ===============================  ==========================================

Colonnade's zbv places its virtual stages exactly like torch's ZBV stages: virtual stage v
holds layers [v L/4, (v + 1) L/4), rank 0 holds v = 0 (embedding) and v = 3 (final norm,
head and loss), rank 1 holds v = 1 and 2; so the two sides run the same cuts on the same
ranks, and with gpt2's tied head both keep one embedding Parameter on rank 0 (no tied
reduction). Torch variants are keyed by their class: ScheduleZBVZeroBubble is built and timed
once and is the peer of both the "pp2 ZB-H1" and the "pp2 ZB-V" row.

The torch stages are cuts of the plain model (:func:`cut`: the first holds the embedding, the
last the final norm and head; ``PipelineStage`` on the pp group). Their loss is each
micro-batch's mean cross entropy / m with ``scale_grads=False`` (the same gradient as torch's
default mean loss with ``scale_grads=True``, without its extra pass over the gradients).
gpt2's tied head: when the first and last stages sit on one rank (ZBV) the head shares the
embedding's Parameter; otherwise each holds a copy and the two gradients are all-reduced over
the pp group after the backward (Megatron's tied-embedding reduction; Colonnade does the same).
AdamW: fused kernels by default (``--peer-optimizer foreach``: PyTorch's default kernels).

The first two steps of every variant run on the same batches from the same weights; their
losses must agree with Colonnade's to 1e-5 (fp32) before anything is timed: every Colonnade
schedule's with the first schedule's, every torch variant's with each Colonnade schedule it is
the peer of (step 2 checks the first AdamW update, and so the tied-gradient reduction, too).
Variants are then interleaved round by round (order rotated, reversed every other round, ranks
barrier-aligned); a round runs ``steps`` steps of each. Step time = last rank's end - first
rank's start (one machine, one clock); CPU time = process time of both ranks (gloo threads
included).

Rows (for benchmarks/peer_table.py): per Colonnade schedule and torch peer (:func:`peers`),
``ratio`` = median over rounds of the peer's step time / Colonnade's of the same round (> 1:
Colonnade faster); ``ratio_cpu`` by CPU time. The ZB-H1 and ZB-V rows divide the same torch ZBV
timings; ZB-H1 has a second row against torch's same algorithm (ZB1P).

After the rounds each rank records a few forward-backward passes of every Colonnade schedule
(the executor's timeline, :func:`action_times`), and every schedule's action lists are replayed
with their median action times (:func:`replayed`, "replay" in the JSON). The "pp2 ZB-H1" row
(against torch's ZBV) also carries ``one_stage_bound_ms``, the least compute makespan ANY
schedule with one stage per rank can reach on these times
(:func:`colonnade.pipeline.simulate.one_stage_bound`: stage 1 waits for stage 0's first
forward, then does all its own work), next to zbv's replay; their ratio ``bound_ratio`` is
the most a one-stage-per-rank schedule can reach against the V placement here, at equal
per-action work.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from ratios import cpu_ratios, ratio_stats
from tensor_parallel_train import peer_optimizer
from torch import nn
from workloads import (
    WORKLOADS,
    Batch,
    PlainModel,
    Workload,
    batches,
    colonnade_config,
    plain_loss,
    plain_model,
)

from colonnade.config.choices import schedule_placement
from colonnade.device import keep_host_pages
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPool
from colonnade.pipeline.executor import execute
from colonnade.pipeline.plan import StepPlan
from colonnade.pipeline.schedules import build_schedule
from colonnade.pipeline.simulate import one_stage_bound, timing
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime

PP = 2
MICROBATCHES = 4
LOSS_TOL = 1e-5
REPLAY_PASSES = 5
"""Recorded forward-backward passes per Colonnade schedule after the timed rounds, whose
median action times the schedules are replayed with (:func:`replayed`)."""
"""Step-1 losses of every variant must agree with Colonnade's within this (relative, fp32)."""
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "1f1b": ("Schedule1F1B", 1, "pp2 1F1B"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "pp2 interleaved"),
    "zb_h1": ("ScheduleZBVZeroBubble", 2, "pp2 ZB-H1"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "pp2 ZB-V"),
}
"""Colonnade schedule -> (torch schedule class, torch stages per rank, peer-table layout);
schedules sharing a torch class share one torch variant (``torch/<class>``)."""
SAME_SCHEDULE_PEERS: dict[str, tuple[str, int, str]] = {
    "zb_h1": ("ScheduleInterleavedZeroBubble", 1, "pp2 ZB-H1 (torch ZB1P)"),
}
"""Extra rows where the SCHEDULES peer runs another algorithm: torch's
ScheduleInterleavedZeroBubble with one stage per rank is the paper's ZB1P, i.e. ZB-H1 itself
(the issue-19 row keeps ZBV, a lower-bubble schedule, as its peer)."""
COLONNADE_VP = {"1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}
"""Colonnade's virtual stages per rank for each schedule."""

Step = Callable[[list[Batch]], float]


# ----------------------------------------------------------------------------- torch stages


def cut(full: PlainModel, layers: range, first: bool, last: bool) -> PlainModel:
    """A copy of ``full`` holding blocks ``layers`` only, the embedding (and positions) when
    ``first``, the final norm and head when ``last`` (workloads.PlainModel runs such cuts:
    tokens or hidden [b, s, h] in, hidden or logits [b, s, V] out)."""
    stage = copy.deepcopy(full)
    stage.blocks = nn.ModuleList(stage.blocks[i] for i in layers)
    if not first:
        stage.embed, stage.pos = None, None
    if not last:
        stage.norm, stage.head = None, None
    return stage


def stage_ids(cls_name: str, rank: int, per_rank: int) -> list[int]:
    """Global stage indices rank ``rank`` holds under torch's schedule class ``cls_name`` with
    ``per_rank`` stages per rank (pp = 2)."""
    if per_rank == 1:
        return [rank]
    if cls_name == "ScheduleInterleaved1F1B":
        return [rank, PP + rank]
    return [rank, 2 * PP - 1 - rank]  # ZBV: V placement


def peers(schedule: str) -> list[tuple[str, int, str]]:
    """(torch class, stages per rank, layout) of every row of Colonnade's ``schedule``: the
    SCHEDULES peer first, then a same-algorithm peer where there is one."""
    return [SCHEDULES[schedule], *([SAME_SCHEDULE_PEERS[schedule]]
                                   if schedule in SAME_SCHEDULE_PEERS else [])]


def torch_variant(w: Workload, groups: ProcessGroups, cls_name: str, per_rank: int,
                  full: PlainModel, impl: str) -> Step:
    """One training step of torch.distributed.pipelining's schedule ``cls_name`` with
    ``per_rank`` stages per rank (AdamW with the ``impl`` kernels)."""
    from torch.distributed import pipelining as tpp
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    count = PP * per_rank
    ids = stage_ids(cls_name, groups.pp_rank, per_rank)
    size = w.layers // count
    mods = {v: cut(full, range(v * size, (v + 1) * size), v == 0, v == count - 1) for v in ids}
    tied: torch.Tensor | None = None  # this rank's copy of a tied weight split over ranks
    if w.tied and 0 in mods and count - 1 in mods:
        mods[count - 1].head.weight = mods[0].embed.weight  # type: ignore[union-attr]
    elif w.tied and 0 in mods:
        tied = mods[0].embed.weight  # type: ignore[union-attr]
    elif w.tied and count - 1 in mods:
        tied = mods[count - 1].head.weight  # type: ignore[union-attr]
    stages = [tpp.PipelineStage(mods[v], v, count, torch.device("cpu"), group=groups.pp.pg)
              for v in ids]
    m = MICROBATCHES

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return plain_loss(logits, labels) / m  # mean over the global batch after the sum

    cls = getattr(tpp, cls_name)
    single = issubclass(cls, PipelineScheduleSingle)  # takes one stage; the others a list
    sched = cls(stages[0] if single else stages, m, loss_fn=loss_fn, scale_grads=False)
    opt = peer_optimizer(nn.ModuleList(mods.values()), w, impl)
    first, last = 0 in mods, count - 1 in mods
    pg = groups.pp.pg

    def step(micro: list[Batch]) -> float:
        tokens = torch.cat([t for t, _ in micro])  # [m b, s]: torch splits it into m
        labels = torch.cat([lab for _, lab in micro])
        losses: list[torch.Tensor] | None = [] if last else None
        sched.step(*((tokens,) if first else ()), target=labels if last else None,
                   losses=losses)
        if tied is not None:
            assert tied.grad is not None
            dist.all_reduce(tied.grad, group=pg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(sum(x.item() for x in losses)) if losses else 0.0

    return step


def colonnade_trainer(w: Workload, groups: ProcessGroups, schedule: str) -> Trainer:
    """Colonnade's ``Trainer`` at pp = 2 with ``schedule``."""
    extra = [f"--parallel.pp={PP}", f"--parallel.vp={COLONNADE_VP[schedule]}",
             f"--parallel.schedule={schedule}"]
    cfg = colonnade_config(w, w.global_batch // MICROBATCHES, PP, extra)
    return Trainer(Runtime(cfg, torch.device("cpu"), groups))


def action_times(trainer: Trainer, micro: list[Batch], passes: int) -> dict[str, float]:
    """Median seconds of each compute action of this rank's stage, keyed kind and chunk ("F0",
    "B1", "W0"; B holds W where the schedule does not split it), over ``passes`` recorded
    forward-backward passes of the trainer's schedule on ``micro`` (the executor's timeline;
    no optimizer step, gradients zeroed after)."""
    options = dataclasses.replace(trainer.executor_options(), record=True)
    plan = StepPlan(trainer.groups, trainer.step, trainer.config.parallel.schedule,
                    options=options)
    seen: dict[str, list[float]] = {}
    for _ in range(passes):
        for t in execute(trainer.chunks, micro, plan).timeline:
            seen.setdefault(f"{t.action.kind.value}{t.action.chunk}", []).append(t.end - t.start)
    trainer.optimizer.zero_grad()
    return {key: statistics.median(v) for key, v in seen.items()}


# ----------------------------------------------------------------------------- ranks


def _known_everywhere(loss: float) -> float:
    """A loss only the last stage knows, summed over ranks (the others return 0)."""
    t = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0])


def _check_losses(name: str, got: list[float], ref: str, want: list[float]) -> None:
    """Raise unless variant ``name``'s first losses equal ``ref``'s within LOSS_TOL (rel.)."""
    for i, (loss, expect) in enumerate(zip(got, want, strict=True)):
        if not math.isclose(loss, expect, rel_tol=LOSS_TOL):
            raise AssertionError(f"step-{i + 1} loss of {name} {loss!r} differs from {ref}'s "
                                 f"{expect!r} beyond {LOSS_TOL:g}")


def bench_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """On each rank: build every variant, steps 1-2 (losses checked), interleaved rounds."""
    torch.set_num_threads(1)
    keep_host_pages()  # every variant under the allocator settings Colonnade's trainer uses
    w = WORKLOADS[spec["workload"]]
    groups = ProcessGroups.build(ParallelDims(pp=PP), tied_embeddings=w.tied)
    full = plain_model(w)
    steps: dict[str, Step] = {}
    refs: dict[str, list[str]] = {}  # variant -> the Colonnade variants it must agree with
    trainers = {sched: colonnade_trainer(w, groups, sched) for sched in spec["schedules"]}
    for sched, trainer in trainers.items():
        ours = f"colonnade/{sched}"
        steps[ours] = lambda micro, t=trainer: t.train_step(micro)["loss"]
        refs[ours] = [f"colonnade/{spec['schedules'][0]}"]
        for cls_name, per_rank, _ in peers(sched):
            peer = f"torch/{cls_name}"
            if peer not in steps:  # one torch variant per class (ZBV: ZB-H1's and ZB-V's peer)
                steps[peer] = torch_variant(w, groups, cls_name, per_rank, full,
                                            spec["optimizer"])
            refs.setdefault(peer, []).append(ours)
    data = batches(w, 4, w.global_batch // MICROBATCHES)
    first: dict[str, list[float]] = {}
    for name, step in steps.items():  # same weights, same batches
        first[name] = [step(data[0]), step(data[1])]
        if name.startswith("torch/"):
            first[name] = [_known_everywhere(x) for x in first[name]]
    for name, want_from in refs.items():
        for ref in want_from:
            _check_losses(name, first[name], ref, first[ref])
    names = list(steps)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    k = 2
    for r in range(spec["rounds"]):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for name in order[::-1] if r % 2 else order:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(spec["steps"]):
                steps[name](data[k % len(data)])
                k += 1
            t1, c1 = time.perf_counter(), time.process_time()
            runs[name].append({"t0": t0, "t1": t1, "cpu": c1 - c0})
    passes = spec.get("replay_passes", REPLAY_PASSES)
    actions = {sched: action_times(t, data[0], passes) for sched, t in trainers.items()}
    return {"rank": groups.rank, "stage": groups.pp_rank, "first_loss": first, "runs": runs,
            "action_s": actions}


# ----------------------------------------------------------------------------- report


def summarize(w: Workload, spec: dict[str, Any], ranks: list[dict[str, Any]]
              ) -> dict[str, Any]:
    """Per variant: per-round step and CPU times, medians, tokens/s; one row per schedule."""
    tokens, n = w.tokens_per_step, spec["steps"]
    variants: dict[str, dict[str, Any]] = {}
    for name in ranks[0]["runs"]:
        rounds = range(len(ranks[0]["runs"][name]))
        step = [(max(r["runs"][name][i]["t1"] for r in ranks)
                 - min(r["runs"][name][i]["t0"] for r in ranks)) / n for i in rounds]
        cpu = [sum(r["runs"][name][i]["cpu"] for r in ranks) / n for i in rounds]
        variants[name] = {"step_s_all": step, "cpu_s_all": cpu,
                          "step_s": statistics.median(step),
                          "tokens_per_s": tokens / statistics.median(step),
                          "tokens_per_cpu_s": tokens / statistics.median(cpu),
                          "first_losses": ranks[0]["first_loss"][name]}
    rows = []
    sims = replayed(ranks, spec["schedules"])
    for sched, (cls_name, _, layout) in ((s, p) for s in spec["schedules"] for p in peers(s)):
        a, b = variants[f"colonnade/{sched}"], variants[f"torch/{cls_name}"]
        rows.append({
            "layout": layout, "colonnade": a["tokens_per_s"],
            "peer": f"torch.distributed.pipelining {cls_name}",
            "peer_tokens_per_s": b["tokens_per_s"],
            **ratio_stats(b["step_s_all"], a["step_s_all"]),
            **cpu_ratios(ratio_stats(b["cpu_s_all"], a["cpu_s_all"])),
            **(bound_fields(sims) if (sched, cls_name) == ("zb_h1", SCHEDULES["zbv"][0])
               else {}),
        })
    return {"workload": asdict(w), "pp": PP, "microbatches": MICROBATCHES,
            "micro_batch": w.global_batch // MICROBATCHES, "tokens_per_step": tokens,
            "rows": rows, "variants": variants, "replay": sims,
            "note": "full training steps (forward, backward, AdamW), fp32, gloo, 1 thread per "
                    "rank; ratio = median over interleaved rounds of peer / Colonnade step time"}


def replayed(ranks: list[dict[str, Any]], schedules: list[str]) -> dict[str, Any]:
    """Each Colonnade schedule's action lists replayed (colonnade.pipeline.simulate.timing,
    free communication) with its own measured median action times per stage: ``replay_ms``,
    the compute-bound makespan of a step's forward-backward; ``one_stage_bound_ms``: the least
    makespan of ANY schedule with one stage per rank on zb_h1's action times
    (:func:`~colonnade.pipeline.simulate.one_stage_bound`). Empty without recorded times."""
    if not all("action_s" in r for r in ranks):
        return {}
    by_stage = [r["action_s"] for r in sorted(ranks, key=lambda r: r["stage"])]
    out: dict[str, Any] = {"replay_ms": {}}
    for sched in schedules:
        times = [stage[sched] for stage in by_stage]

        def duration(stage: int, a: Any, times: list[dict[str, float]] = times) -> float:
            return 1e3 * times[stage][f"{a.kind.value}{a.chunk}"]

        lists = build_schedule(sched, PP, COLONNADE_VP[sched], MICROBATCHES)
        out["replay_ms"][sched] = timing(lists, duration,
                                         placement=schedule_placement(sched)).makespan
    if "zb_h1" in schedules:
        split = [{kind: 1e3 * stage["zb_h1"].get(f"{kind}0", 0.0) for kind in "FBW"}
                 for stage in by_stage]
        out["one_stage_bound_ms"] = one_stage_bound(split, MICROBATCHES)
    return out


def bound_fields(sims: dict[str, Any]) -> dict[str, float]:
    """Fields of the "pp2 ZB-H1" row (against torch's ZBV): zb_h1's replay, the one-stage
    bound and zbv's replay (ms), and ``bound_ratio`` = zbv's replay / the bound: the most a
    schedule with one stage per rank can reach against the V placement at this run's action
    times (both sides' per-action work being equal)."""
    replays = sims.get("replay_ms", {})
    if "one_stage_bound_ms" not in sims or "zbv" not in replays:
        return {}
    bound = sims["one_stage_bound_ms"]
    return {"replay_ms": replays["zb_h1"], "one_stage_bound_ms": bound,
            "zbv_replay_ms": replays["zbv"], "bound_ratio": replays["zbv"] / bound}


def print_table(summary: dict[str, Any]) -> None:
    w = summary["workload"]
    print(f"pp={summary['pp']} {w['name']}: {w['layers']} layers, h={w['hidden']}, "
          f"s={w['seq_len']}, V={w['vocab']}, {summary['microbatches']} micro-batches of "
          f"{summary['micro_batch']} ({summary['tokens_per_step']} tokens/step), full steps")
    head = (f"{'variant':<30} {'step ms':>8} {'tokens/s':>9} {'tok/CPU-s':>9} "
            f"{'step-1 loss':>12} {'step-2 loss':>12}")
    print(head)
    print("-" * len(head))
    for name, v in summary["variants"].items():
        print(f"{name:<30} {1e3 * v['step_s']:>8.1f} {v['tokens_per_s']:>9.0f} "
              f"{v['tokens_per_cpu_s']:>9.0f}"
              f" {v['first_losses'][0]:>12.7f} {v['first_losses'][1]:>12.7f}")
    for row in summary["rows"]:
        print(f"{row['layout']:<16} colonnade {row['colonnade']:>6.0f} tok/s vs {row['peer']} "
              f"{row['peer_tokens_per_s']:>6.0f}: ratio {row['ratio']:.3f} (median per round), "
              f"{row['ratio_cpu']:.3f} by CPU time")
    sims = summary.get("replay", {})
    if sims:
        print("replayed with this run's median action times (ms of forward-backward compute, "
              "communication free): " + ", ".join(f"{k} {v:.1f}"
                                                  for k, v in sims["replay_ms"].items()))
    if "one_stage_bound_ms" in sims:
        print(f"no schedule with one stage per rank can take under "
              f"{sims['one_stage_bound_ms']:.1f} ms here (one_stage_bound)")
    for row in summary["rows"]:
        if "bound_ratio" in row:
            print(f"{row['layout']} vs the V placement: at most {row['bound_ratio']:.3f} for any "
                  "one-stage-per-rank schedule at equal per-action work")


def run(workload: str, rounds: int, steps: int, json_path: Path | None,
        optimizer: str = "fused") -> dict[str, Any]:
    """Run the workload benchmark on 2 ranks (torch peers' AdamW kernels ``optimizer``); print
    and write JSON; returns the summary."""
    w = WORKLOADS[workload]
    spec = {"workload": workload, "rounds": rounds, "steps": steps, "optimizer": optimizer,
            "schedules": list(SCHEDULES)}
    began, load = time.perf_counter(), os.getloadavg()
    with RankPool(PP, timeout_s=3600.0) as pool:
        ranks = pool.run(bench_rank, spec)
    summary = summarize(w, spec, ranks)
    summary["peer_optimizer"] = optimizer
    summary["machine"] = {"cpus": os.cpu_count(), "loadavg_start": load,
                          "loadavg_end": os.getloadavg(), "torch": torch.__version__,
                          "rounds": rounds, "steps_per_round": steps,
                          "wall_s": time.perf_counter() - began}
    print_table(summary)
    path = json_path or RESULTS_DIR / f"pipeline_{workload}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    print(f"wrote {path} in {summary['machine']['wall_s']:.0f} s")
    return summary
