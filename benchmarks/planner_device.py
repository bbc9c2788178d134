"""Planner vs one real device: a single-device training step measured against its prediction.

    .venv/bin/python benchmarks/planner_device.py [--model gpt3-1.3b] [--cluster h200]
        [--micro-batch 4] [--microbatches 2] [--seq-len 2048] [--steps 10] [--warmup 3]
        [--set section.field=value ...] [--json PATH]
    .venv/bin/python benchmarks/planner_device.py --quick      # tiny model on the CPU (smoke)

The prepared GPU check (run it when a session is lent a GPU): one process trains a preset
model on random tokens with the real ``Trainer.train_step`` (bf16 params, fp32 masters,
fused SDPA attention: dropout is off by default here), synchronising the device around every
step, and reports step time, tokens/s, model TFLOP/s and MFU against the device's peak, peak
memory, and the planner's prediction for the same layout (tp = pp = dp = 1) on ``--cluster``.
The A100 efficiency carried to H100/H200 presets is not fitted to those devices: the ratio
printed here is the check of that assumption.  Writes benchmarks/results/planner_device.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from colonnade.analysis.estimate import estimate
from colonnade.analysis.hardware import get_cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.config.load import load_config
from colonnade.config.validate import resolve, validate
from colonnade.data.synthetic import random_batches
from colonnade.device import memory_stats, peak_tflops, pick_device, synchronize
from colonnade.models.build import param_dtype
from colonnade.models.counts import flops_per_token
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime

RESULTS = Path(__file__).resolve().parent / "results" / "planner_device.json"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def build_config(args: argparse.Namespace) -> object:
    """The preset with this run's batch shape and overrides, resolved for one device."""
    overrides = [f"--training.micro_batch_size={args.micro_batch}",
                 f"--training.microbatches={args.microbatches}",
                 f"--training.global_batch_size={args.micro_batch * args.microbatches}",
                 f"--training.seq_len={args.seq_len}", f"--training.precision={args.precision}",
                 f"--training.steps={args.warmup + args.steps}", "--training.eval_interval=0",
                 f"--training.device={args.device}", "--model.hidden_dropout=0",
                 "--model.attention_dropout=0", *[f"--{s}" for s in args.set]]
    cfg = load_config(CONFIGS / f"{args.model}.toml", overrides)
    return validate(resolve(cfg, 1), 1)


def measure(cfg: object, warmup: int, steps: int) -> dict[str, float]:
    """Seconds of each timed step (device synchronised) and the peak memory."""
    device = pick_device(cfg.training.device)  # type: ignore[attr-defined]
    trainer = Trainer(Runtime(cfg, device, ProcessGroups.single()))  # type: ignore[arg-type]
    batches = [(t.to(device), y.to(device)) for t, y in random_batches(cfg, seed=1)]
    times = []
    for k in range(warmup + steps):
        synchronize(device)
        t0 = time.perf_counter()
        trainer.train_step(batches)
        synchronize(device)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"step_s": statistics.median(times), "min_step_s": min(times), "device": name,
            "peak_tflops": peak_tflops(device, param_dtype(cfg.training.precision), None),
            **memory_stats(device)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt3-1.3b", help="a preset in configs/")
    p.add_argument("--cluster", default="h200", help="planner cluster preset to compare with")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="more config overrides, e.g. model.num_layers=12")
    p.add_argument("--quick", action="store_true",
                   help="tiny llama on the CPU against cpu-local (a smoke test)")
    p.add_argument("--json", default=str(RESULTS))
    args = p.parse_args()
    if args.quick:
        args.model, args.cluster, args.device, args.precision = ("tiny-llama", "cpu-local",
                                                                 "cpu", "fp32")
        args.micro_batch, args.microbatches, args.seq_len, args.steps = 4, 2, 128, 3
        args.warmup = 1
    torch.set_num_threads(1) if args.device == "cpu" else None
    cfg = build_config(args)
    got = measure(cfg, args.warmup, args.steps)
    tokens = args.micro_batch * args.microbatches * args.seq_len
    model_flops = flops_per_token(cfg.model, args.seq_len) * tokens  # type: ignore[attr-defined]
    pred = estimate(Workload.from_config(cfg), Layout.from_config(cfg, 1),  # type: ignore[arg-type]
                    get_cluster(args.cluster))
    rows = {
        "measured": {"step_s": got["step_s"], "tokens_per_s": tokens / got["step_s"],
                     "tflops": model_flops / got["step_s"] / 1e12,
                     "mfu": model_flops / got["step_s"] / pred.peak_flops},
        "planner": {"step_s": pred.step_s, "tokens_per_s": pred.tokens_per_s,
                    "tflops": model_flops / pred.step_s / 1e12, "mfu": pred.mfu},
    }
    print(f"{args.model} on {got['device']} ({args.precision}, mb {args.micro_batch} x "
          f"{args.microbatches}, seq {args.seq_len}); planner cluster {args.cluster}")
    print(f"{'':10} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7}")
    for name, r in rows.items():
        print(f"{name:10} {r['step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>10,.0f} "
              f"{r['tflops']:>8.2f} {r['mfu']:>7.1%}")
    ratio = pred.step_s / got["step_s"]
    print(f"MFU of both rows against the {args.cluster} peak {pred.peak_flops / 1e12:.3g} "
          f"TFLOP/s (colonnade's device table: {got['peak_tflops'] or 'not listed'})")
    print(f"predicted / measured step time {ratio:.3f}; peak memory "
          f"{max(v for k, v in got.items() if k.startswith('mem')):.2f} GiB")
    out = {"model": args.model, "cluster": args.cluster, "precision": args.precision,
           "micro_batch": args.micro_batch, "microbatches": args.microbatches,
           "seq_len": args.seq_len, "steps": args.steps, "measurement": got, "rows": rows,
           "predicted_over_measured": ratio, "planner_breakdown_s": pred.timing.as_dict()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
