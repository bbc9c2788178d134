"""Activation memory: measured bytes per layer against the analytic model; recompute's cost.

    .venv/bin/python benchmarks/memory.py [--rounds 7] [--json PATH]

Part 1 measures, with saved-tensor hooks, the bytes each transformer layer keeps for backward
for one micro-batch (bf16, the paper's 16-bit) over several (arch, s, b, h, a, kv, tp, sp,
dropout, recompute) settings, on 1 and on 2 gloo ranks, next to the formula derived for this
code (:mod:`colonnade.analysis.activations`, target: within 10%) and Korthikanti et al. 2022's
closed form (their GPT; scaled to the element size).
Part 2 trains the tiny model (configs/tiny-llama.toml, fp32, 2 micro-batches) one step per
recompute mode and reports the peak of live tensor bytes during forward + backward and the
median step time (rounds interleave the modes; ratios against no recomputation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from colonnade.analysis.activations import ActivationShape, chunk_layer_bytes, paper_layer_bytes
from colonnade.analysis.measure import PeakTensorBytes, measure_layers, relative_error
from colonnade.config import Config, load_config, resolve, validate
from colonnade.config.sections import ModelConfig, ParallelConfig, TrainingConfig
from colonnade.data.synthetic import random_batches
from colonnade.models.build import build_chunks
from colonnade.models.recompute import RecomputePlan, install
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.p2p import message_shape
from colonnade.pipeline.plan import StepPlan
from colonnade.training.step import forward_backward

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "memory.json"
# (arch, s, b, h, a, kv, ffn): llama with GQA and SwiGLU; gpt2 is the paper's own layer.
SHAPES = [
    ("llama", 128, 2, 128, 8, 4, 352),
    ("llama", 256, 1, 128, 4, 4, 384),
    ("llama", 64, 4, 256, 8, 2, 704),
    ("gpt2", 128, 2, 128, 8, 8, 512),
]
LAYOUTS = [(1, False), (2, False), (2, True)]
PLANS = [RecomputePlan(), RecomputePlan("selective"), RecomputePlan("full")]
STEP_PLANS = {
    "none": RecomputePlan(),
    "selective": RecomputePlan("selective"),
    "full/uniform/1": RecomputePlan("full", "uniform", 1),
    "full/uniform/2": RecomputePlan("full", "uniform", 2),
    "full/block/2": RecomputePlan("full", "block", 2),
}


# ----------------------------------------------------------------------------- part 1


def shape_config(shape: tuple[Any, ...], tp: int, sp: bool, dropout: float) -> Config:
    """A 2-layer bf16 model of ``shape`` on ``tp`` ranks."""
    arch, s, b, h, a, kv, ffn = shape
    model = ModelConfig(arch=arch, num_layers=2, hidden_size=h, num_heads=a, num_kv_heads=kv,
                        ffn_hidden_size=ffn, vocab_size=256, max_seq_len=s, bias=arch == "gpt2",
                        hidden_dropout=dropout, attention_dropout=dropout)
    config = Config(model=model, parallel=ParallelConfig(tp=tp, sp=sp),
                    training=TrainingConfig(seq_len=s, micro_batch_size=b, microbatches=1,
                                            precision="bf16", eval_interval=0))
    return validate(resolve(config, tp), tp)


def measure_rows(tp: int, sp: bool) -> list[dict[str, Any]]:
    """Rank body (or the single process): one row per shape, dropout and plan."""
    torch.set_num_threads(1)
    groups = (ProcessGroups.build(ParallelDims(tp=tp)) if tp > 1 else ProcessGroups.single())
    rows = []
    for shape in SHAPES:
        for dropout in (0.0, 0.1):
            config = shape_config(shape, tp, sp, dropout)
            (chunk,) = build_chunks(config, groups, dtype=torch.bfloat16)
            arch, s, b, h, a, kv, _ = shape
            shape_x = message_shape((b, s), h, tp, sp)  # [s/tp, b, h] under sp, else [b, s, h]
            x = torch.randn(shape_x).to(torch.bfloat16)
            act = ActivationShape.from_model(config.model, s, b, tp=tp, sp=sp,
                                             dtype=torch.bfloat16)
            for plan in PLANS:
                install([chunk], plan)
                measured = measure_layers(chunk, x).mean
                derived = chunk_layer_bytes(act, plan, 2) / 2
                paper = paper_layer_bytes(s, b, h, a, tp=tp, sp=sp, recompute=plan.mode)
                rows.append({"arch": arch, "s": s, "b": b, "h": h, "a": a, "kv": kv,
                             "ffn": act.ffn, "tp": tp, "sp": sp, "dropout": dropout,
                             "recompute": plan.mode, "measured": measured, "derived": derived,
                             "error": relative_error(measured, derived), "paper": paper,
                             "tp_rank": groups.tp_rank})
    return rows


def part1() -> list[dict[str, Any]]:
    """Every layout's rows (tp = 2 on a pool of 2 gloo ranks; rank 0's rows, both checked)."""
    from colonnade.parallel.pool import RankPool

    rows = measure_rows(1, False)
    pool = RankPool(2, timeout_s=600.0)
    try:
        for tp, sp in LAYOUTS[1:]:
            per_rank = pool.run(measure_rows, tp, sp)
            for mine, other in zip(per_rank[0], per_rank[1], strict=True):
                assert mine["measured"] == other["measured"], "tp ranks differ"
            rows += per_rank[0]
    finally:
        pool.close()
    print("\nBytes kept for backward per layer and micro-batch (bf16): measured, this code's "
          "derived formula, Korthikanti et al.'s closed form (their GPT: 4h GELU, eager "
          "attention, dropout)")
    head = (f"{'arch':<5} {'s':>4} {'b':>2} {'h':>4} {'a':>2} {'kv':>2} {'tp':>2} {'sp':>2} "
            f"{'drop':>4} {'recompute':<9} {'measured':>10} {'derived':>10} {'err':>6} "
            f"{'paper':>10} {'meas/paper':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['arch']:<5} {r['s']:>4} {r['b']:>2} {r['h']:>4} {r['a']:>2} {r['kv']:>2} "
              f"{r['tp']:>2} {'y' if r['sp'] else '-':>2} {r['dropout']:>4} "
              f"{r['recompute']:<9} {r['measured']:>10.0f} {r['derived']:>10.0f} "
              f"{r['error']:>6.1%} {r['paper']:>10.0f} {r['measured'] / r['paper']:>10.2f}")
    worst = max(r["error"] for r in rows)
    print(f"max |measured - derived| / derived = {worst:.2%} over {len(rows)} settings "
          "(target 10%)")
    return rows


# ----------------------------------------------------------------------------- part 2


def tiny_config(dropout: float) -> Config:
    """configs/tiny-llama.toml in fp32 with hidden and attention dropout ``dropout``."""
    config = load_config(ROOT / "configs" / "tiny-llama.toml",
                         [f"--model.hidden_dropout={dropout}",
                          f"--model.attention_dropout={dropout}", "--training.precision=fp32"])
    return validate(resolve(config, 1), 1)


def step_costs(dropout: float, rounds: int) -> list[dict[str, Any]]:
    """Peak live bytes and median step time of one training step per recompute mode."""
    config = tiny_config(dropout)
    groups = ProcessGroups.single()
    (chunk,) = build_chunks(config, groups, dtype=torch.float32)
    batches = random_batches(config, seed=0)
    chunk.train()

    def step() -> None:
        forward_backward([chunk], batches, StepPlan(groups, step=0))

    results: dict[str, dict[str, Any]] = {}
    for name, plan in STEP_PLANS.items():
        install([chunk], plan)
        step()  # gradients now exist: the peak below holds activations and temporaries only
        with PeakTensorBytes() as meter:
            step()
        results[name] = {"mode": name, "dropout": dropout, "peak_bytes": meter.peak,
                         "times": []}
    for _ in range(rounds):
        for name, plan in STEP_PLANS.items():
            install([chunk], plan)
            start = time.perf_counter()
            step()
            results[name]["times"].append(time.perf_counter() - start)
    base = results["none"]
    base_time = statistics.median(base["times"])
    for rec in results.values():
        rec["step_s"] = statistics.median(rec.pop("times"))
        rec["peak_vs_none"] = rec["peak_bytes"] / base["peak_bytes"]
        rec["time_vs_none"] = rec["step_s"] / base_time
    return list(results.values())


def part2(rounds: int) -> list[dict[str, Any]]:
    """Both dropout settings, printed."""
    config = tiny_config(0.0)
    m, tr = config.model, config.training
    print(f"\nTiny model (configs/tiny-llama.toml: {m.num_layers} layers, h {m.hidden_size}, "
          f"a {m.num_heads}, kv {m.kv_heads}, s {tr.seq_len}, b {tr.micro_batch_size}, "
          f"{tr.microbatches} micro-batches, fp32, CPU): one training step per mode, "
          f"median of {rounds} rounds")
    head = (f"{'dropout':>7} {'recompute':<15} {'peak MiB':>9} {'peak/none':>9} "
            f"{'step ms':>8} {'time/none':>9}")
    print(head)
    print("-" * len(head))
    out = []
    for dropout in (0.0, 0.1):
        for rec in step_costs(dropout, rounds):
            print(f"{dropout:>7} {rec['mode']:<15} {rec['peak_bytes'] / 2**20:>9.2f} "
                  f"{rec['peak_vs_none']:>9.2f} {rec['step_s'] * 1e3:>8.1f} "
                  f"{rec['time_vs_none']:>9.2f}")
            out.append(rec)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per mode")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = part1()
    steps = part2(args.rounds)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    record = {"per_layer": layers, "tiny_model_steps": steps,
              "torch": torch.__version__, "threads": 1}
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
