"""Data parallelism side by side, dp = 2: Colonnade DDP / ZeRO-1/2/3 against torch DDP, FSDP2
and DeepSpeed ZeRO-0/1/2/3, full training steps of the same model, weights and data.

    .venv/bin/python benchmarks/data_parallel.py [--workload gpt2-tiny] [--rounds 5] [--steps 4]
        [--warmup 2] [--micro-batch 0] [--bucket N] [--zero23] [--variants ...] [--quick]
        [--json PATH]

One pool of 2 gloo CPU ranks (one compute thread each) trains a peer-table workload
(benchmarks/workloads.py: gpt2-tiny by default, or llama-tiny; fp32, AdamW at a constant lr,
no clipping, global batch split over the ranks, ``global / (2 micro_batch)`` micro-batches of
accumulation per rank) with:

  colonnade_ddp       ``Trainer.train_step`` (what ``colonnade train`` runs): all-reduce buckets
                      overlapped with backward, AdamW on the flat buffer
  colonnade_zero1     the same with parallel.use_distributed_optimizer (reduce-scatter buckets,
                      AdamW on this rank's shard, bucketed parameter all-gather)
  torch_ddp           DistributedDataParallel(plain model), no_sync while accumulating,
                      torch.optim.AdamW (foreach)
  torch_fsdp2         fully_shard per block + root, gradient sync on the last micro-batch only
  deepspeed_zero0/1/2 deepspeed.initialize(plain model, torch AdamW, ZeRO stage 0/1/2, fp32,
                      gradient_clipping 0): only when ``import deepspeed`` works (see below)
  with ``--zero23``, gradients reduce-scattered on every micro-batch:
  colonnade_zero2     --parallel.zero_stage=2 (fp32 gradient shard, no full gradient buffer)
  colonnade_zero3     --parallel.zero_stage=3 (parameters sharded, gathered per bucket ahead of
                      use in forward and backward, freed after; reshard_after_forward on)
  colonnade_zero3_no_reshard  the same with --parallel.reshard_after_forward=false
  torch_fsdp2_zero2   fully_shard(reshard_after_forward=False) per block + root (FSDP2's
                      stage-2-like mode), requires_gradient_sync on every micro-batch
  torch_fsdp2_zero3   the same with reshard_after_forward=True (FSDP2's default, stage 3)
  deepspeed_zero3     DeepSpeed ZeRO-3 (gpt2's position table, read outside its module's
                      forward, is registered as an external parameter of the root)
  (optional, ``--variants``) colonnade_ddp_no_overlap, colonnade_zero1_no_overlap, and
  baseline: the plain model and AdamW on each rank with no communication (compute floor)

The plain model and AdamW groups are workloads.py's (Colonnade's initial weights, decay on
matrices only). Every framework keeps its own default bucket sizes unless ``--bucket`` (elements)
sets Colonnade's parallel.bucket_size, DDP's bucket_cap_mb and DeepSpeed's reduce / all-gather
bucket sizes to the same bytes.

Each run builds a variant fresh, runs ``warmup`` steps (the first two are the loss check: every
variant's global mean loss must equal Colonnade DDP's to 1e-6, workloads.first_loss_check) and
times ``steps`` steps. Variants are interleaved round by round (order rotated). Reported: per
variant the median step time over rounds, steps and ranks, and tokens/s = global tokens per step
/ step time; per row of :data:`ROWS` (dp2, dp2 + ZeRO-1; with --zero23 dp2 + ZeRO-2,
ZeRO-3, ZeRO-3 no reshard) the fastest of its peers by median tokens/s and the median and
quartiles over rounds of the per-round ratio t_peer / t_colonnade (same round: drift
between rounds cancels), and the same ratio by CPU time (both ranks' process CPU seconds per
step, gloo threads included). Colonnade's wire bytes and the time blocked in dp waits come from
colonnade.parallel.comm's counters, split into parameter all-gather exposed time (ZeRO-1's
gathers, stage 3's per-bucket gathers in forward and backward) and gradient reduction exposed
time, per step.

Memory per rank (no torch.cuda on CPU): ``rss_peak_bytes``, the peak growth of the process's
resident set from before the build to the end of the timed steps; ``step_rss_peak_bytes``,
the peak during the timed steps above the resident set before them (transient: activations,
gathered parameters, gradient buckets). Every variant runs under
``colonnade.device.keep_host_pages`` (what Colonnade's CPU trainer sets): freed heap pages stay
mapped, so the RSS columns count pages first touched, and the transient column reads ~0 once
a step's peak has been touched in warm-up (benchmarks/memory_meter.py); ``state_bytes``, after
the last step, the bytes of the distinct storages
reachable from the framework's objects (parameters or shards, gradients, optimizer moments,
flat buffers), allocated whether touched or not (DeepSpeed ZeRO-3 preallocates a reduce bucket
of reduce_bucket_size elements, 5e8 by default = 2 GB fp32, of which the RSS sees only the
touched pages; ``--bucket`` sets it). For Colonnade also DataParallel.memory_bytes() (params,
grads, transient_peak, gathered_peak) and ``state_bytes_formula``, analysis.memory's ZeRO
formula: fp32 (W + G + O) = 4 + 4 + 8 bytes per parameter, O divided by dp from stage 1, G
from stage 2, W at stage 3.

DeepSpeed (../shared/PEERS.md; :data:`INSTALL` installs it) runs with DS_ACCELERATOR=cpu (set
here); without it its variants are left out and the script says how to install it.

Writes benchmarks/results/data_parallel_<workload>.json (top-level ``rows`` for
benchmarks/peer_table.py).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from memory_meter import RssPeak, state_bytes
from ratios import quartiles
from workloads import (
    WORKLOADS,
    Batch,
    Workload,
    batches,
    colonnade_config,
    first_loss_check,
    plain_loss,
    plain_model,
    plain_optimizer,
)

from colonnade.analysis.memory import model_state_bytes
from colonnade.device import keep_host_pages
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPool
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DP = 2
CORE = ("colonnade_ddp", "colonnade_zero1", "torch_ddp", "torch_fsdp2")
DEEPSPEED = ("deepspeed_zero0", "deepspeed_zero1", "deepspeed_zero2")
ZERO23 = ("colonnade_zero2", "colonnade_zero3", "colonnade_zero3_no_reshard",
          "torch_fsdp2_zero2", "torch_fsdp2_zero3")
"""Issue 15's variants (``--zero23``); deepspeed_zero3 joins them when DeepSpeed imports."""
DP_GROUPS = ("dp", "dp_cp", "zero_shard", "zero_replicate")
"""Colonnade's data-parallel comm groups (their counters are the dp traffic)."""
OPTIONAL = ("colonnade_ddp_no_overlap", "colonnade_zero1_no_overlap", "baseline")
ROWS = {  # issue 19's and issue 15's rows: layout -> (Colonnade variant, its peers)
    "dp2": ("colonnade_ddp", ("torch_ddp", "deepspeed_zero0")),
    "dp2 + ZeRO-1": ("colonnade_zero1", ("deepspeed_zero1", "deepspeed_zero2", "torch_fsdp2")),
    "dp2 + ZeRO-2": ("colonnade_zero2", ("deepspeed_zero2", "torch_fsdp2_zero2")),
    "dp2 + ZeRO-3": ("colonnade_zero3", ("deepspeed_zero3", "torch_fsdp2_zero3")),
    "dp2 + ZeRO-3 no reshard": ("colonnade_zero3_no_reshard", ("torch_fsdp2_zero2",)),
}
NAMES = {"torch_ddp": "torch DDP", "torch_fsdp2": "FSDP2", "deepspeed_zero0": "DeepSpeed ZeRO-0",
         "deepspeed_zero1": "DeepSpeed ZeRO-1", "deepspeed_zero2": "DeepSpeed ZeRO-2",
         "deepspeed_zero3": "DeepSpeed ZeRO-3",
         "torch_fsdp2_zero2": "FSDP2 reshard_after_forward=False", "torch_fsdp2_zero3": "FSDP2"}
"""Peer variant -> the name the peer table shows."""
INSTALL = ('DS_BUILD_OPS=0 .venv/bin/pip install --no-deps --no-build-isolation deepspeed && '
           '.venv/bin/pip install einops hjson msgpack ninja psutil py-cpuinfo "pydantic>=2" '
           'tqdm packaging')
StepFn = Callable[[list[Batch]], float]


@dataclass
class Built:
    """A variant ready to train on this rank."""

    step: StepFn
    """One optimizer step over the micro-batches; returns the loss (local or global mean)."""
    roots: tuple[Any, ...]
    """The framework's objects whose tensors are this rank's training state (storage
    accounting: model, optimizer, engine / trainer)."""
    groups: ProcessGroups | None = None
    """Colonnade's groups (their comm counters), None for peers."""
    is_global: bool = False
    """The step's loss is already the global mean."""


# ----------------------------------------------------------------------------- variants


def colonnade_overrides(name: str, bucket: int | None) -> list[str]:
    """The CLI overrides of a Colonnade variant: ZeRO stage (colonnade_zero<k>), overlap
    (``_no_overlap``), stage 3's reshard_after_forward (``_no_reshard``), bucket size."""
    overlap = str(not name.endswith("no_overlap")).lower()
    stage = int(name.split("zero")[1][0]) if "zero" in name else 0
    extra = [f"--parallel.use_distributed_optimizer={str(stage == 1).lower()}",
             f"--parallel.overlap_grad_reduce={overlap}",
             f"--parallel.overlap_param_gather={overlap}"]
    if stage >= 2:
        extra.append(f"--parallel.zero_stage={stage}")
    if name.endswith("no_reshard"):
        extra.append("--parallel.reshard_after_forward=false")
    if bucket:
        extra.append(f"--parallel.bucket_size={bucket}")
    return extra


def _colonnade(w: Workload, micro: int, name: str, bucket: int | None) -> Built:
    """Colonnade's Trainer on dp = 2, configured from the variant's name."""
    cfg = colonnade_config(w, micro, DP, colonnade_overrides(name, bucket))
    groups = ProcessGroups.build(ParallelDims(dp=DP))
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    return Built(lambda step: trainer.train_step(step)["loss"], (trainer,), groups, True)


def _accumulate(model: Callable[[torch.Tensor], torch.Tensor], step: list[Batch],
                before: Callable[[int], Any] | None = None) -> torch.Tensor:
    """Forward, mean loss / m, backward per micro-batch; ``before(k)`` gives a context (or
    None) entered around micro-batch k. Returns the local mean loss (detached)."""
    total = torch.zeros(())
    m = len(step)
    for k, (tokens, labels) in enumerate(step):
        ctx = before(k) if before is not None else None
        if ctx is None:
            loss = plain_loss(model(tokens), labels) / m
            loss.backward()
        else:
            with ctx:
                loss = plain_loss(model(tokens), labels) / m
                loss.backward()
        total += loss.detach()
    return total


def _torch_ddp(w: Workload, bucket: int | None) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    model = plain_model(w)
    kwargs = {"bucket_cap_mb": bucket * 4 / 2**20} if bucket else {}
    wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True, **kwargs)
    opt = plain_optimizer(model, w)

    def step(micro_batches: list[Batch]) -> float:
        last = len(micro_batches) - 1
        total = _accumulate(wrapped, micro_batches,
                            lambda k: wrapped.no_sync() if k < last else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    return Built(step, (wrapped, opt))


def _torch_fsdp2(w: Workload, reshard: bool | None = None, sync_every: bool = False) -> Built:
    """fully_shard per block + root; ``reshard`` its reshard_after_forward (None: default);
    ``sync_every``: reduce-scatter on every micro-batch (ZeRO-2/3), else on the last only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (DP,))
    model = plain_model(w)
    kwargs = {} if reshard is None else {"reshard_after_forward": reshard}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    opt = plain_optimizer(model, w)

    def step(micro_batches: list[Batch]) -> float:
        last = len(micro_batches) - 1

        def before(k: int) -> None:
            model.set_requires_gradient_sync(sync_every or k == last)

        total = _accumulate(model, micro_batches, before)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    return Built(step, (model, opt))


def _deepspeed(w: Workload, micro: int, stage: int, bucket: int | None) -> Built:
    import deepspeed
    from deepspeed.utils import groups as ds_groups

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # DeepSpeed asserts it is set
    # the rank pool re-creates the default group between runs: drop DeepSpeed's cached groups
    ds_groups._release_process_group_references(None)
    model = plain_model(w)
    opt = plain_optimizer(model, w)
    zero: dict[str, Any] = {"stage": stage}
    if bucket:
        zero |= {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
        if stage == 3:
            zero |= {"stage3_prefetch_bucket_size": bucket}
    config = {"train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": w.global_batch // (DP * micro),
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": zero, "steps_per_print": 10**9,
              "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if stage == 3 and model.pos is not None:  # read in the root's forward, not pos's own
        deepspeed.zero.register_external_parameter(model, model.pos.weight)

    def step(micro_batches: list[Batch]) -> float:
        total = torch.zeros(())
        for tokens, labels in micro_batches:
            loss = plain_loss(engine(tokens), labels)  # DeepSpeed scales by 1/m in backward
            engine.backward(loss)
            engine.step()  # applies the update at the accumulation boundary only
            total += loss.detach() / len(micro_batches)
        return float(total)

    return Built(step, (engine,))


def _baseline(w: Workload) -> Built:
    model = plain_model(w)
    opt = plain_optimizer(model, w)

    def step(micro_batches: list[Batch]) -> float:
        total = _accumulate(model, micro_batches)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    return Built(step, (model, opt))


def _build(name: str, w: Workload, micro: int, bucket: int | None) -> Built:
    if name.startswith("colonnade"):
        return _colonnade(w, micro, name, bucket)
    if name == "torch_ddp":
        return _torch_ddp(w, bucket)
    if name == "torch_fsdp2":
        return _torch_fsdp2(w)
    if name.startswith("torch_fsdp2_zero"):  # zero2: keep gathered after forward; zero3: free
        return _torch_fsdp2(w, reshard=name.endswith("3"), sync_every=True)
    if name.startswith("deepspeed_zero"):
        return _deepspeed(w, micro, int(name[-1]), bucket)
    if name == "baseline":
        return _baseline(w)
    raise ValueError(f"unknown variant {name!r}")


def run_variant(name: str, w: Workload, micro: int, warmup: int, steps: int,
                bucket: int | None) -> dict[str, Any]:
    """Rank function: build ``name`` fresh, run ``warmup`` steps (the first two give the
    global losses of the check), then time ``steps`` steps."""
    torch.set_num_threads(1)
    keep_host_pages()  # every variant under the allocator settings Colonnade's trainer uses
    gc.collect()
    rank = dist.get_rank()
    data = batches(w, warmup + steps, micro, dp=DP, rank=rank)
    rss = RssPeak()
    built = _build(name, w, micro, bucket)
    step, groups = built.step, built.groups
    losses = torch.tensor([step(b) for b in data[:warmup]], dtype=torch.float64)
    if not built.is_global:  # local means of equal token counts: the global mean is their average
        dist.all_reduce(losses)
        losses /= DP
    dist.barrier()
    if groups is not None:
        groups.stats.reset()
    times, cpu = [], []
    rss.mark()  # steady state: the timed steps' growth is their transient memory
    for b in data[warmup:]:
        start, start_cpu = time.perf_counter(), time.process_time()
        step(b)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    out: dict[str, Any] = {"name": name, "rank": rank, "times": times, "cpu": cpu,
                           "losses": losses.tolist(), "step_rss_peak_bytes": rss.step_growth(),
                           "rss_peak_bytes": rss.stop(),
                           "state_bytes": state_bytes(*built.roots)}
    if groups is not None:
        out |= comm_summary(groups.stats.snapshot(), steps)
        trainer = built.roots[0]
        out["memory_bytes"] = trainer.ddp.memory_bytes()
        out["state_bytes_formula"] = model_state_bytes(  # fp32: W + G + O = 4 + 4 + 8, sharded
            trainer.ddp.buffers.numel, DP, trainer.config.parallel.zero, "fp32")
    dist.barrier()
    return out


def comm_summary(snapshot: dict[str, dict[str, float]], steps: int) -> dict[str, float]:
    """Per step over the data-parallel groups (dp / dp_cp, and hybrid sharding's zero_shard /
    zero_replicate; not the world group's loss and flag reductions): wire bytes, exposed
    (waited) seconds, and the exposed seconds of parameter all-gathers and of gradient
    reductions separately."""
    dp = {k: v for k, v in snapshot.items() if k.split("/")[0] in DP_GROUPS}
    waited = {k: v["waited_s"] / steps for k, v in dp.items()}
    return {"wire_bytes": sum(v["wire_bytes"] for v in dp.values()) / steps,
            "exposed_s": sum(waited.values()),
            "gather_exposed_s": sum(t for k, t in waited.items() if "/all_gather" in k),
            "reduce_exposed_s": sum(t for k, t in waited.items()
                                    if "/reduce_scatter" in k or "/all_reduce" in k)}


# ----------------------------------------------------------------------------- driver


def check_losses(runs: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Every variant's first two global losses against Colonnade DDP's (1e-6); the baseline
    (no gradient exchange: its second step differs by design) only its first."""
    first = {name: results[0]["losses"][:1 if name == "baseline" else 2]
             for name, results in runs.items()}
    ref = first.get("colonnade_ddp") or next(iter(first.values()))
    for name, losses in first.items():
        for ours, theirs in zip(ref, losses, strict=False):
            try:
                first_loss_check(ours, theirs)
            except AssertionError as err:
                raise AssertionError(f"{name}: {err}") from None
    return first


def _round_medians(results: list[dict[str, Any]], key: str = "times") -> list[float]:
    """Per round: the median step time over both ranks' timed steps (``key`` "times"), or the
    median of the ranks' summed CPU seconds per step ("cpu"); results are rank-ordered."""
    out = []
    for i in range(0, len(results), DP):
        ranks = results[i:i + DP]
        if key == "cpu":
            out.append(statistics.median(sum(c) for c in zip(*(r["cpu"] for r in ranks),
                                                              strict=True)))
        else:
            out.append(statistics.median(t for r in ranks for t in r["times"]))
    return out


def summarize(runs: dict[str, list[dict[str, Any]]], w: Workload) -> dict[str, Any]:
    """Per variant medians; per issue row the fastest peer and the per-round ratios."""
    variants: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        times = [t for r in results for t in r["times"]]
        med = statistics.median(times)
        row: dict[str, Any] = {"step_s": med, "tokens_per_s": w.tokens_per_step / med,
                               "step_s_min": min(times), "samples": len(times),
                               "round_step_s": _round_medians(results),
                               "round_cpu_s": _round_medians(results, "cpu")}
        for key in ("wire_bytes", "exposed_s", "gather_exposed_s", "reduce_exposed_s",
                    "rss_peak_bytes", "step_rss_peak_bytes", "state_bytes",
                    "state_bytes_formula"):
            values = [r[key] for r in results if key in r]
            if values:
                row[key] = statistics.median(values)
        mem = [r["memory_bytes"] for r in results if "memory_bytes" in r]
        if mem:  # the largest rank's of the first run (deterministic per layout)
            row["memory_bytes"] = {k: max(m[k] for m in mem) for k in mem[0]}
        variants[name] = row
    rows = []
    for layout, (ours, peers) in ROWS.items():
        present = [p for p in peers if p in variants]
        if ours not in variants or not present:
            continue
        best = max(present, key=lambda p: variants[p]["tokens_per_s"])
        a, b = variants[ours], variants[best]
        ratios = [tp / tc for tc, tp in zip(a["round_step_s"], b["round_step_s"], strict=True)]
        cpu = [tp / tc for tc, tp in zip(a["round_cpu_s"], b["round_cpu_s"], strict=True)]
        q1, med, q3 = quartiles(ratios)
        rows.append({"layout": layout, "workload": w.name, "colonnade_variant": ours,
                     "colonnade": a["tokens_per_s"], "peer": NAMES[best], "peer_variant": best,
                     "peer_tokens_per_s": b["tokens_per_s"], "ratio": med,
                     "ratio_q1": q1, "ratio_q3": q3, "ratio_rounds": ratios,
                     "ratio_cpu": statistics.median(cpu), "ratio_cpu_rounds": cpu,
                     "others": {p: variants[p]["tokens_per_s"] for p in present if p != best},
                     **{f"{side}_{k}": v[k] for side, v in (("colonnade", a), ("peer", b))
                        for k in ("gather_exposed_s", "state_bytes", "rss_peak_bytes",
                                  "step_rss_peak_bytes") if k in v}})
    return {"variants": variants, "rows": rows}


def print_table(summary: dict[str, Any]) -> None:
    head = (f"{'variant':<28}{'step ms':>9}{'best ms':>9}{'tok/s':>9}{'MB wire':>9}"
            f"{'RSS+ MB':>9}{'step+ MB':>9}{'state MB':>9}{'exposed ms':>11}{'gather ms':>10}")
    print(head)
    print("-" * len(head))
    for name, r in summary["variants"].items():
        wire = f"{r['wire_bytes'] / 2**20:9.2f}" if "wire_bytes" in r else f"{'-':>9}"
        exp = f"{1e3 * r['exposed_s']:11.1f}" if "exposed_s" in r else f"{'-':>11}"
        gat = f"{1e3 * r['gather_exposed_s']:10.1f}" if "gather_exposed_s" in r else f"{'-':>10}"
        print(f"{name:<28}{1e3 * r['step_s']:9.1f}{1e3 * r['step_s_min']:9.1f}"
              f"{r['tokens_per_s']:9.0f}{wire}{r['rss_peak_bytes'] / 2**20:9.1f}"
              f"{r['step_rss_peak_bytes'] / 2**20:9.1f}"
              f"{r['state_bytes'] / 2**20:9.2f}{exp}{gat}")
        if "memory_bytes" in r:
            print(f"{'':<28}DataParallel.memory_bytes MB: " + ", ".join(
                f"{k} {v / 2**20:.2f}" for k, v in r["memory_bytes"].items())
                + f"; ZeRO formula state MB {r['state_bytes_formula'] / 2**20:.2f}")
    for row in summary["rows"]:
        print(f"{row['layout']:<14} colonnade {row['colonnade']:8.0f} tok/s | fastest peer "
              f"{row['peer']} {row['peer_tokens_per_s']:8.0f} | ratio {row['ratio']:.3f} "
              f"[{row['ratio_q1']:.3f}, {row['ratio_q3']:.3f}], by CPU time {row['ratio_cpu']:.3f}")


def select_variants(requested: str | None, zero23: bool = False) -> list[str]:
    """The variants to run: the default set (DeepSpeed ones when importable; issue 15's
    ZeRO-2/3 ones with ``zero23``) or ``requested``."""
    have_ds = importlib.util.find_spec("deepspeed") is not None
    if not have_ds:
        print(f"DeepSpeed is not installed: its rows are left out. To include them:\n  {INSTALL}")
    ds = (*DEEPSPEED, "deepspeed_zero3")
    if requested:
        names = requested.split(",")
        unknown = set(names) - {*CORE, *ds, *ZERO23, *OPTIONAL}
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}")
        if not have_ds and set(names) & set(ds):
            raise SystemExit("DeepSpeed variants requested but deepspeed is not installed")
        return names
    names = [*CORE, *(DEEPSPEED if have_ds else ())]
    if zero23:
        names += [*ZERO23, *(("deepspeed_zero3",) if have_ds else ())]
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt2-tiny", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help=">= 2 (the loss check)")
    parser.add_argument("--micro-batch", type=int, default=0, help="0: global batch / dp")
    parser.add_argument("--bucket", type=int, default=None,
                        help="elements per bucket for every framework (default: their own)")
    parser.add_argument("--zero23", action="store_true",
                        help=f"also run the ZeRO-2/3 variants {ZERO23} + deepspeed_zero3")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated subset of {CORE + DEEPSPEED + ZERO23 + OPTIONAL} "
                             "and deepspeed_zero3")
    parser.add_argument("--json", type=Path, default=None,
                        help="default benchmarks/results/data_parallel_<workload>.json")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 warm-up, 1 timed step")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 1, 2
    args.warmup = max(args.warmup, 2)
    w = WORKLOADS[args.workload]
    micro = args.micro_batch or w.global_batch // DP
    names = select_variants(args.variants, args.zero23)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
    with RankPool(DP, timeout_s=1800.0) as pool:
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                runs[name] += pool.run(run_variant, name, w, micro, args.warmup, args.steps,
                                       args.bucket)
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    first = check_losses(runs)
    summary = summarize(runs, w)
    print_table(summary)
    payload = {"config": {"workload": w.name, "dp": DP, "micro_batch": micro,
                          "tokens_per_step": w.tokens_per_step, "bucket_elements": args.bucket,
                          "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                          "device": "cpu (gloo, 1 thread per rank)", "torch": torch.__version__},
               "first_losses": first, **summary, "runs": runs}
    path = args.json or RESULTS_DIR / f"data_parallel_{w.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
