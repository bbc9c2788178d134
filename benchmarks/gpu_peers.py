"""Stages of benchmarks/gpu_check.py that set Colonnade beside its peers and its new switches.

  train_llama8b_cut  ``colonnade train`` of configs/llama3-8b-cut.toml (Llama 3 8B's width,
                     8 layers, seq 8192) in bf16, next to the planner
  plain_pytorch      the same shape in a plain PyTorch loop (benchmarks/plain_llama.py:
                     regional torch.compile, fused AdamW, SDPA), next to the planner
  torchtitan         torchtitan's own llama3 model and train entry point at the same shape
                     (its 8B flavour cut to the same layers), a registry module generated here
  fp8                configs/gpt3-1.3b.toml with ``--training.fp8=tensorwise`` and ``rowwise``
                     against the bf16 run of train_1p3b (tokens/s ratio, loss gap); the CPU
                     smoke runs tensorwise only
  cuda_graphs        the demo model with ``--training.cuda_graphs=true`` against train_demo

A stage whose Colonnade flag or peer package does not exist here reports "not available" with
the reason (:class:`NotAvailable`), and the others still run. MFU of the peers is computed the
way Colonnade's is: tokens/s x the model FLOPs per token (colonnade.models.counts) / the
device's dense bf16 peak.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.gpu_check import Context

REPO = Path(__file__).resolve().parents[1]
LLAMA_CUT = "configs/llama3-8b-cut.toml"


class NotApplicable(Exception):
    """A stage that does not apply in this mode (CUDA-only checks on a CPU). Defined here, not
    in gpu_check.py: run as a script, that file is ``__main__``, and a class it defined would
    differ from the one this module imports from ``benchmarks.gpu_check``."""


class NotAvailable(Exception):
    """A stage whose package is not installed here, e.g. torchtitan (reported, not a failure)."""


def llama_shape(ctx: Context) -> dict[str, int]:
    """The Llama shape the three-way comparison runs (config file, or the smoke's sizes)."""
    from colonnade.config.load import load_config

    cfg = load_config(REPO / LLAMA_CUT)
    m, t = cfg.model, cfg.training
    shape = {"layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads,
             "kv_heads": m.num_kv_heads or m.num_heads, "ffn": m.ffn_hidden_size or 0,
             "vocab": m.vocab_size or 0, "seq": t.seq_len, "batch": t.micro_batch_size}
    shape.update(ctx.sizes.llama_shape)
    return shape


def mfu_of(ctx: Context, shape: dict[str, int], tokens_per_s: float) -> dict[str, float]:
    """Model TFLOP/s and MFU of ``tokens_per_s`` at ``shape`` (MFU only with a known peak)."""
    import torch

    from colonnade.config.sections import ModelConfig
    from colonnade.device import peak_tflops
    from colonnade.models.counts import flops_per_token

    model = ModelConfig(arch="llama", num_layers=shape["layers"], hidden_size=shape["hidden"],
                        num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                        ffn_hidden_size=shape["ffn"], vocab_size=shape["vocab"],
                        max_seq_len=shape["seq"])
    tflops = tokens_per_s * flops_per_token(model, shape["seq"]) / 1e12
    out = {"tflops": tflops}
    peak = peak_tflops(torch.device(ctx.sizes.device), torch.bfloat16, None)
    if peak:
        out["mfu"] = tflops / peak
    return out


def llama_config(ctx: Context) -> Path:
    """The resolved config of the train_llama8b_cut run (the shape the peers run), else the
    config file: what the planner predicts the peers against."""
    ran = ctx.workdir / "runs" / "llama3-8b-cut" / "config.toml"
    return ran if ran.exists() else REPO / LLAMA_CUT


def stage_train_llama8b_cut(ctx: Context) -> dict[str, Any]:
    """configs/llama3-8b-cut.toml through ``colonnade train`` (the smoke: tiny layers)."""
    from benchmarks.gpu_check import train

    return train(ctx, "llama3-8b-cut", LLAMA_CUT, ctx.sizes.big_steps,
                 [*ctx.sizes.llama, "--data.tokenizer=data/stdlib-2k/tokenizer.json"],
                 save=False)


def stage_plain_pytorch(ctx: Context) -> dict[str, Any]:
    """benchmarks/plain_llama.py at the llama shape, in this process (Colonnade's runs are
    subprocesses, so the device holds nothing else; its cache is emptied after)."""
    from benchmarks.gpu_check import predict
    from benchmarks.plain_llama import free_device_memory, run

    shape = llama_shape(ctx)
    try:
        measured = run(**shape, steps=ctx.sizes.big_steps + ctx.sizes.warm,
                       device=ctx.sizes.device, warm=ctx.sizes.warm,
                       compile=not ctx.cpu_smoke)  # inductor on 2 shared cores: minutes
    finally:
        free_device_memory()
    measured.update(mfu_of(ctx, shape, measured["tokens_per_s"]))
    return {"measured": measured, "predicted": predict(llama_config(ctx), ctx.cluster),
            "shape": shape}


TT_REGISTRY = '''"""Generated by benchmarks/gpu_peers.py: torchtitan's llama3 at the benchmark's
shape."""
from torchtitan.config import CompileConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.llama3 import config_registry as reg


def colonnade_bench():
    config = reg.{base}()
    config.model_spec.model.layers = config.model_spec.model.layers[:{layers}]
    config.hf_assets_path = {assets!r}
    config.dump_folder = {dump!r}
    config.profiler.enable_profiling = False
    config.metrics.enable_tensorboard = False
    config.metrics.log_freq = 1
    config.training.local_batch_size = {batch}
    config.training.seq_len = {seq}
    config.training.steps = {steps}
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path={data!r})
    config.checkpoint.enable = False
    config.validator.enable = False
    config.activation_checkpoint = None
    config.compile = CompileConfig(enable={compile}, components=["model", "loss"])
    return config
'''


def torchtitan_inputs(ctx: Context, shape: dict[str, int]) -> Path:
    """Write the registry module, a text dataset (the Python standard library's source, as
    the demo's) and a tokenizer folder (the demo's tokenizer.json) into the work dir."""
    import sysconfig

    root = ctx.workdir / "torchtitan"
    shutil.rmtree(root, ignore_errors=True)
    (root / "data").mkdir(parents=True)
    (root / "assets").mkdir()
    tok = ctx.workdir / "data" / "stdlib-2k" / "tokenizer.json"
    if not tok.exists():
        raise RuntimeError(f"no tokenizer at {tok} (train_demo prepares it)")
    shutil.copy(tok, root / "assets" / "tokenizer.json")
    (root / "assets" / "tokenizer_config.json").write_text(json.dumps({}))
    lines, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="replace")
        lines.append(json.dumps({"text": text}))
        size += len(text)
        if size > 4_000_000:
            break
    (root / "data" / "train.jsonl").write_text("\n".join(lines) + "\n")
    base = "llama3_debugmodel" if ctx.cpu_smoke else "llama3_8b"
    (root / "colonnade_tt_bench.py").write_text(TT_REGISTRY.format(
        base=base, layers=shape["layers"], assets=str(root / "assets"),
        dump=str(root / "out"), batch=shape["batch"], seq=shape["seq"],
        steps=ctx.sizes.big_steps + ctx.sizes.warm, data=str(root / "data"),
        compile=not ctx.cpu_smoke))
    return root


def parse_torchtitan(log: str, warm: int) -> dict[str, float]:
    """Median tokens/s (and torchtitan's own MFU, %) of its per-step lines after ``warm``."""
    tps = [float(m.replace(",", "")) for m in re.findall(r"tps: ([\d,]+)", log)]
    mfu = [float(m) for m in re.findall(r"mfu: ([\d.]+)%", log)]
    loss = [float(m) for m in re.findall(r"loss: +([\d.]+)", log)]
    if not tps:
        raise RuntimeError("torchtitan printed no 'tps:' line: " + " | ".join(
            log.strip().splitlines()[-4:]))
    out = {"tokens_per_s": statistics.median(tps[warm:] or tps), "steps": len(tps)}
    if mfu:
        out["torchtitan_mfu"] = statistics.median(mfu[warm:] or mfu) / 100
    if loss:
        out["first_loss"], out["last_loss"] = loss[0], loss[-1]
    return out


def torchtitan_import_error() -> str:
    """'' when ``torchtitan.train`` imports in a fresh interpreter (it imports triton, so not
    on a CPU-only torch), else the error's last line."""
    if importlib.util.find_spec("torchtitan") is None:
        return "No module named 'torchtitan'"
    proc = subprocess.run([sys.executable, "-c", "import torchtitan.train"], text=True,
                          capture_output=True, timeout=120, check=False)
    lines = proc.stderr.strip().splitlines()
    return "" if proc.returncode == 0 else (lines[-1] if lines else f"exit {proc.returncode}")


def stage_torchtitan(ctx: Context) -> dict[str, Any]:
    """torchtitan's llama3 through its own entry point (torchrun, one process)."""
    from benchmarks.gpu_check import predict, run_cli

    why = torchtitan_import_error()
    if why:
        raise NotAvailable(f"torchtitan.train does not import here ({why}); install its "
                           "wheels offline: benchmarks/README.md")
    shape = llama_shape(ctx)
    root = torchtitan_inputs(ctx, shape)
    sys_path = f"{root}:{REPO}"
    proc = run_cli(ctx, ["torch.distributed.run", "--standalone", "--nproc-per-node=1",
                         "-m", "torchtitan.train", "--module", "colonnade_tt_bench",
                         "--config", "colonnade_bench"], cap_s=300, cwd=root,
                   pythonpath=sys_path)
    measured = parse_torchtitan(proc.stdout + proc.stderr, ctx.sizes.warm)
    if ctx.cpu_smoke:
        shape = {**shape, "hidden": 256, "heads": 16, "kv_heads": 16, "vocab": 2048,
                 "ffn": 768}  # torchtitan's debugmodel flavour, cut to the layers
    measured.update(mfu_of(ctx, shape, measured["tokens_per_s"]))
    return {"measured": measured, "predicted": predict(llama_config(ctx), ctx.cluster),
            "shape": shape}


def stage_fp8(ctx: Context) -> dict[str, Any]:
    """1.3B with fp8 linear layers (tensorwise, rowwise) against train_1p3b's bf16 run."""
    from benchmarks.gpu_check import stage_train_1p3b, train

    base = ctx.results.get("train_1p3b") or stage_train_1p3b(ctx)
    bf16 = base["measured"]
    out: dict[str, Any] = {"bf16_tokens_per_s": bf16["tokens_per_s"]}
    for scaling in ("tensorwise",) if ctx.cpu_smoke else ("tensorwise", "rowwise"):
        run = train(ctx, f"gpt3-1.3b-fp8-{scaling}", "configs/gpt3-1.3b.toml",
                    ctx.sizes.big_steps, [*ctx.sizes.big, f"--training.fp8={scaling}",
                                          "--data.tokenizer=data/stdlib-2k/tokenizer.json"],
                    save=False)["measured"]
        out[f"{scaling}_tokens_per_s"] = run["tokens_per_s"]
        out[f"{scaling}_speedup"] = run["tokens_per_s"] / bf16["tokens_per_s"]
        out[f"{scaling}_last_loss_rel"] = run["last_loss"] / bf16["last_loss"] - 1
        if "mfu" in run:
            out[f"{scaling}_mfu_bf16_peak"] = run["mfu"]
    return {"measured": out}


def stage_cuda_graphs(ctx: Context) -> dict[str, Any]:
    """The demo model with CUDA graphs against train_demo's eager run."""
    from benchmarks.gpu_check import stage_train_demo, train

    if ctx.cpu_smoke:
        raise NotApplicable("not applicable on CPU (CUDA graphs replay GPU kernels)")
    base = (ctx.results.get("train_demo") or stage_train_demo(ctx))["measured"]
    run = train(ctx, "demo-graphs", "configs/demo.toml", ctx.sizes.demo_steps,
                [*ctx.sizes.demo, "--training.cuda_graphs=true"], save=False)
    m = run["measured"]
    m["eager_tokens_per_s"] = base["tokens_per_s"]
    m["speedup"] = m["tokens_per_s"] / base["tokens_per_s"]
    return {"measured": m, "predicted": run["predicted"]}


if __name__ == "__main__":
    sys.exit("run benchmarks/gpu_check.py")
