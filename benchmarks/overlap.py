"""Communication hidden behind compute: tensor partitioning (tp+sp) and async pipeline p2p.

    .venv/bin/python benchmarks/overlap.py [--rounds 5] [--steps 2] [--json PATH] [--quick]

Four measurements, each run side by side on one pool of gloo CPU ranks, variants interleaved
round by round (order rotated every round), reported as medians over all measured steps:

1. probe (2 ranks): can this backend overlap at all? One all-gather alone (C), one matmul
   alone (T), then the all-gather posted asynchronously around the same matmul (and around a
   sleep of the same length). Hidden fraction = (C + T - both) / min(C, T): 1 means perfect
   overlap, 0 none. Sleeping leaves the cores free, so the sleep row isolates the backend's
   progress thread from compute contention; ``matmul_during_comm_s`` vs ``compute_alone_s``
   is the compute slowdown an in-flight transfer causes.
2. tp=2 + sp, one SwiGLU MLP block forward+backward (gate/up column, down row): unchunked vs
   2/4/8 chunks, with gate and up sharing one chunked gather (``gathered_linears``) or each
   gathering for itself (``gathered_linear`` twice).
3. tp=2 + sp (2 ranks): a llama training step with parallel.tp_comm_chunks in {1, 2, 4, 8}:
   step time, tokens/s, tp communication time in flight and exposed (waited by the caller),
   from the per-op counters of colonnade.parallel.comm.
4. pp=2 (2 ranks), if colonnade.pipeline.executor exists: 1F1B and interleaved (vp=2) with
   overlap_p2p off/on: step time, tokens/s, p2p time exposed.

"In flight" sums each operation's time from posting to the end of its wait, so concurrent
operations add up (it can exceed the step); "exposed" is the time the caller blocked.
Writes benchmarks/results/overlap.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
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

from colonnade.config.sections import (
    Config,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainingConfig,
)
from colonnade.config.validate import resolve, validate
from colonnade.data.synthetic import random_batches
from colonnade.data_parallel.finalize import reduce_sp_and_tied
from colonnade.models.build import build_chunks
from colonnade.parallel.comm import CommStats
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPool
from colonnade.pipeline.plan import ExecOptions, StepPlan
from colonnade.tensor_parallel import mappings as mp
from colonnade.tensor_parallel.partition import (
    gathered_linear,
    gathered_linears,
    linear_reduce_scatter,
)
from colonnade.training.step import forward_backward, set_train_mode

RESULTS = Path(__file__).resolve().parent / "results" / "overlap.json"
CHUNKS = (1, 2, 4, 8)


def comm_report(stats: CommStats, prefix: str) -> dict[str, float]:
    """Per-step summary of one group's traffic: time in flight, exposed (waited), hidden share.

    ``in_flight_s`` runs from posting to completion-observed; ``waited_s`` is the part the
    caller blocked for. Synchronous calls count fully as both.
    """
    flight = stats.total(prefix, "in_flight_s")
    waited = stats.total(prefix, "waited_s")
    return {"in_flight_s": flight, "exposed_s": waited, "calls": stats.total(prefix, "calls"),
            "wire_bytes": stats.total(prefix, "wire_bytes"),
            "hidden_fraction": 1.0 - waited / flight if flight > 0 else 0.0}


# ----------------------------------------------------------------------------- 1. probe


def _timed(fn: Any) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def probe_rank(numel: int, mm: int, reps: int) -> dict[str, float]:
    """Rank function: all-gather alone, matmul alone, and the two overlapped (plus sleep).

    The four measurements are interleaved within every repetition (robust to load drift);
    medians over repetitions.
    """
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(tp=2))
    group = groups.tp
    x = torch.randn(numel)
    out = torch.empty(2 * numel)
    a, b = torch.randn(mm, mm), torch.randn(mm, mm)

    def comm() -> None:
        group.all_gather_into(out, x)

    def compute() -> None:
        a.mm(b)

    def overlapped(work: Any) -> tuple[float, float, float]:
        group.barrier()
        begin = time.perf_counter()
        handle = group.all_gather_into(out, x, async_op=True)
        work()
        mid = time.perf_counter()
        handle.wait()
        end = time.perf_counter()
        return end - begin, mid - begin, end - mid

    comm()
    samples: dict[str, list[float]] = {}
    for _ in range(reps):
        group.barrier()
        row = {"comm_alone_s": _timed(comm), "compute_alone_s": _timed(compute)}
        nap = row["compute_alone_s"]
        for label, work in (("matmul", compute), ("sleep", lambda t=nap: time.sleep(t))):
            both, during, waited = overlapped(work)
            row |= {f"{label}_both_s": both, f"{label}_during_comm_s": during,
                    f"{label}_waited_s": waited}
        for key, value in row.items():
            samples.setdefault(key, []).append(value)
    res = {key: statistics.median(values) for key, values in samples.items()}
    c, t = res["comm_alone_s"], res["compute_alone_s"]
    for label in ("matmul", "sleep"):
        res[f"{label}_hidden_fraction"] = (c + t - res[f"{label}_both_s"]) / min(c, t)
    return res


# ----------------------------------------------------------------------------- 2. one block


def _block(x: torch.Tensor, weights: list[torch.Tensor], group: Any, chunks: int,
           shared: bool) -> torch.Tensor:
    """SwiGLU MLP under sp, x [s/tp, b, h] -> [s/tp, b, h]: gate/up column, down row."""
    wg, wu, wd = weights
    if chunks == 1:
        full = mp.gather_seq(x, group)  # [s, b, h]
        y = F.silu(F.linear(full, wg)) * F.linear(full, wu)  # [s, b, f/tp]
        return mp.reduce_scatter_seq(F.linear(y, wd), group)
    if shared:  # one chunked gather for both column layers (as the unchunked path)
        g, u = gathered_linears(x, [wg, wu], [None, None], group, chunks)
    else:  # each column layer gathers for itself
        g = gathered_linear(x, wg, None, group, chunks)
        u = gathered_linear(x, wu, None, group, chunks)
    return linear_reduce_scatter(F.silu(g) * u, wd, group, chunks)


def block_rank(hidden: int, ffn: int, seq: int, rounds: int,
               reps: int) -> dict[str, list[dict[str, Any]]]:
    """Rank function (tp=2): forward+backward of one MLP block, variants interleaved."""
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(tp=2))
    gen = torch.Generator().manual_seed(groups.tp_rank)
    x = torch.randn(seq // 2, 1, hidden, generator=gen).requires_grad_()  # [s/tp, b, h]
    shapes = [(ffn // 2, hidden), (ffn // 2, hidden), (hidden, ffn // 2)]
    weights = [(torch.randn(shape, generator=gen) * 0.02).requires_grad_() for shape in shapes]
    grad = torch.randn(seq // 2, 1, hidden, generator=gen)
    # The same matmuls and copies with no communication: a group of one, the full sequence.
    alone, x_full = ProcessGroups.single().tp, torch.randn(seq, 1, hidden).requires_grad_()
    grad_full = torch.randn(seq, 1, hidden)
    variants = {"chunks=1": (1, True)}
    variants |= {f"chunks={n} shared": (n, True) for n in CHUNKS[1:]}
    variants |= {f"chunks={n} separate": (n, False) for n in CHUNKS[1:]}
    names = list(variants)
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds + 1):  # round 0: warm-up, not recorded
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(reps):
                groups.tp.barrier()
                groups.stats.reset()
                begin = time.perf_counter()
                _block(x, weights, groups.tp, *variants[name]).backward(grad)
                wall = time.perf_counter() - begin
                tp = comm_report(groups.stats, "tp/")
                begin = time.perf_counter()
                _block(x_full, weights, alone, *variants[name]).backward(grad_full)
                compute = time.perf_counter() - begin
                if r > 0:
                    out[name].append({"wall_s": wall, "tp": tp, "compute_only_s": compute})
    return out


# ----------------------------------------------------------------------------- 3. tp + sp


def bench_config(tp: int, pp: int, chunks: int, *, hidden: int, layers: int, seq: int,
                 micro: int, microbatches: int) -> Config:
    """A float32 llama (GQA, SwiGLU) benchmark config, validated for tp * pp ranks."""
    model = ModelConfig(arch="llama", num_layers=layers, hidden_size=hidden, num_heads=8,
                        num_kv_heads=4, vocab_size=1024, max_seq_len=seq)
    config = Config(
        model=model,
        parallel=ParallelConfig(tp=tp, pp=pp, sp=tp > 1, tp_comm_chunks=chunks),
        training=TrainingConfig(steps=1, seq_len=seq, micro_batch_size=micro,
                                microbatches=microbatches, precision="fp32", seed=1,
                                eval_interval=0, device="cpu"),
        optim=OptimConfig(),
    )
    return validate(resolve(config, tp * pp), tp * pp)


def _batches(config: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_batches(config, seed=0)


def timed_step(chunks: list[Any], config: Config, groups: ProcessGroups,
               batches: list[Any], options: ExecOptions) -> dict[str, Any]:
    """One forward/backward (+ sp/tied grad reduction); wall time and per-group comm report."""
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    groups.world.barrier()
    groups.stats.reset()
    begin = time.perf_counter()
    forward_backward(chunks, batches, StepPlan(groups, 0, config.parallel.schedule,
                                                     options=options))
    reduce_sp_and_tied(chunks, groups, config.model.tie_embeddings)
    wall = time.perf_counter() - begin
    ops = {k: {"exposed_s": v.waited_s, "in_flight_s": v.in_flight_s, "calls": v.calls}
           for k, v in groups.stats.ops.items()}
    return {"wall_s": wall, "tp": comm_report(groups.stats, "tp/"),
            "pp": comm_report(groups.stats, "pp/"), "ops": ops}


def variants_rank(configs: dict[str, Config], extras: dict[str, ExecOptions],
                  rounds: int, steps: int) -> dict[str, list[dict[str, Any]]]:
    """Rank function: build every variant's model, then interleave their steps round by round."""
    torch.set_num_threads(1)
    par = next(iter(configs.values())).parallel
    groups = ProcessGroups.build(ParallelDims(tp=par.tp, pp=par.pp))
    models = {name: build_chunks(cfg, groups, dtype=torch.float32) for name, cfg in configs.items()}
    batches = _batches(next(iter(configs.values())))
    names = list(configs)
    for name in names:  # warm-up
        set_train_mode(models[name], True)
        timed_step(models[name], configs[name], groups, batches, extras[name])
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            for _ in range(steps):
                out[name].append(timed_step(models[name], configs[name], groups, batches,
                                            extras[name]))
    return out


def summarise(per_rank: list[dict[str, list[dict[str, Any]]]], tokens: int, group: str,
              baseline: Callable[[str], str]) -> dict[str, dict[str, float]]:
    """Medians over steps of the slowest rank's wall time and the mean rank's comm times;
    each variant is compared with ``baseline(name)`` (its switched-off twin)."""
    table = {}
    for name in per_rank[0]:
        steps = list(zip(*(rank[name] for rank in per_rank), strict=True))
        wall = statistics.median(max(s["wall_s"] for s in step) for step in steps)

        def med(key: str, steps: list[Any] = steps) -> float:
            return statistics.median(statistics.mean(s[group][key] for s in step)
                                     for step in steps)

        table[name] = {"step_s": wall, "tokens_per_s": tokens / wall,
                       "exposed_s": med("exposed_s"), "in_flight_s": med("in_flight_s"),
                       "calls": med("calls"), "samples": float(len(steps))}
        table[name]["step_minus_exposed_s"] = statistics.median(
            max(s["wall_s"] - s[group]["exposed_s"] for s in step) for step in steps)
        if "compute_only_s" in steps[0][0]:
            table[name]["compute_only_s"] = statistics.median(
                max(s["compute_only_s"] for s in step) for step in steps)
    for name, row in table.items():
        base = table[baseline(name)]
        row["exposed_vs_off"] = row["exposed_s"] / base["exposed_s"] - 1
        row["step_vs_off"] = row["step_s"] / base["step_s"] - 1
    return table


def print_table(title: str, table: dict[str, dict[str, float]]) -> None:
    """One line per variant; with ``compute_only_s``: the step less its exposed time (compute
    while communicating) and the same compute with no communication at all."""
    print(f"\n{title}")
    extra = "compute_only_s" in next(iter(table.values()))
    head = (f"{'variant':<18} {'step ms':>8} {'tok/s':>8} {'in flight ms':>12} "
            f"{'exposed ms':>10} {'exposed vs off':>14} {'step vs off':>11} "
            f"{'step-exposed ms':>15}" + (f" {'no-comm ms':>10}" if extra else ""))
    print(head)
    print("-" * len(head))
    for name, r in table.items():
        line = (f"{name:<18} {r['step_s'] * 1e3:>8.1f} {r['tokens_per_s']:>8.0f} "
                f"{r['in_flight_s'] * 1e3:>12.1f} {r['exposed_s'] * 1e3:>10.1f} "
                f"{r['exposed_vs_off']:>+14.1%} {r['step_vs_off']:>+11.1%} "
                f"{r['step_minus_exposed_s'] * 1e3:>15.1f}")
        if extra:
            line += f" {r['compute_only_s'] * 1e3:>10.1f}"
        print(line)


def bench_pipeline(pool: RankPool, size: dict[str, int], rounds: int,
                   steps: int) -> dict[str, dict[str, float]]:
    """pp=2 (tp=1), 8 micro-batches: 1F1B and interleaved (vp=2), overlap_p2p off/on."""
    pp_size = {**size, "layers": 4, "microbatches": 8, "seq": size["seq"] // 2}
    configs: dict[str, Config] = {}
    for schedule, vp in (("1f1b", 1), ("interleaved_1f1b", 2)):
        base = bench_config(1, 2, 1, **pp_size)
        for overlap in (False, True):
            par = dataclasses.replace(base.parallel, vp=vp, schedule=schedule,
                                      overlap_p2p=overlap)
            configs[f"vp{vp} overlap={'on' if overlap else 'off'}"] = validate(
                dataclasses.replace(base, parallel=par), 2)
    extras = {name: ExecOptions(overlap=cfg.parallel.overlap_p2p) for name, cfg in configs.items()}
    res = pool.run(variants_rank, configs, extras, rounds, steps)
    tokens = pp_size["seq"] * pp_size["micro"] * pp_size["microbatches"]
    table = summarise(res, tokens, "pp", lambda name: name.replace("=on", "=off"))
    print_table(f"pp=2, {pp_size['microbatches']} micro-batches, p2p communication", table)
    return table


SECTIONS = ("probe", "block", "model", "pp")


def print_probe(probe: dict[str, float]) -> None:
    """The probe's numbers of one rank."""
    print("probe (2 ranks, all-gather of 4 MiB per rank vs a 640^3 matmul), rank 0:")
    for key, value in probe.items():
        unit = " ms" if key.endswith("_s") else ""
        print(f"  {key:<24} {value * 1e3 if unit else value:>8.3f}{unit}")


def run_sections(pool: RankPool, sections: list[str], size: dict[str, int], rounds: int,
                 steps: int, quick: bool) -> dict[str, Any]:
    """Run the chosen measurements; returns their report entries."""
    report: dict[str, Any] = {}
    if "probe" in sections:
        report["probe"] = pool.run(probe_rank, 1 << 20, 640, 10 if quick else 60)
        print_probe(report["probe"][0])
    if "block" in sections:
        ffn = -(-(8 * size["hidden"] // 3) // 64) * 64
        res = pool.run(block_rank, size["hidden"], ffn, size["seq"], rounds, 3 * steps)
        report["tp2_sp_mlp_block"] = summarise(res, size["seq"], "tp", lambda _: "chunks=1")
        print_table("tp=2 + sp, one SwiGLU MLP block forward+backward", report["tp2_sp_mlp_block"])
    if "model" in sections:
        configs = {f"chunks={n}": bench_config(2, 1, n, **size) for n in CHUNKS}
        extras = {name: ExecOptions() for name in configs}
        res = pool.run(variants_rank, configs, extras, rounds, steps)
        tokens = size["seq"] * size["micro"] * size["microbatches"]
        report["tp2_sp"] = summarise(res, tokens, "tp", lambda _: "chunks=1")
        report["tp2_sp_ops_rank0_last_step"] = {k: v[-1]["ops"] for k, v in res[0].items()}
        print_table("tp=2 + sp, llama training step, tp communication", report["tp2_sp"])
    if "pp" in sections:
        if importlib.util.find_spec("colonnade.pipeline.executor") is not None:
            pp_size = {**size, "hidden": size["hidden"] // 2}
            report["pp2"] = bench_pipeline(pool, pp_size, rounds, steps)
        else:
            report["pp2"] = "skipped: colonnade/pipeline/executor.py does not exist yet"
            print(f"\npp=2: {report['pp2']}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--seq", type=int, default=512, help="sequence length (tp sections)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="small model, 2 rounds (smoke)")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if unknown := sorted(set(sections) - set(SECTIONS)):
        parser.error(f"--sections: unknown {unknown}; choose from {SECTIONS}")
    size = (dict(hidden=128, layers=2, seq=64, micro=1, microbatches=1) if args.quick else
            dict(hidden=args.hidden, layers=2, seq=args.seq, micro=1, microbatches=1))
    rounds = 2 if args.quick else args.rounds
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "backend": "gloo",
                    "threads_per_rank": 1, "load_average_before": os.getloadavg()},
        "rounds": rounds, "steps_per_round": args.steps, "model": size}
    with RankPool(2, timeout_s=3600) as pool:
        report.update(run_sections(pool, sections, size, rounds, args.steps, args.quick))
    report["machine"]["load_average_after"] = os.getloadavg()
    print(f"\nload average before {report['machine']['load_average_before']}, after "
          f"{report['machine']['load_average_after']} ({os.cpu_count()} cpus)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
