"""Precision-aware optimizer states: fp32 against bf16 moments (and bf16 masters) on the tiny model.

    .venv/bin/python benchmarks/optim_states.py [--steps 300] [--prepared-dir DIR]
        [--variants fp32,bf16,bf16_master] [--out benchmarks/results/optim_states.json]

configs/tiny-gpt2.toml at training.precision=bf16 on one process, on the built-in corpus
(prepared once into ``--prepared-dir``, a temporary directory by default), one Trainer per
variant, stepped in lockstep (variant A's step k, then B's, ...) so machine load drifts hit
every variant alike; every variant sees the same batches (same seed, same sampler):

  fp32          optim.state_dtype=fp32, master_dtype=fp32: fp32 master, m, v (12 bytes/param)
  bf16          optim.state_dtype=bf16: fp32 master, bf16 m, v (8 bytes/param)
  bf16_master   state_dtype=bf16, master_dtype=bf16: bf16 m, v, no master (4 bytes/param)

Reports, per variant: the loss after ``--steps`` steps (the last step's, and the mean of the last
20 steps', which is less noisy), its difference from fp32 states in percent (the target is
<= 1%), the optimizer memory per rank (``DistributedOptimizer.state_bytes()``, beside the
formula of analysis.memory), the chunked update's fixed fp32 workspace, and the median step time
and median optimizer-step time. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colonnade.analysis.memory import optimizer_bytes_per_element  # noqa: E402
from colonnade.config.load import load_config  # noqa: E402
from colonnade.config.validate import resolve, validate  # noqa: E402
from colonnade.parallel.groups import ProcessGroups  # noqa: E402
from colonnade.training.loop import Trainer  # noqa: E402
from colonnade.training.setup import Runtime, build_data, prepare_data  # noqa: E402
from colonnade.training.vocab import with_data_vocab  # noqa: E402

VARIANTS: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32"), "bf16": ("bf16", "fp32"), "bf16_master": ("bf16", "bf16")}
"""Variant -> (optim.state_dtype, optim.master_dtype)."""
LAST = 20
"""Steps the late mean loss is taken over."""


def make_trainer(prepared: str, steps: int, state: str, master: str) -> Trainer:
    """A one-process Trainer of configs/tiny-gpt2.toml at bf16 with the given state dtypes."""
    overrides = [f"--data.prepared_dir={prepared}", f"--training.steps={steps}",
                 "--training.precision=bf16", "--training.eval_interval=0",
                 f"--optim.state_dtype={state}", f"--optim.master_dtype={master}"]
    cfg = resolve(load_config(str(ROOT / "configs" / "tiny-gpt2.toml"), overrides), 1)
    groups = ProcessGroups.single()
    data = build_data(cfg, groups)
    cfg = validate(with_data_vocab(cfg, 1, data.vocab_size, False), 1)
    return Trainer(Runtime(cfg, torch.device("cpu"), groups), data)


class _Timed:
    """Wraps ``trainer.optimizer.step`` to time it (seconds per call)."""

    def __init__(self, trainer: Trainer) -> None:
        self.times: list[float] = []
        self._step = trainer.optimizer.step
        trainer.optimizer.step = self  # type: ignore[method-assign]

    def __call__(self) -> dict[str, float]:
        t0 = time.perf_counter()
        out = self._step()
        self.times.append(time.perf_counter() - t0)
        return out


def run(prepared: str, steps: int, names: list[str]) -> dict[str, Any]:
    """Train every variant ``steps`` steps in lockstep; their losses, memory and times."""
    trainers = {n: make_trainer(prepared, steps, *VARIANTS[n]) for n in names}
    timers = {n: _Timed(t) for n, t in trainers.items()}
    losses: dict[str, list[float]] = {n: [] for n in names}
    step_s: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(steps):
        for n, trainer in trainers.items():
            batches = trainer.next_batches()
            t0 = time.perf_counter()
            losses[n].append(trainer.train_step(batches)["loss"])
            step_s[n].append(time.perf_counter() - t0)
    rows = []
    params = sum(p.numel() for c in trainers[names[0]].chunks for p in c.parameters())
    for n, trainer in trainers.items():
        opt = trainer.optimizer
        state, master = VARIANTS[n]
        chunked = opt.adamw.chunked
        rows.append({
            "variant": n, "state_dtype": state, "master_dtype": master,
            "final_loss": losses[n][-1], "late_mean_loss": statistics.fmean(losses[n][-LAST:]),
            "state_bytes": opt.state_bytes(),
            "formula_bytes": optimizer_bytes_per_element("bf16", state, master) * params,
            "workspace_bytes": chunked.workspace_bytes if chunked is not None else 0,
            "median_step_ms": 1e3 * statistics.median(step_s[n][5:]),
            "median_optimizer_ms": 1e3 * statistics.median(timers[n].times[5:]),
            "losses": losses[n],
        })
    ref = rows[0]
    for row in rows:
        for key in ("final_loss", "late_mean_loss"):
            row[f"{key}_diff_pct"] = 100 * (row[key] - ref[key]) / ref[key]
    return {"benchmark": "optim_states", "config": "configs/tiny-gpt2.toml", "precision": "bf16",
            "steps": steps, "params": params, "threads": torch.get_num_threads(), "rows": rows}


KERNEL_CASES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "fp64": (torch.float64, torch.float64), "fp32": (torch.float32, torch.float32),
    "fp32 master, bf16 m v": (torch.float32, torch.bfloat16),
    "bf16 master, bf16 m v": (torch.bfloat16, torch.bfloat16)}
"""Kernel rows: (master dtype, m / v dtype); the gradients are fp64 for fp64, else fp32."""


def kernel_rows(numel: int, calls: int) -> list[dict[str, Any]]:
    """Median ms of one FlatAdamW.update of ``numel`` elements (60% decayed), fused kernel
    against the foreach form, per storage case (bf16 ones through the fp32 chunks)."""
    from colonnade.optim.adamw import AdamWGroup, AdamWHyper, FlatAdamW

    hp = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    rows = []
    for name, (master, state) in KERNEL_CASES.items():
        times: dict[bool, float] = {}
        for fused in (True, False):
            compute = torch.float64 if master == torch.float64 else torch.float32
            w = torch.randn(numel).to(master)
            g = torch.randn(numel, dtype=compute)
            m, v = torch.zeros(numel, dtype=state), torch.zeros(numel, dtype=state)
            k = 3 * numel // 5
            groups = [AdamWGroup([w[:k]], [g[:k]], [m[:k]], [v[:k]], True),
                      AdamWGroup([w[k:]], [g[k:]], [m[k:]], [v[k:]], False)]
            opt = FlatAdamW([w], [g], [m], [v], [w[:k]], groups, fused=fused, compute=compute)
            samples = []
            for step in range(1, calls + 1):
                t0 = time.perf_counter()
                opt.update(step, hp, grad_scale=1.0)
                samples.append(time.perf_counter() - t0)
            times[fused] = 1e3 * statistics.median(samples[2:])
        rows.append({"case": name, "numel": numel, "fused_ms": times[True],
                     "foreach_ms": times[False], "speedup": times[False] / times[True]})
    return rows


def table(result: dict[str, Any]) -> str:
    """The rows as a fixed-width table."""
    head = (f"{'variant':<12} {'loss@' + str(result['steps']):>9} {'d%':>7} "
            f"{'last' + str(LAST):>8} {'d%':>7} {'opt MB':>7} {'formula':>8} {'work MB':>8} "
            f"{'step ms':>8} {'opt ms':>7}")
    lines = [head]
    for r in result["rows"]:
        lines.append(
            f"{r['variant']:<12} {r['final_loss']:>9.4f} {r['final_loss_diff_pct']:>+7.2f} "
            f"{r['late_mean_loss']:>8.4f} {r['late_mean_loss_diff_pct']:>+7.2f} "
            f"{r['state_bytes'] / 1e6:>7.3f} {r['formula_bytes'] / 1e6:>8.3f} "
            f"{r['workspace_bytes'] / 1e6:>8.3f} {r['median_step_ms']:>8.1f} "
            f"{r['median_optimizer_ms']:>7.2f}")
    for r in result.get("kernels", []):
        lines.append(f"AdamW update of {r['numel']:,} elements, {r['case']:<22}: fused "
                     f"{r['fused_ms']:7.2f} ms, foreach {r['foreach_ms']:7.2f} ms "
                     f"({r['speedup']:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prepared-dir", default=None, help="prepared corpus (default: a temp dir)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernel-elements", type=int, default=3_000_000,
                    help="elements of the fused-vs-foreach kernel rows (0: none)")
    ap.add_argument("--kernels-only", action="store_true", help="only the kernel rows")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "optim_states.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.variants.split(",")
    if names[0] != "fp32" or any(n not in VARIANTS for n in names):
        raise SystemExit(f"--variants: fp32 first, then any of {', '.join(VARIANTS)}")
    t0 = time.perf_counter()
    out = Path(args.out)
    if args.kernels_only:  # keep the training rows already written
        result = json.loads(out.read_text()) if out.exists() else {"steps": 0, "rows": []}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            prepared = args.prepared_dir or str(Path(tmp) / "stdlib-2k")
            if not Path(prepared).exists():
                prepare_data(load_config(str(ROOT / "configs" / "tiny-gpt2.toml"),
                                         [f"--data.prepared_dir={prepared}"]), log=False)
            result = run(prepared, args.steps, names)
        result["seconds"] = time.perf_counter() - t0
    if args.kernel_elements:
        result["kernels"] = kernel_rows(args.kernel_elements, 20)
    print(table(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
