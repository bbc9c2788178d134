"""Full training steps of an issue-19 workload at tp = 2: Colonnade against DTensor plans.

    .venv/bin/python benchmarks/tensor_parallel.py --workload gpt2-tiny|llama-tiny
                                                   [--rounds 15] [--steps 2] [--quick]

Two gloo CPU ranks (one thread each) train the SAME model (benchmarks/workloads.py: weights
copied out of Colonnade's single-process model, the same data, AdamW with Colonnade's
parameter groups, fp32, no clipping, no dropout) with one micro-batch of the whole global
batch per step (dp = 1), a step being forward + backward + AdamW:

* ``colonnade`` / ``colonnade_sp``: ``Trainer.train_step`` at tp = 2 without / with sequence
  parallelism (the path ``colonnade train`` takes);
* DTensor: the plain ``torch.nn`` model of workloads.py under ``parallelize_module`` on a
  1-d mesh, with ``torch.optim.AdamW`` (foreach) on its DTensor parameters. Each plan
  (:class:`DTPlan`) shards q, k, v, fc (gate, up) column-wise, o, proj (down) row-wise, the
  word embedding row-wise (vocab rows; tied to the head, which is column-wise over the vocab:
  both hold Shard(0) of the same [V, h] weight); AdamW with fused kernels by default
  (``--peer-optimizer foreach``: PyTorch's default kernels), see :func:`peer_optimizer`:

  ``dtensor``             the documented plan: each column-parallel linear makes its own
                          replicated input, so the backward all-reduces the input gradient
                          once per q, k, v (fc): 3 + 1 all-reduces per block instead of 2;
  ``dtensor_prepared``    the attention and MLP norms' outputs become one replicated DTensor
                          (PrepareModuleOutput: torchtitan's PrepareModuleInput on the
                          attention / feed-forward module, placed on the norm because the
                          plain block is flat), so q, k, v share one input-gradient all-reduce;
  ``dtensor_prepared_lp`` the same with ``loss_parallel`` (head output Shard(-1) and the
                          vocab-parallel cross entropy, no all-gather of the logits);
  ``dtensor_sp``          torchtitan's plan: SequenceParallel on every norm (activations
                          [b, s/tp, h] between blocks), the norms' outputs all-gathered once
                          to a replicated DTensor, o / proj row-wise to Shard(1) (reduce-scatter),
                          embedding row-wise to Shard(1), loss_parallel;
  ``dtensor_sp_rep``      the same with the head's logits all-gathered (replicated loss).

  gpt2's learned positions: a replicated table added to the embedding output (under sp as a
  replicated DTensor added to the sequence-sharded embedding: each rank adds its rows).

The first two steps of every variant run on the same batches from the same weights; their
losses must agree with Colonnade's to 1e-5 (fp32) before anything is timed (step 2 checks the
first AdamW update too). Variants are then interleaved
round by round (order rotated, reversed every other round, ranks barrier-aligned); a round
runs ``steps`` steps of each. Step time = last rank's end - first rank's start (one machine,
one clock); CPU time = process time of both ranks (gloo threads included).

Collectives per step (``calls``, ``wire MiB``): Colonnade's from ``groups.stats`` (all of
them); DTensor's from a dispatch mode that sees the collectives DTensor issues at Python level
(redistribute, from_local / to_local), not those inside an op's dispatch (loss_parallel's
max / sum reductions; a SequenceParallel norm weight's Partial gradient, all-reduced inside
the optimizer's kernel: checked correct, the weights stay equal on both ranks): a lower bound.

Rows (for benchmarks/peer_table.py): ``tp2`` = colonnade against the fastest DTensor plan
without sp, ``tp2 + sp`` = colonnade_sp against the fastest DTensor plan with sp ("fastest":
the highest median tokens/s). ``ratio`` = median over rounds of peer step time / Colonnade step
time of the same round (> 1: Colonnade faster); ``ratio_cpu`` the same by CPU time.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from ratios import cpu_ratios, ratio_stats
from tensor_parallel import CollectiveBytes
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
    plain_optimizer,
)

from colonnade.device import keep_host_pages
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPool
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime

TP = 2
LOSS_TOL = 1e-5
"""Step-1 losses of every variant must agree with Colonnade's within this (relative, fp32)."""
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class DTPlan:
    """One DTensor tensor-parallel plan of the plain model."""

    sp: bool
    """SequenceParallel on the norms: activations [b, s/tp, h] between the blocks."""
    prepared: bool
    """One replicated DTensor per norm output shared by the column-parallel linears after it
    (one input-gradient reduction per norm instead of one per linear)."""
    loss_parallel: bool
    """Head output sharded over the vocab (Shard(-1)) and ``loss_parallel`` cross entropy;
    otherwise the logits are all-gathered and the loss is computed replicated."""


PLANS: dict[str, DTPlan] = {
    "dtensor": DTPlan(sp=False, prepared=False, loss_parallel=False),
    "dtensor_prepared": DTPlan(sp=False, prepared=True, loss_parallel=False),
    "dtensor_prepared_lp": DTPlan(sp=False, prepared=True, loss_parallel=True),
    "dtensor_sp": DTPlan(sp=True, prepared=True, loss_parallel=True),
    "dtensor_sp_rep": DTPlan(sp=True, prepared=True, loss_parallel=False),
}
"""The DTensor variants by name."""
OPTIMIZER_IMPLS = ("fused", "foreach")
"""torch AdamW kernels a peer may use (``--peer-optimizer``)."""
COLONNADE = {"colonnade": False, "colonnade_sp": True}
"""Colonnade variants: name -> sequence parallelism."""


# ----------------------------------------------------------------------------- DTensor plans


def _linear_names(w: Workload) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(column-parallel, row-parallel) linear names of a plain block."""
    mlp_in = ("gate", "up") if w.arch == "llama" else ("fc",)
    mlp_out = "down" if w.arch == "llama" else "proj"
    return ("q", "k", "v", *mlp_in), ("o", mlp_out)


def dtensor_plan(w: Workload, plan: DTPlan) -> dict[str, Any]:
    """``parallelize_module`` plan of :class:`PlainModel` (names relative to the model).

    Layouts of the hidden stream between blocks: Replicate [b, s, h] without sp, Shard(1)
    [b, s/tp, h] with sp (local tensors between modules)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if plan.sp else Replicate()
    positions = w.arch == "gpt2" and plan.sp  # added as DTensors: the embedding stays one
    out: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                 use_local_output=not positions),
        "head": ColwiseParallel(input_layouts=seq,
                                output_layouts=Shard(-1) if plan.loss_parallel else Replicate(),
                                use_local_output=not plan.loss_parallel),
    }
    if plan.sp:
        out["norm"] = SequenceParallel()
    if positions:  # [b, s/tp, h] DTensor + replicated P[:s] -> local shard for block 0
        out["blocks.0"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(seq,),
                                             use_local_output=True)
    col, row = _linear_names(w)
    for i in range(w.layers):
        for name in col:
            out[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in row:
            out[f"blocks.{i}.{name}"] = RowwiseParallel(output_layouts=seq)
        if plan.sp:
            for name in ("attn_norm", "mlp_norm"):
                out[f"blocks.{i}.{name}"] = SequenceParallel()
    return out


def prepared_plan(w: Workload, plan: DTPlan) -> dict[str, Any]:
    """Second pass for ``prepared``: each block norm's output -> one replicated DTensor
    (all-gathered once under sp), consumed as is by the column-parallel linears after it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    seq = Shard(1) if plan.sp else Replicate()
    return {f"blocks.{i}.{name}": PrepareModuleOutput(
                output_layouts=seq, desired_output_layouts=Replicate(), use_local_output=False)
            for i in range(w.layers) for name in ("attn_norm", "mlp_norm")}


def parallelize(w: Workload, plan: DTPlan, mesh: Any) -> PlainModel:
    """The plain model with Colonnade's weights, parallelized by ``plan`` on ``mesh``; a tied
    head shares the embedding's (Shard(0)) DTensor weight again afterwards."""
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import parallelize_module

    model = plain_model(w)
    parallelize_module(model, mesh, dtensor_plan(w, plan))
    if plan.prepared:
        parallelize_module(model, mesh, prepared_plan(w, plan))
    if model.pos is not None and plan.sp:
        distribute_module(model.pos, mesh)  # replicated DTensor table
    if w.tied:
        assert model.embed is not None and model.head is not None
        emb = model.embed.weight
        assert emb.placements == model.head.weight.placements  # type: ignore[attr-defined]
        model.head.weight = emb
    return model


def peer_optimizer(model: nn.Module, w: Workload, impl: str = "fused") -> torch.optim.Optimizer:
    """workloads.plain_optimizer's AdamW (Colonnade's groups and hyper-parameters) with the
    ``impl`` kernels ('fused': one fused kernel per group, as torchtitan configures it, the
    fastest on CPU too; 'foreach': PyTorch's default), each group split into its DTensor and
    its plain parameters: one kernel call takes one kind only (parameters no plan touches,
    such as the norms without sp, stay plain tensors, computed replicated without any
    communication). Same updates either way (fp32 rounding)."""
    from torch.distributed.tensor import DTensor

    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer implementation {impl!r}: choose from {OPTIMIZER_IMPLS}")
    base = plain_optimizer(model, w)
    groups = []
    for group in base.param_groups:
        for kind in (True, False):
            params = [p for p in group["params"] if isinstance(p, DTensor) is kind]
            if params:
                groups.append({**group, "params": params, "foreach": impl == "foreach",
                               "fused": impl == "fused"})
    return torch.optim.AdamW(groups)


def dtensor_step(model: nn.Module, opt: torch.optim.Optimizer, step: list[Batch],
                 loss_parallel: bool) -> float:
    """Mean cross entropy over the step's micro-batches (each scaled by 1/m), backward,
    AdamW, zero grads; under ``loss_parallel`` the loss and backward run in its context."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel as lp_context

    total = 0.0
    with lp_context() if loss_parallel else contextlib.nullcontext():
        losses = []
        for tokens, labels in step:
            loss = plain_loss(model(tokens), labels) / len(step)
            loss.backward()
            losses.append(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    for loss in losses:
        total += float(loss.full_tensor() if isinstance(loss, DTensor) else loss)
    return total


# ----------------------------------------------------------------------------- ranks


def check_losses(first: dict[str, list[float]]) -> None:
    """Every variant's losses of steps 1, 2 equal the first variant's within
    :data:`LOSS_TOL` (relative): same model, weights and batches."""
    ref_name = next(iter(first))
    for name, losses in first.items():
        for i, (loss, ref) in enumerate(zip(losses, first[ref_name], strict=True)):
            if abs(loss - ref) > LOSS_TOL * abs(ref):
                raise AssertionError(f"step-{i + 1} loss of {name} {loss!r} differs from "
                                     f"{ref_name}'s {ref!r} beyond {LOSS_TOL:g}")


Step = Callable[[list[Batch]], float]


def build_variants(w: Workload, groups: ProcessGroups, names: list[str], impl: str
                   ) -> dict[str, Step]:
    """name -> one training step of that variant (its model and optimizer built here; the
    DTensor plans' AdamW with the ``impl`` kernels)."""
    from torch.distributed.device_mesh import init_device_mesh

    steps: dict[str, Step] = {}
    mesh = init_device_mesh("cpu", (TP,))
    for name in names:
        if name in COLONNADE:
            extra = [f"--parallel.tp={TP}", f"--parallel.sp={str(COLONNADE[name]).lower()}"]
            cfg = colonnade_config(w, w.global_batch, TP, extra)
            trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
            steps[name] = lambda b, t=trainer: t.train_step(b)["loss"]
        else:
            plan = PLANS[name]
            model = parallelize(w, plan, mesh)
            opt = peer_optimizer(model, w, impl)
            steps[name] = (lambda b, m=model, o=opt, lp=plan.loss_parallel:
                           dtensor_step(m, o, b, lp))
    return steps


def _count(name: str, step: Step, data: list[Batch], groups: ProcessGroups) -> dict[str, Any]:
    """Collective calls and bytes of one step: Colonnade's by ``groups.stats``, DTensor's by
    a dispatch mode that sees the functional collectives issued outside op dispatch (a lower
    bound: see the module docstring)."""
    if name in COLONNADE:
        groups.stats.reset()
        step(data)
        return {k: {f: v[f] for f in ("calls", "payload_bytes", "wire_bytes")}
                for k, v in groups.stats.snapshot().items()}
    with CollectiveBytes(TP) as mode:
        step(data)
    return {k: dict(v) for k, v in sorted(mode.ops.items())}


def bench_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """On each rank: build every variant, steps 1-2 (losses checked), count bytes, rounds."""
    torch.set_num_threads(1)
    keep_host_pages()  # every variant under the allocator settings Colonnade's trainer uses
    w = WORKLOADS[spec["workload"]]
    groups = ProcessGroups.build(ParallelDims(tp=TP), tied_embeddings=w.tied)
    names = spec["variants"]
    steps = build_variants(w, groups, names, spec["optimizer"])
    data = [s[0] for s in batches(w, 4, w.global_batch)]  # one micro-batch per step
    first = {n: [steps[n]([data[0]]), steps[n]([data[1]])] for n in names}  # same batches
    check_losses(first)  # before anything is timed
    counts = {n: _count(n, steps[n], [data[2]], groups) for n in names}
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    k = 3
    for r in range(spec["rounds"]):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for name in order[::-1] if r % 2 else order:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(spec["steps"]):
                steps[name]([data[k % len(data)]])
                k += 1
            t1, c1 = time.perf_counter(), time.process_time()
            runs[name].append({"t0": t0, "t1": t1, "cpu": c1 - c0})
    return {"rank": groups.rank, "first_loss": first, "bytes": counts, "runs": runs}


# ----------------------------------------------------------------------------- report


def summarize(w: Workload, spec: dict[str, Any], ranks: list[dict[str, Any]]
              ) -> dict[str, Any]:
    """Per variant: per-round step and CPU times, medians, tokens/s; the two peer rows."""
    tokens, n = w.tokens_per_step, spec["steps"]
    variants: dict[str, dict[str, Any]] = {}
    for name in spec["variants"]:
        rounds = range(len(ranks[0]["runs"][name]))
        step = [(max(r["runs"][name][i]["t1"] for r in ranks)
                 - min(r["runs"][name][i]["t0"] for r in ranks)) / n for i in rounds]
        cpu = [sum(r["runs"][name][i]["cpu"] for r in ranks) / n for i in rounds]
        ops = ranks[0]["bytes"][name]
        variants[name] = {
            "step_s_all": step, "cpu_s_all": cpu, "step_s": statistics.median(step),
            "tokens_per_s": tokens / statistics.median(step),
            "tokens_per_cpu_s": tokens / statistics.median(cpu),
            "first_losses": ranks[0]["first_loss"][name],
            "calls_per_step": sum(v["calls"] for v in ops.values()),
            "wire_bytes_per_step": sum(v["wire_bytes"] for v in ops.values()), "ops": ops,
            "plan": asdict(PLANS[name]) if name in PLANS else None,
        }
    rows = []
    for layout, ours, sp in (("tp2", "colonnade", False), ("tp2 + sp", "colonnade_sp", True)):
        peers = [k for k, p in PLANS.items() if p.sp == sp and k in variants]
        if ours not in variants or not peers:
            continue
        best = max(peers, key=lambda k: variants[k]["tokens_per_s"])
        a, b = variants[ours], variants[best]
        rows.append({
            "layout": layout, "colonnade": a["tokens_per_s"], "peer": f"DTensor ({best})",
            "peer_tokens_per_s": b["tokens_per_s"],
            **ratio_stats(b["step_s_all"], a["step_s_all"]),
            **cpu_ratios(ratio_stats(b["cpu_s_all"], a["cpu_s_all"])),
        })
    return {"workload": asdict(w), "tp": TP, "tokens_per_step": tokens, "rows": rows,
            "variants": variants,
            "note": "full training steps (forward, backward, AdamW), fp32, gloo, 1 thread per "
                    "rank; ratio = median over interleaved rounds of peer / Colonnade step time"}


def print_table(summary: dict[str, Any]) -> None:
    w = summary["workload"]
    print(f"tp={summary['tp']} {w['name']}: {w['layers']} layers, h={w['hidden']}, "
          f"{w['heads']}/{w['kv_heads']} heads, s={w['seq_len']}, V={w['vocab']}, global batch "
          f"{w['global_batch']} ({summary['tokens_per_step']} tokens/step), full training steps")
    head = (f"{'variant':<20} {'step ms':>8} {'tokens/s':>9} {'tok/CPU-s':>9} {'calls':>5} "
            f"{'wire MiB':>8} "
            f"{'step-1 loss':>12} {'step-2 loss':>12}")
    print(head)
    print("-" * len(head))
    for name, v in summary["variants"].items():
        print(f"{name:<20} {1e3 * v['step_s']:>8.1f} {v['tokens_per_s']:>9.0f} "
              f"{v['tokens_per_cpu_s']:>9.0f} {v['calls_per_step']:>5.0f} "
              f"{v['wire_bytes_per_step'] / 2**20:>8.2f}"
              f" {v['first_losses'][0]:>12.7f} {v['first_losses'][1]:>12.7f}")
    for row in summary["rows"]:
        print(f"{row['layout']:<9} colonnade {row['colonnade']:>6.0f} tok/s vs {row['peer']} "
              f"{row['peer_tokens_per_s']:>6.0f}: ratio {row['ratio']:.3f} (median per round), "
              f"{row['ratio_cpu']:.3f} by CPU time")


def run(workload: str, rounds: int, steps: int, json_path: Path | None,
        optimizer: str = "fused") -> dict[str, Any]:
    """Run the workload benchmark on 2 ranks (DTensor peers' AdamW kernels ``optimizer``);
    print, write JSON; returns the summary."""
    w = WORKLOADS[workload]
    spec = {"workload": workload, "rounds": rounds, "steps": steps, "optimizer": optimizer,
            "variants": [*COLONNADE, *PLANS]}
    began, load = time.perf_counter(), os.getloadavg()
    with RankPool(TP, timeout_s=3600.0) as pool:
        ranks = pool.run(bench_rank, spec)
    summary = summarize(w, spec, ranks)
    summary["peer_optimizer"] = optimizer
    summary["machine"] = {"cpus": os.cpu_count(), "loadavg_start": load,
                          "loadavg_end": os.getloadavg(), "torch": torch.__version__,
                          "rounds": rounds, "steps_per_round": steps,
                          "wall_s": time.perf_counter() - began}
    print_table(summary)
    path = json_path or RESULTS_DIR / f"tensor_parallel_{workload}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    print(f"wrote {path} in {summary['machine']['wall_s']:.0f} s")
    return summary
