"""One-GPU check: demo and 1.3B training in bf16 against the planner, SDPA, async save, compile.

    python benchmarks/gpu_check.py [--budget-s 450] [--json PATH] [--workdir DIR] [--cluster NAME]
    python benchmarks/gpu_check.py --cpu-smoke      # the same stages at tiny sizes on the CPU

Stages, each timed and failing soft (a failed stage is reported, the others still run), all
within one global time budget (a stage that would start past it is reported as skipped):

  environment       torch, CUDA, the device and the planner cluster its numbers are set against
  train_demo        ``colonnade train`` of configs/demo.toml on one device (tp = pp = 1, bf16):
                    median tokens/s, model TFLOP/s, MFU and peak memory of the timed steps, each
                    next to the planner's prediction for that layout on the cluster
  train_1p3b        the same for configs/gpt3-1.3b.toml (dropout off: the fused-attention path)
  sdpa_kernel       the SDPA backend bf16 causal attention dispatches to (must be fused)
  async_checkpoint  asynchronous saves of a ~0.4B-parameter trainer's state: the training
                    thread's stall at the first save with the host buffers reserved at start
                    (stall_s) and without (stall_unreserved_s, the old first save), of a second
                    save staged while the first is still written (stall_overlap_s), the write's
                    total time and rate, a step taken meanwhile
  generate          ``colonnade generate`` of the demo checkpoint on the device, greedy
  gpu_tests         ``pytest -m gpu tests`` (not applicable on a CPU)
  compile           training.compile off vs on (torch.compile per transformer layer), one
                    process, the same initial weights and batches: the compiled trainer's
                    first step (compilation included), then interleaved steps of both, medians
                    and the median per-round ratio of step times, and the two losses
  train_llama8b_cut, plain_pytorch, torchtitan, fp8, cuda_graphs: benchmarks/gpu_peers.py

Prints a table and writes JSON (default benchmarks/results/gpu_check.json; --cpu-smoke:
benchmarks/results/gpu_check_cpu_smoke.json); benchmarks/gpu_report.py turns the JSON into the
README's table (``--readme``).  The training runs go through the CLI, the
checkpoint stage through the library's Trainer and save_training: no training code here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FUSED = ("flash", "efficient", "cudnn")
CLUSTER_BY_NAME = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"))
"""Device-name substring -> planner preset; a GPU matching none is set against the H200's."""


from benchmarks import gpu_peers  # noqa: E402  (REPO on sys.path first)
from benchmarks.gpu_peers import NotApplicable, NotAvailable  # noqa: E402
from benchmarks.gpu_report import device_name, print_table, readme_table  # noqa: E402


@dataclass
class Sizes:
    """What differs between the GPU run and the CPU smoke run."""

    device: str
    demo: list[str]
    big: list[str]
    demo_steps: int
    big_steps: int
    warm: int
    ckpt_model: dict[str, int]
    ckpt_tokens: tuple[int, int]
    sdpa_shape: tuple[int, int, int, int]
    new_tokens: int
    compile_model: dict[str, int]
    compile_tokens: tuple[int, int]
    """(micro-batch, seq) of the compile stage."""
    compile_rounds: int
    """Interleaved timed rounds of the compile stage (one step of each trainer per round)."""
    llama: list[str] = field(default_factory=list)
    """Flags of the llama3-8b-cut run besides the config file's."""
    llama_shape: dict[str, int] = field(default_factory=dict)
    """Overrides of the config file's Llama shape for the plain PyTorch and torchtitan runs."""


GPU = Sizes(
    device="cuda",
    demo=["--training.precision=bf16"],
    big=["--training.precision=bf16", "--training.micro_batch_size=4",
         "--training.microbatches=2", "--training.global_batch_size=8",
         "--model.hidden_dropout=0", "--model.attention_dropout=0",
         "--data.max_corpus_bytes=4000000"],  # the demo's corpus, prepared once
    demo_steps=40, big_steps=10, warm=3,
    ckpt_model={"num_layers": 8, "hidden_size": 2048, "num_heads": 16}, ckpt_tokens=(4, 1024),
    sdpa_shape=(4, 16, 2048, 128), new_tokens=64,
    compile_model={"num_layers": 12, "hidden_size": 768, "num_heads": 12},
    compile_tokens=(8, 1024), compile_rounds=10,
    llama=["--model.hidden_dropout=0", "--model.attention_dropout=0",
           "--data.max_corpus_bytes=4000000"],
)
CPU = Sizes(
    device="cpu",
    demo=["--training.precision=fp32", "--training.seq_len=32", "--model.hidden_size=32",
          "--model.num_layers=2", "--training.micro_batch_size=2", "--training.microbatches=2",
          "--data.max_corpus_bytes=200000"],
    big=["--training.precision=fp32", "--training.seq_len=32", "--model.hidden_size=32",
         "--model.num_layers=2", "--model.num_heads=4", "--training.micro_batch_size=2",
         "--training.microbatches=1", "--training.global_batch_size=2",
         "--model.hidden_dropout=0", "--model.attention_dropout=0",
         "--data.max_corpus_bytes=200000"],
    demo_steps=3, big_steps=2, warm=1,
    ckpt_model={"num_layers": 2, "hidden_size": 32, "num_heads": 4}, ckpt_tokens=(2, 32),
    sdpa_shape=(1, 2, 64, 16), new_tokens=12,
    compile_model={"num_layers": 2, "hidden_size": 32, "num_heads": 4},
    compile_tokens=(2, 32), compile_rounds=3,
    llama=["--training.precision=fp32", "--training.seq_len=32", "--model.max_seq_len=32",
           "--model.hidden_size=32", "--model.num_layers=2", "--model.num_heads=4",
           "--model.num_kv_heads=2", "--model.ffn_hidden_size=64", "--model.vocab_size=2048",
           "--training.global_batch_size=2", "--data.max_corpus_bytes=200000"],
    llama_shape={"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64,
                 "vocab": 2048, "seq": 32, "batch": 2},
)


@dataclass
class Context:
    """One run of the check: mode, sizes, where files go, the clock."""

    sizes: Sizes
    cpu_smoke: bool
    workdir: Path
    cluster: str
    budget_s: float
    start: float = field(default_factory=time.monotonic)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each passed stage's record by name (later stages compare against earlier ones)."""

    def remaining(self) -> float:
        """Seconds left of the global budget."""
        return self.budget_s - (time.monotonic() - self.start)


def run_cli(ctx: Context, args: list[str], cap_s: float, cwd: Path = REPO,
            pythonpath: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m <args>`` in ``cwd``, limited by ``cap_s`` and the global budget; a non-zero
    exit raises with the tail of its output."""
    limit = max(1.0, min(cap_s, ctx.remaining()))
    path = os.pathsep.join(p for p in (pythonpath or str(REPO), os.environ.get("PYTHONPATH"))
                           if p)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": path}
    try:
        proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, text=True,
                              capture_output=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"timed out after {limit:.0f}s: {' '.join(args[:3])}") from err
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        raise RuntimeError(f"exit {proc.returncode}: " + " | ".join(tail))
    return proc


def stage_environment(ctx: Context) -> dict[str, Any]:
    """Versions, the device and the planner cluster the predictions use."""
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "device": ctx.sizes.device, "cluster": ctx.cluster}
    if not ctx.cpu_smoke:
        out["gpu"] = gpu_name()
    return out


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi ('' when it cannot be asked)."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""


def cluster_for(name: str) -> str:
    """Planner preset for a GPU name (see :data:`CLUSTER_BY_NAME`)."""
    for key, preset in CLUSTER_BY_NAME:
        if key in name:
            return preset
    return "h200"


def train(ctx: Context, name: str, config: str, steps: int, extra: list[str],
          save: bool) -> dict[str, Any]:
    """Train through ``colonnade train`` in the work directory (the built-in corpus is prepared
    once into its data/stdlib-2k); measured medians next to the planner's prediction."""
    run_dir = ctx.workdir / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["colonnade.cli", "train", "--config", str(REPO / config), "--parallel.tp=1",
            "--parallel.pp=1",
            "--parallel.sp=false", f"--training.steps={steps}", "--training.eval_interval=0",
            f"--training.device={ctx.sizes.device}", "--logging.log_interval=1",
            f"--logging.dir={run_dir}", "--logging.progress=false",
            "--logging.tensorboard=false",
            "--data.prepared_dir=data/stdlib-2k", *extra]
    save_dir = ctx.workdir / "ckpt" / name if save else "none"  # none: no 1.3B final save
    args.append(f"--checkpoint.save={save_dir}")
    run_cli(ctx, args, cap_s=240, cwd=ctx.workdir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if "loss" in r]
    timed = steps_done[ctx.sizes.warm:] or steps_done
    measured = {
        "steps": len(steps_done), "timed_steps": len(timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "tflops": statistics.median(r["tflops_per_device"] for r in timed),
        "peak_mem_gib": max(r.get("mem_peak_gib", 0.0) for r in timed),
        "first_loss": steps_done[0]["loss"], "last_loss": steps_done[-1]["loss"],
    }
    if all("mfu" in r for r in timed):
        measured["mfu"] = statistics.median(r["mfu"] for r in timed)
    return {"measured": measured, "predicted": predict(run_dir / "config.toml", ctx.cluster)}


def predict(config_toml: Path, cluster_name: str) -> dict[str, float]:
    """The planner's tokens/s, model TFLOP/s, MFU and memory for the run's resolved config."""
    from colonnade.analysis.estimate import estimate
    from colonnade.analysis.hardware import get_cluster
    from colonnade.analysis.layout import Layout, Workload
    from colonnade.config.load import load_config

    cfg = load_config(config_toml)
    w = Workload.from_config(cfg)
    layout = Layout(micro_batch=cfg.training.micro_batch_size, recompute=cfg.training.recompute)
    est = estimate(w, layout, get_cluster(cluster_name))
    return {"tokens_per_s": est.tokens_per_s, "tflops": est.mfu * est.peak_flops / 1e12,
            "mfu": est.mfu, "peak_mem_gib": est.memory.total / 2**30}


def stage_train_demo(ctx: Context) -> dict[str, Any]:
    """configs/demo.toml on one device (also writes the checkpoint `generate` samples)."""
    return train(ctx, "demo", "configs/demo.toml", ctx.sizes.demo_steps, ctx.sizes.demo,
                 save=True)


def stage_train_1p3b(ctx: Context) -> dict[str, Any]:
    """configs/gpt3-1.3b.toml (tiny layers on the CPU smoke run) on the demo's data: its
    vocab_size (50257) stays, the data's 2048-token tokenizer is named (unnamed, a 50257-token
    BPE would be asked for and the demo's prepared dir is refused as another dataset)."""
    return train(ctx, "gpt3-1.3b", "configs/gpt3-1.3b.toml", ctx.sizes.big_steps,
                 [*ctx.sizes.big, "--data.tokenizer=data/stdlib-2k/tokenizer.json"], save=False)


def stage_sdpa(ctx: Context) -> dict[str, Any]:
    """The backend of bf16 causal SDPA (fused expected) and one forward's milliseconds."""
    import torch
    import torch.nn.functional as F

    from colonnade.device import synchronize
    from tests.gpu.helpers import sdpa_backends

    device = torch.device(ctx.sizes.device)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*ctx.sizes.sdpa_shape, generator=gen).to(device, torch.bfloat16)
               for _ in range(3))
    found = sdpa_backends(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    synchronize(device)
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, is_causal=True)
    synchronize(device)
    ms = (time.perf_counter() - t0) * 1e3
    if not found or not set(found) <= set(FUSED):
        raise RuntimeError(f"bf16 causal SDPA ran {found}, not a fused kernel {FUSED}")
    return {"measured": {"backends": found, "forward_ms": ms, "shape": ctx.sizes.sdpa_shape}}


def ckpt_trainer(ctx: Context, model_size: dict[str, int] | None = None,
                 tokens: tuple[int, int] | None = None, compile: bool = False) -> Any:
    """A single-process Trainer of a GPT model on the device (no data: batches are fed);
    the checkpoint stage's size unless ``model_size`` / ``tokens`` (micro-batch, seq) say."""
    import torch

    from colonnade.config.sections import Config, ModelConfig, TrainingConfig
    from colonnade.parallel.dims import ParallelDims
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    batch, seq = tokens or ctx.sizes.ckpt_tokens
    model = ModelConfig(arch="gpt2", vocab_size=2048, max_seq_len=seq,
                        **(model_size or ctx.sizes.ckpt_model))
    precision = "fp32" if ctx.cpu_smoke else "bf16"
    tr = TrainingConfig(steps=100, seq_len=seq, micro_batch_size=batch, microbatches=1,
                        global_batch_size=batch, precision=precision, eval_interval=0,
                        compile=compile)
    cfg = Config(model=model, training=tr)
    return Trainer(Runtime(cfg, torch.device(ctx.sizes.device),
                           ProcessGroups.build(ParallelDims())), None)


def stage_async_checkpoint(ctx: Context) -> dict[str, Any]:
    """Asynchronous saves: the caller's stall (host buffers reserved at start, not reserved,
    a second save while the first is written), the write's time and rate, a step meanwhile."""
    import torch

    from colonnade.checkpoint.training_state import reserve_async_save, save_training
    from colonnade.device import synchronize

    trainer = ckpt_trainer(ctx)
    device = trainer.rt.device
    batch, seq = ctx.sizes.ckpt_tokens
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        data = torch.randint(0, 2048, (batch, seq + 1), generator=gen)
        t0 = time.perf_counter()
        trainer.train_step([(data[:, :-1].to(device), data[:, 1:].to(device))])
        synchronize(device)
        return time.perf_counter() - t0

    def save(name: str) -> tuple[Any, float]:
        root = ctx.workdir / "ckpt" / name
        t0 = time.perf_counter()
        pending = save_training(trainer, root, async_save=True, keep_last=1)
        return pending, time.perf_counter() - t0

    step()
    plain = step()
    pending, unreserved = save("async-unreserved")  # buffers allocated by the save itself
    pending.wait()
    trainer.checkpoint_stager = None
    t0 = time.perf_counter()
    reserve_async_save(trainer)
    trainer.checkpoint_stager._reserving.join()  # at start-up this overlaps the first steps
    reserve_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first, stall = save("async")
    during = step()
    second, overlap = save("async")  # staged while the first is still being written
    path = second.wait()
    total = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    params = sum(p.numel() for p in trainer.chunks[0].parameters())
    return {"measured": {"params": params, "bytes": size, "stall_s": stall,
                         "stall_unreserved_s": unreserved, "stall_overlap_s": overlap,
                         "reserve_s": reserve_s, "two_saves_total_s": total,
                         "write_gb_per_s": 2 * size / total / 1e9, "step_s": plain,
                         "step_during_save_s": during, "saved": [first.path.name, path.name]}}


def stage_generate(ctx: Context) -> dict[str, Any]:
    """``colonnade generate`` of the demo checkpoint on the device, greedy."""
    ckpt = ctx.workdir / "ckpt" / "demo"
    if not ckpt.is_dir():
        raise RuntimeError(f"no demo checkpoint at {ckpt} (train_demo failed?)")
    n = ctx.sizes.new_tokens
    t0 = time.perf_counter()
    proc = run_cli(ctx, ["colonnade.cli", "generate", str(ckpt), "--device", ctx.sizes.device,
                         "--prompt", "def ", "--max-new-tokens", str(n), "--temperature", "0"],
                   cap_s=120)
    text = proc.stdout.rstrip("\n")
    if not text.startswith("def ") or len(text) <= len("def "):
        raise RuntimeError(f"generate printed no continuation: {text[:80]!r}")
    return {"measured": {"new_tokens": n, "seconds_incl_load": time.perf_counter() - t0,
                         "chars": len(text), "sample": text[:120]}}


def stage_gpu_tests(ctx: Context) -> dict[str, Any]:
    """``pytest -m gpu tests``: every gpu-marked test."""
    if ctx.cpu_smoke:
        raise NotApplicable("not applicable on CPU (gpu-marked tests need a CUDA device)")
    proc = run_cli(ctx, ["pytest", "-p", "no:cacheprovider", "-q", "-m", "gpu", "tests"],
                   cap_s=240)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"measured": {"summary": summary}}


def stage_compile(ctx: Context) -> dict[str, Any]:
    """Step time with training.compile off and on: two trainers of the same config and seed
    (identical initial weights) take the same batches; after the compiled one's first step
    (compilation) and one warm step each, ``compile_rounds`` rounds of one step of each, the
    order alternating; medians and the median of the per-round eager / compiled ratios
    (> 1: compiled is faster)."""
    import torch

    from colonnade.device import synchronize
    from colonnade.models.compile import compiled_layers

    model, tokens = ctx.sizes.compile_model, ctx.sizes.compile_tokens
    eager = ckpt_trainer(ctx, model, tokens, compile=False)
    compiled = ckpt_trainer(ctx, model, tokens, compile=True)
    if compiled_layers(compiled.chunks) != model["num_layers"]:
        raise RuntimeError("training.compile=true did not compile every layer")
    device = eager.rt.device
    batch, seq = tokens
    gen = torch.Generator().manual_seed(0)

    def step(trainer: Any, data: torch.Tensor) -> tuple[float, float]:
        synchronize(device)
        t0 = time.perf_counter()
        loss = trainer.train_step([(data[:, :-1].to(device), data[:, 1:].to(device))])["loss"]
        synchronize(device)
        return time.perf_counter() - t0, loss

    first = torch.randint(0, 2048, (batch, seq + 1), generator=gen)
    eager_first = step(eager, first)
    compile_s, compiled_loss = step(compiled, first)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for k in range(ctx.sizes.compile_rounds + 1):
        data = torch.randint(0, 2048, (batch, seq + 1), generator=gen)
        order = [("eager", eager), ("compiled", compiled)]
        for name, trainer in order if k % 2 else order[::-1]:
            seconds = step(trainer, data)[0]
            if k > 0:  # round 0 warms both
                times[name].append(seconds)
    ratios = [e / c for e, c in zip(times["eager"], times["compiled"], strict=True)]
    med = {name: statistics.median(values) for name, values in times.items()}
    return {"measured": {
        "layers": model["num_layers"], "tokens_per_step": batch * seq,
        "first_step_compiled_s": compile_s, "eager_step_s": med["eager"],
        "compiled_step_s": med["compiled"], "speedup_median_ratio": statistics.median(ratios),
        "eager_tokens_per_s": batch * seq / med["eager"],
        "compiled_tokens_per_s": batch * seq / med["compiled"],
        "first_loss_eager": eager_first[1], "first_loss_compiled": compiled_loss,
        "rounds": len(ratios)}}


STAGES: list[tuple[str, Callable[[Context], dict[str, Any]]]] = [
    ("environment", stage_environment), ("train_demo", stage_train_demo),
    ("train_1p3b", stage_train_1p3b), ("train_llama8b_cut", gpu_peers.stage_train_llama8b_cut),
    ("plain_pytorch", gpu_peers.stage_plain_pytorch), ("torchtitan", gpu_peers.stage_torchtitan),
    ("fp8", gpu_peers.stage_fp8), ("cuda_graphs", gpu_peers.stage_cuda_graphs),
    ("compile", stage_compile), ("async_checkpoint", stage_async_checkpoint),
    ("sdpa_kernel", stage_sdpa), ("generate", stage_generate), ("gpu_tests", stage_gpu_tests),
]


def run_stages(ctx: Context, only: set[str] | None = None) -> list[dict[str, Any]]:
    """Every stage (or those in ``only``) in order: timed, failing soft, skipped once the
    budget is spent."""
    results = []
    for name, fn in STAGES:
        if only is not None and name not in only:
            continue
        rec: dict[str, Any] = {"stage": name}
        if ctx.remaining() <= 0:
            rec.update(status="skipped", seconds=0.0, note="global time budget spent")
            results.append(rec)
            continue
        t0 = time.monotonic()
        try:
            rec.update(fn(ctx))
            rec["status"] = "ok"
            ctx.results[name] = rec
        except NotApplicable as why:
            rec.update(status="n/a", note=str(why))
        except NotAvailable as why:
            rec.update(status="not available", note=str(why))
        except Exception as err:  # a failed stage is reported; the others still run
            rec.update(status="failed", error=f"{type(err).__name__}: {err}")
        rec["seconds"] = time.monotonic() - t0
        results.append(rec)
        print(f"[{ctx.budget_s - ctx.remaining():6.1f}s] {name}: {rec['status']}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same stages at tiny sizes on the CPU (CUDA-only ones n/a)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="global time budget in seconds (default 450 on a GPU, 60 smoke)")
    parser.add_argument("--json", default=None, help="where to write the results")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--only", default=None,
                        help="comma-separated stages to run (default: all): "
                        + ",".join(name for name, _ in STAGES))
    parser.add_argument("--cluster", default=None,
                        help="planner preset to predict against (default: from the GPU's name; "
                        "cpu-local with --cpu-smoke)")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke:
        from colonnade.device import has_gpu

        if not has_gpu():
            print("gpu_check: no CUDA device is visible; run on a GPU machine, or use "
                  "--cpu-smoke", file=sys.stderr)
            return 2
    cluster = args.cluster or ("cpu-local" if smoke else cluster_for(gpu_name()))
    budget = args.budget_s or (60.0 if smoke else 470.0)
    default_json = "gpu_check_cpu_smoke.json" if smoke else "gpu_check.json"
    out = Path(args.json or REPO / "benchmarks" / "results" / default_json)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = Context(CPU if smoke else GPU, smoke, workdir, cluster, budget)
        results = run_stages(ctx, set(args.only.split(",")) if args.only else None)
        total = ctx.budget_s - ctx.remaining()
    print_table(results)
    failed = [r["stage"] for r in results if r["status"] in ("failed", "skipped")]
    print(f"\ntotal {total:.1f}s of a {budget:.0f}s budget; "
          + (f"FAILED: {', '.join(failed)}" if failed else "every stage passed or n/a"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mode": "cpu-smoke" if smoke else "gpu", "cluster": cluster,
                               "device": device_name(results), "budget_s": budget,
                               "total_s": total, "stages": results}, indent=2) + "\n")
    print(f"wrote {out}\n\n" + readme_table(json.loads(out.read_text())))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
