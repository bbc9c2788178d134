"""Data parallelism side by side, dp = 2: Colonnade DDP / ZeRO-1 against torch DDP, FSDP2 and
DeepSpeed ZeRO-0/1/2, full training steps of the same model, weights and data.

    .venv/bin/python benchmarks/data_parallel.py [--workload gpt2-tiny] [--rounds 5] [--steps 4]
        [--warmup 2] [--micro-batch 0] [--bucket N] [--variants ...] [--quick] [--json PATH]

One pool of 2 gloo CPU ranks (one compute thread each) trains issue 19's workload
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
/ step time; per issue row (dp2: Colonnade DDP vs torch DDP, DeepSpeed ZeRO-0; dp2 + ZeRO-1:
Colonnade ZeRO-1 vs DeepSpeed ZeRO-1/2, FSDP2) the fastest peer by median tokens/s and the
median and quartiles over rounds of the per-round ratio t_peer / t_colonnade (same round: drift
between rounds cancels), and the same ratio by CPU time (both ranks' process CPU seconds per
step, gloo threads included). Colonnade's wire bytes and the time blocked in dp waits come from
colonnade.parallel.comm's counters.

DeepSpeed (../shared/PEERS.md): ``DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation
deepspeed`` then ``pip install einops hjson msgpack ninja psutil py-cpuinfo "pydantic>=2" tqdm
packaging``; it runs with DS_ACCELERATOR=cpu (set here). Without it the DeepSpeed variants are
left out and the script says how to install it.

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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned ranks
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
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

from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPool
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DP = 2
CORE = ("colonnade_ddp", "colonnade_zero1", "torch_ddp", "torch_fsdp2")
DEEPSPEED = ("deepspeed_zero0", "deepspeed_zero1", "deepspeed_zero2")
OPTIONAL = ("colonnade_ddp_no_overlap", "colonnade_zero1_no_overlap", "baseline")
ROWS = {  # issue 19's rows: layout -> (Colonnade variant, its peers)
    "dp2": ("colonnade_ddp", ("torch_ddp", "deepspeed_zero0")),
    "dp2 + ZeRO-1": ("colonnade_zero1", ("deepspeed_zero1", "deepspeed_zero2", "torch_fsdp2")),
}
NAMES = {"torch_ddp": "torch DDP", "torch_fsdp2": "FSDP2", "deepspeed_zero0": "DeepSpeed ZeRO-0",
         "deepspeed_zero1": "DeepSpeed ZeRO-1", "deepspeed_zero2": "DeepSpeed ZeRO-2"}
"""Peer variant -> the name the peer table shows."""
INSTALL = ('DS_BUILD_OPS=0 .venv/bin/pip install --no-deps --no-build-isolation deepspeed && '
           '.venv/bin/pip install einops hjson msgpack ninja psutil py-cpuinfo "pydantic>=2" '
           'tqdm packaging')
StepFn = Callable[[list[Batch]], float]


class RssPeak:
    """Samples this process's resident set every millisecond; ``stop`` gives peak - start."""

    def __init__(self) -> None:
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        """Stop sampling; returns the peak growth in bytes."""
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._rss()) - self.start


# ----------------------------------------------------------------------------- variants


def _colonnade(w: Workload, micro: int, name: str, bucket: int | None
               ) -> tuple[StepFn, ProcessGroups]:
    """Colonnade's Trainer on dp = 2; ZeRO-1 and overlap from the variant's name."""
    overlap = str(not name.endswith("no_overlap")).lower()
    extra = [f"--parallel.use_distributed_optimizer={str('zero1' in name).lower()}",
             f"--parallel.overlap_grad_reduce={overlap}",
             f"--parallel.overlap_param_gather={overlap}"]
    if bucket:
        extra.append(f"--parallel.bucket_size={bucket}")
    cfg = colonnade_config(w, micro, DP, extra)
    groups = ProcessGroups.build(ParallelDims(dp=DP))
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    return (lambda step: trainer.train_step(step)["loss"]), groups


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


def _torch_ddp(w: Workload, bucket: int | None) -> StepFn:
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

    return step


def _torch_fsdp2(w: Workload) -> StepFn:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (DP,))
    model = plain_model(w)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = plain_optimizer(model, w)

    def step(micro_batches: list[Batch]) -> float:
        last = len(micro_batches) - 1

        def before(k: int) -> None:
            model.set_requires_gradient_sync(k == last)

        total = _accumulate(model, micro_batches, before)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    return step


def _deepspeed(w: Workload, micro: int, stage: int, bucket: int | None) -> StepFn:
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
    config = {"train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": w.global_batch // (DP * micro),
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": zero, "steps_per_print": 10**9,
              "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(micro_batches: list[Batch]) -> float:
        total = torch.zeros(())
        for tokens, labels in micro_batches:
            loss = plain_loss(engine(tokens), labels)  # DeepSpeed scales by 1/m in backward
            engine.backward(loss)
            engine.step()  # applies the update at the accumulation boundary only
            total += loss.detach() / len(micro_batches)
        return float(total)

    return step


def _baseline(w: Workload) -> StepFn:
    model = plain_model(w)
    opt = plain_optimizer(model, w)

    def step(micro_batches: list[Batch]) -> float:
        total = _accumulate(model, micro_batches)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    return step


def _build(name: str, w: Workload, micro: int, bucket: int | None
           ) -> tuple[StepFn, ProcessGroups | None, bool]:
    """(step, Colonnade's groups or None, whether the step's loss is already global)."""
    if name.startswith("colonnade"):
        step, groups = _colonnade(w, micro, name, bucket)
        return step, groups, True
    if name == "torch_ddp":
        return _torch_ddp(w, bucket), None, False
    if name == "torch_fsdp2":
        return _torch_fsdp2(w), None, False
    if name.startswith("deepspeed_zero"):
        return _deepspeed(w, micro, int(name[-1]), bucket), None, False
    if name == "baseline":
        return _baseline(w), None, False
    raise ValueError(f"unknown variant {name!r}")


def run_variant(name: str, w: Workload, micro: int, warmup: int, steps: int,
                bucket: int | None) -> dict[str, Any]:
    """Rank function: build ``name`` fresh, run ``warmup`` steps (the first two give the
    global losses of the check), then time ``steps`` steps."""
    torch.set_num_threads(1)
    gc.collect()
    rank = dist.get_rank()
    data = batches(w, warmup + steps, micro, dp=DP, rank=rank)
    rss = RssPeak()
    step, groups, is_global = _build(name, w, micro, bucket)
    losses = torch.tensor([step(b) for b in data[:warmup]], dtype=torch.float64)
    if not is_global:  # local means of equal token counts: the global mean is their average
        dist.all_reduce(losses)
        losses /= DP
    dist.barrier()
    if groups is not None:
        groups.stats.reset()
    times, cpu = [], []
    for b in data[warmup:]:
        start, start_cpu = time.perf_counter(), time.process_time()
        step(b)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    out: dict[str, Any] = {"name": name, "rank": rank, "times": times, "cpu": cpu,
                           "losses": losses.tolist(), "rss_peak_bytes": rss.stop()}
    if groups is not None:
        dp = {k: v for k, v in groups.stats.snapshot().items() if k.startswith("dp_cp/")}
        out["wire_bytes"] = sum(v["wire_bytes"] for v in dp.values()) / steps
        out["exposed_s"] = sum(v["waited_s"] for v in dp.values()) / steps
    dist.barrier()
    return out


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


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3); all three the median for fewer than two values."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


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
        for key in ("wire_bytes", "exposed_s", "rss_peak_bytes"):
            values = [r[key] for r in results if key in r]
            if values:
                row[key] = statistics.median(values)
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
                     "ratio_q1": q1, "ratio_q3": q3, "ratio_cpu": statistics.median(cpu),
                     "others": {p: variants[p]["tokens_per_s"] for p in present if p != best}})
    return {"variants": variants, "rows": rows}


def print_table(summary: dict[str, Any]) -> None:
    head = (f"{'variant':<28}{'step ms':>9}{'best ms':>9}{'tok/s':>9}{'MB wire':>9}"
            f"{'RSS+ MB':>9}{'exposed ms':>11}")
    print(head)
    print("-" * len(head))
    for name, r in summary["variants"].items():
        wire = f"{r['wire_bytes'] / 2**20:9.2f}" if "wire_bytes" in r else f"{'-':>9}"
        exp = f"{1e3 * r['exposed_s']:11.1f}" if "exposed_s" in r else f"{'-':>11}"
        print(f"{name:<28}{1e3 * r['step_s']:9.1f}{1e3 * r['step_s_min']:9.1f}"
              f"{r['tokens_per_s']:9.0f}{wire}{r['rss_peak_bytes'] / 2**20:9.1f}{exp}")
    for row in summary["rows"]:
        print(f"{row['layout']:<14} colonnade {row['colonnade']:8.0f} tok/s | fastest peer "
              f"{row['peer']} {row['peer_tokens_per_s']:8.0f} | ratio {row['ratio']:.3f} "
              f"[{row['ratio_q1']:.3f}, {row['ratio_q3']:.3f}], by CPU time {row['ratio_cpu']:.3f}")


def select_variants(requested: str | None) -> list[str]:
    """The variants to run: the default set (DeepSpeed ones when importable) or ``requested``."""
    have_ds = importlib.util.find_spec("deepspeed") is not None
    if not have_ds:
        print(f"DeepSpeed is not installed: its rows are left out. To include them:\n  {INSTALL}")
    if requested:
        names = requested.split(",")
        unknown = set(names) - {*CORE, *DEEPSPEED, *OPTIONAL}
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}")
        if not have_ds and set(names) & set(DEEPSPEED):
            raise SystemExit("DeepSpeed variants requested but deepspeed is not installed")
        return names
    return [*CORE, *(DEEPSPEED if have_ds else ())]


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
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated subset of {CORE + DEEPSPEED + OPTIONAL}")
    parser.add_argument("--json", type=Path, default=None,
                        help="default benchmarks/results/data_parallel_<workload>.json")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 warm-up, 1 timed step")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 1, 2
    args.warmup = max(args.warmup, 2)
    w = WORKLOADS[args.workload]
    micro = args.micro_batch or w.global_batch // DP
    names = select_variants(args.variants)
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
