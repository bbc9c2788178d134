"""Data parallelism side by side: Colonnade DDP / ZeRO-1 vs torch DDP and FSDP2, dp = 2.

    .venv/bin/python benchmarks/data_parallel.py [--rounds 5] [--steps 4] [--json PATH] [--quick]

One pool of 2 gloo CPU ranks (one compute thread each) trains the same llama model (same seed,
same data, fp32, AdamW, clipping at 1.0, 2 micro-batches of gradient accumulation) with:

  baseline          the bare model and torch AdamW, no communication at all (compute floor)
  colonnade_ddp     DataParallel all-reduce buckets + DistributedOptimizer, overlap on / off
  colonnade_zero1   reduce-scatter buckets, sharded AdamW, bucketed param all-gather, on / off
  torch_ddp         torch.nn.parallel.DistributedDataParallel (no_sync while accumulating)
  torch_fsdp2       torch.distributed.fsdp.fully_shard per layer + root (reshard after forward,
                    gradient sync only on the last micro-batch)

Every variant uses the same bucket size (parallel.bucket_size elements; torch DDP gets
bucket_cap_mb = the same bytes; FSDP2 has no bucket size: its unit is one layer). Variants are
interleaved round by round (order rotated), each run builds a fresh model, warms up, times
``steps`` steps; the table shows medians over all measured steps.

Columns: step time (median, best), tokens/s, throughput ratio to torch DDP (median over rounds
of the paired ratio: each run against torch DDP's run of the same round and rank; and "best",
the ratio of the fastest steps, the least disturbed by other load on a shared machine), bytes
on the wire per rank and step (Colonnade: counted by colonnade.parallel.comm; torch DDP:
2(n-1)/n x grad bytes, exact since every gradient is all-reduced once; FSDP2: counted by
wrapping dist.all_gather_single / reduce_scatter_single), peak RSS growth of the rank during
the run (glibc mmap threshold pinned so freed tensors leave the RSS), model-state bytes
(params + grads + optimizer state), and exposed communication: for Colonnade the time the
caller blocked in Handle.wait on dp collectives (measured); for every variant step time minus
the baseline's (an estimate).
"Hidden" = 1 - exposed(overlap on) / exposed(overlap off) of the gradient reduction, from the
median runs and ("_best") from the least-disturbed runs.

Writes benchmarks/results/data_parallel.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned ranks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from colonnade.config.sections import (
    Config,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainingConfig,
)
from colonnade.config.validate import resolve, validate
from colonnade.data.synthetic import random_steps
from colonnade.data_parallel import build_data_parallel
from colonnade.models.build import build_chunks, build_reference
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPool
from colonnade.pipeline.plan import StepPlan
from colonnade.training.step import forward_backward

RESULTS = Path(__file__).resolve().parent / "results" / "data_parallel.json"
VARIANTS = ("baseline", "colonnade_ddp", "colonnade_ddp_no_overlap", "colonnade_zero1",
            "colonnade_zero1_no_overlap", "torch_ddp", "torch_fsdp2")


def make_config(quick: bool, bucket: int) -> Config:
    """The benchmark model: llama h=256 (h=128 quick), 4 layers, vocab 2048, seq 64, b 2."""
    h = 128 if quick else 256
    cfg = Config(
        model=ModelConfig(arch="llama", num_layers=4, hidden_size=h, num_heads=8,
                          vocab_size=2048, max_seq_len=64),
        parallel=ParallelConfig(dp=2, bucket_size=bucket),
        training=TrainingConfig(steps=1000, seq_len=64, micro_batch_size=2, microbatches=2,
                                precision="fp32", seed=1, eval_interval=0),
        optim=OptimConfig(lr=1e-4, warmup_steps=0, clip_grad=1.0),
    )
    return validate(resolve(cfg, 2), 2)


class RssPeak:
    """Samples this process's resident set every millisecond; ``peak`` minus ``start``."""

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
        self.peak = max(self.peak, self._rss())
        return self.peak - self.start


def _batches(cfg: Config, rank: int, count: int) -> list[list[tuple[torch.Tensor, ...]]]:
    return random_steps(cfg, count, seed=100 + rank)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _torch_state(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> int:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    grads = [g.to_local() if hasattr(g, "to_local") else g
             for g in (p.grad for p in params) if g is not None]
    states = [v for s in opt.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.numel() > 1]
    states = [v.to_local() if hasattr(v, "to_local") else v for v in states]
    return _storage_bytes([t.detach() for t in local]) + _storage_bytes(grads) + \
        _storage_bytes(states)


# ----------------------------------------------------------------------------- variants


def _colonnade(cfg: Config, zero: bool, overlap: bool, data: list[Any]) -> tuple[Any, Any]:
    import dataclasses

    par = dataclasses.replace(cfg.parallel, use_distributed_optimizer=zero,
                              overlap_grad_reduce=overlap, overlap_param_gather=overlap)
    cfg = dataclasses.replace(cfg, parallel=par)
    groups = ProcessGroups.build(ParallelDims(dp=2))
    chunks = build_chunks(cfg, groups)
    ddp = build_data_parallel(chunks, cfg, groups)
    opt = DistributedOptimizer(ddp, cfg.optim, groups, cfg.training.steps, "fp32")
    m = cfg.training.microbatches or 1

    def step(batches: list[Any]) -> None:
        opt.zero_grad()
        plan = StepPlan(groups, 0, grad_sync=ddp.grad_sync_hook(m))
        forward_backward(chunks, batches, plan)
        ddp.finish_grad_sync()
        opt.step()

    def facts() -> dict[str, Any]:
        params = list(ddp.buffers.params)
        return {"state_bytes": ddp.buffers.param_data.nbytes + ddp.buffers.grad_data.nbytes
                + opt.state_bytes(), "buckets": len(ddp.buckets),
                "num_params": sum(p.numel() for p in params)}

    return step, (groups, facts)


def _torch_ddp(cfg: Config, data: list[Any]) -> tuple[Any, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model = build_reference(cfg)
    cap_mb = cfg.parallel.bucket_size * 4 / 2**20
    wrapped = DistributedDataParallel(model, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
    params = list(model.parameters())
    opt = _adamw(cfg, params)
    n = sum(p.numel() for p in params)

    def step(batches: list[Any]) -> None:
        opt.zero_grad(set_to_none=False)
        m = len(batches)
        for k, (tokens, labels) in enumerate(batches):
            if k < m - 1:
                with wrapped.no_sync():
                    (wrapped(tokens, labels) / m).backward()
            else:
                (wrapped(tokens, labels) / m).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_grad, foreach=True)
        opt.step()

    def facts() -> dict[str, Any]:
        return {"state_bytes": _torch_state(params, opt), "num_params": n,
                "wire_bytes_theory": 2 * (2 - 1) / 2 * n * 4}

    return step, (None, facts)


class _FsdpCounter:
    """Counts FSDP2's all-gather / reduce-scatter wire bytes (ring formula) while installed."""

    def __init__(self, n: int) -> None:
        self.n, self.wire = n, 0.0
        self._ag, self._rs = dist.all_gather_single, dist.reduce_scatter_single

    def __enter__(self) -> _FsdpCounter:
        def ag(output: torch.Tensor, input: torch.Tensor, *a: Any, **kw: Any) -> Any:
            self.wire += (self.n - 1) / self.n * output.numel() * output.element_size()
            return self._ag(output, input, *a, **kw)

        def rs(*a: Any, **kw: Any) -> Any:
            t = kw.get("input", a[1] if len(a) > 1 else None)
            self.wire += (self.n - 1) / self.n * t.numel() * t.element_size()
            return self._rs(*a, **kw)

        dist.all_gather_single, dist.reduce_scatter_single = ag, rs
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single, dist.reduce_scatter_single = self._ag, self._rs


def _torch_fsdp2(cfg: Config, data: list[Any]) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = build_reference(cfg)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    opt = _adamw(cfg, params)
    n = sum(p.numel() for p in params)

    def step(batches: list[Any]) -> None:
        opt.zero_grad()
        m = len(batches)
        for k, (tokens, labels) in enumerate(batches):
            model.set_requires_gradient_sync(k == m - 1)
            (model(tokens, labels) / m).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_grad, foreach=True)
        opt.step()

    def facts() -> dict[str, Any]:
        return {"state_bytes": _torch_state(params, opt), "num_params": n}

    return step, (None, facts)


def _baseline(cfg: Config, data: list[Any]) -> tuple[Any, Any]:
    model = build_reference(cfg)
    params = list(model.parameters())
    opt = _adamw(cfg, params)

    def step(batches: list[Any]) -> None:
        opt.zero_grad()
        for tokens, labels in batches:
            (model(tokens, labels) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_grad, foreach=True)
        opt.step()

    def facts() -> dict[str, Any]:
        return {"state_bytes": _torch_state(params, opt)}

    return step, (None, facts)


def _adamw(cfg: Config, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    o = cfg.optim
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim > 1], "weight_decay": o.weight_decay},
         {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)


def _build(name: str, cfg: Config, data: list[Any]) -> tuple[Any, Any]:
    if name == "baseline":
        return _baseline(cfg, data)
    if name.startswith("colonnade"):
        return _colonnade(cfg, "zero1" in name, not name.endswith("no_overlap"), data)
    if name == "torch_ddp":
        return _torch_ddp(cfg, data)
    return _torch_fsdp2(cfg, data)


def run_variant(name: str, cfg: Config, warmup: int, steps: int) -> dict[str, Any]:
    """Rank function: build variant ``name`` fresh, warm up, time ``steps`` steps."""
    torch.set_num_threads(1)
    gc.collect()
    rank = dist.get_rank()
    data = _batches(cfg, rank, warmup + steps)
    rss = RssPeak()
    step, (groups, facts) = _build(name, cfg, data)
    counter = _FsdpCounter(2) if name == "torch_fsdp2" else None
    if counter is not None:
        counter.__enter__()
    try:
        for batches in data[:warmup]:
            step(batches)
        dist.barrier()
        if groups is not None:
            groups.stats.reset()
        if counter is not None:
            counter.wire = 0.0
        times = []
        for batches in data[warmup:]:
            start = time.perf_counter()
            step(batches)
            times.append(time.perf_counter() - start)
    finally:
        if counter is not None:
            counter.__exit__()
    out: dict[str, Any] = {"name": name, "rank": rank, "times": times,
                           "rss_peak_bytes": rss.stop(), **facts()}
    if groups is not None:
        dp = {k: v for k, v in groups.stats.snapshot().items() if k.startswith("dp_cp/")}
        out["wire_bytes"] = sum(v["wire_bytes"] for v in dp.values()) / steps
        grad = [v for k, v in dp.items() if "grad_bucket" in k]
        gather = [v for k, v in dp.items() if "param_bucket" in k]
        out["grad_exposed_s"] = sum(v["waited_s"] for v in grad) / steps
        out["grad_in_flight_s"] = sum(v["in_flight_s"] for v in grad) / steps
        out["gather_exposed_s"] = sum(v["waited_s"] for v in gather) / steps
        out["exposed_s"] = sum(v["waited_s"] for v in dp.values()) / steps
    elif counter is not None:
        out["wire_bytes"] = counter.wire / steps
    elif "wire_bytes_theory" in out:
        out["wire_bytes"] = out.pop("wire_bytes_theory")
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- driver


def summarize(runs: dict[str, list[dict[str, Any]]], cfg: Config) -> dict[str, Any]:
    """Medians per variant (over rounds, steps and ranks) and the derived ratios."""
    tr = cfg.training
    tokens = tr.micro_batch_size * (tr.microbatches or 1) * tr.seq_len * 2  # both dp ranks
    rows: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        times = [t for r in results for t in r["times"]]
        med = statistics.median(times)
        row: dict[str, Any] = {"step_s": med, "tokens_per_s": tokens / med,
                               "step_s_min": min(times), "samples": len(times)}
        for key in ("wire_bytes", "state_bytes", "rss_peak_bytes", "exposed_s",
                    "grad_exposed_s", "grad_in_flight_s", "gather_exposed_s", "buckets"):
            values = [r[key] for r in results if key in r]
            if values:
                row[key] = statistics.median(values)
        rows[name] = row
    base = rows["baseline"]["step_s"]
    for row in rows.values():
        row["exposed_est_s"] = row["step_s"] - base
    best_ref = rows["torch_ddp"]["step_s_min"]
    for name, row in rows.items():
        row["vs_torch_ddp"] = _paired_ratio(runs["torch_ddp"], runs[name])
        row["vs_torch_ddp_best"] = best_ref / row["step_s_min"]
    hidden = {}
    for kind in ("colonnade_ddp", "colonnade_zero1"):
        on, off = rows[kind]["grad_exposed_s"], rows[f"{kind}_no_overlap"]["grad_exposed_s"]
        hidden[kind] = 1.0 - on / off if off > 0 else 0.0
        best_on = min(r["grad_exposed_s"] for r in runs[kind])
        best_off = min(r["grad_exposed_s"] for r in runs[f"{kind}_no_overlap"])
        hidden[f"{kind}_best"] = 1.0 - best_on / best_off if best_off > 0 else 0.0
    zero_gather_on = rows["colonnade_zero1"]["gather_exposed_s"]
    zero_gather_off = rows["colonnade_zero1_no_overlap"]["gather_exposed_s"]
    hidden["colonnade_zero1_param_gather"] = (1.0 - zero_gather_on / zero_gather_off
                                              if zero_gather_off > 0 else 0.0)
    return {"rows": rows, "grad_comm_hidden_fraction": hidden}


def _paired_ratio(ref: list[dict[str, Any]], other: list[dict[str, Any]]) -> float:
    """Median over rounds of t_ref / t_other (same round, same rank): throughput ratio.

    The machine is shared and its load drifts between rounds; pairing each round's run with
    the reference run of the same round cancels most of that drift."""
    ratios = []
    for a, b in zip(ref, other, strict=True):
        ratios.append(statistics.median(a["times"]) / statistics.median(b["times"]))
    return statistics.median(ratios)


def print_table(summary: dict[str, Any]) -> None:
    rows = summary["rows"]
    head = (f"{'variant':<28}{'step ms':>9}{'best ms':>9}{'tok/s':>9}{'vs DDP':>8}{'best':>6}"
            f"{'MB wire':>9}"
            f"{'state MB':>9}{'RSS+ MB':>9}{'exp ms':>8}{'est ms':>8}")
    print(head)
    print("-" * len(head))
    for name, r in rows.items():
        def mb(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key] / 2**20:9.2f}" if key in r else f"{'-':>9}"

        exp = f"{1e3 * r['exposed_s']:8.1f}" if "exposed_s" in r else f"{'-':>8}"
        print(f"{name:<28}{1e3 * r['step_s']:9.1f}{1e3 * r['step_s_min']:9.1f}"
              f"{r['tokens_per_s']:9.0f}{r['vs_torch_ddp']:8.2f}{r['vs_torch_ddp_best']:6.2f}"
              f"{mb('wire_bytes')}{mb('state_bytes')}"
              f"{mb('rss_peak_bytes')}{exp}{1e3 * r['exposed_est_s']:8.1f}")
    print("gradient communication hidden by overlap:",
          ", ".join(f"{k} {100 * v:.0f}%" for k, v in summary["grad_comm_hidden_fraction"]
                    .items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=1_000_000, help="elements per bucket")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="small model, 1 round, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    cfg = make_config(args.quick, args.bucket)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with RankPool(2, timeout_s=1800.0) as pool:
        for rnd in range(args.rounds):
            order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]
            for name in order:
                runs[name] += pool.run(run_variant, name, cfg, args.warmup, args.steps)
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    summary = summarize(runs, cfg)
    print_table(summary)
    payload = {"config": {"hidden": cfg.model.hidden_size, "layers": cfg.model.num_layers,
                          "vocab": cfg.model.vocab_size, "seq": cfg.training.seq_len,
                          "micro_batch": cfg.training.micro_batch_size,
                          "microbatches": cfg.training.microbatches, "dp": 2,
                          "bucket_elements": args.bucket, "rounds": args.rounds,
                          "steps": args.steps, "device": "cpu (gloo, 1 thread per rank)",
                          "torch": torch.__version__},
               **summary, "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
