"""Colonnade tensor parallelism against PyTorch DTensor tensor parallelism, tp=2 on gloo CPUs.

    .venv/bin/python benchmarks/tensor_parallel.py [--rounds 15] [--steps 1] [--quick] [--json PATH]
    .venv/bin/python benchmarks/tensor_parallel.py --workload gpt2-tiny|llama-tiny [--rounds 15]

``--workload gpt2-tiny`` / ``llama-tiny`` (the peer-table workloads): FULL training steps of the
whole model (embedding, blocks, head, loss, AdamW) against DTensor plans with and without
SequenceParallel, in benchmarks/tensor_parallel_train.py (its docstring says how), written to
benchmarks/results/tensor_parallel_<workload>.json with a top-level "rows" list. The default
``--workload layers`` is the layer-stack comparison below.

The same llama layer stack (RMSNorm, RoPE, GQA attention, SwiGLU; no embedding/head, so the
comparison is about the tp layers) with bit-identical initial weights runs three ways on the
same two ranks (one thread each):

* ``colonnade``        TransformerLayer from colonnade.models.blocks (tp=2, no sp), [s, b, h];
* ``dtensor``          a plain-PyTorch version of the stack, [b, s, h], parallelized with
                       ``parallelize_module``: ColwiseParallel on q, k, v, gate, up and
                       RowwiseParallel on o, down (the documented Megatron-style plan);
* ``dtensor_prepared`` the same plus PrepareModuleInput on each attention / MLP module, so
                       q, k, v (gate, up) share one replicated DTensor input (the strongest
                       DTensor plan without sequence parallelism);
* ``colonnade_sp``     Colonnade with sequence parallelism (information only).

One step = forward + backward of a micro-batch with loss mean(out^2) (no optimizer). Variants
are interleaved round by round (order rotated each round, ranks barrier-aligned); tokens/s is
the median over rounds. Bytes are counted per step: Colonnade by ``groups.stats``, DTensor by a
dispatch mode that sees every functional collective; wire bytes per rank use the ring formulas
of colonnade.parallel.comm (all-reduce 2(n-1)/n B, all-gather / reduce-scatter (n-1)/n B).
Before timing, both implementations' losses and input gradients are checked equal.
Prints a table and writes benchmarks/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from colonnade.checkpoint.export import gather_full
from colonnade.config.sections import ModelConfig
from colonnade.models.blocks import rope_tables
from colonnade.models.layer import TransformerLayer
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import spawn_ranks
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.context import ParallelContext

RESULTS = Path(__file__).resolve().parent / "results" / "tensor_parallel.json"
TP = 2
SEED = 1234
FULL = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "seq": 256, "batch": 4}
QUICK = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "seq": 64, "batch": 2}


def model_config(shape: dict[str, int]) -> ModelConfig:
    """The llama shape both implementations build (SwiGLU width by Colonnade's rule)."""
    return ModelConfig(arch="llama", num_layers=shape["layers"], hidden_size=shape["hidden"],
                       num_heads=shape["heads"], num_kv_heads=shape["kv_heads"], vocab_size=128,
                       max_seq_len=shape["seq"])


# ----------------------------------------------------------------------------- plain PyTorch


class PlainRMSNorm(nn.Module):
    """x / rms(x) * w over the last dim."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def plain_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (x_i, x_{i+d/2}) of x [b, n, s, d] by cos/sin [s, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class PlainAttention(nn.Module):
    """Causal GQA attention on [b, s, h]; head counts come from the (possibly sharded) widths."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_size
        self.d = d
        self.q = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.v = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.o = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape[0], x.shape[1], self.d
        q = self.q(x).view(b, s, -1, d).transpose(1, 2)  # [b, a/tp, s, d]
        k = self.k(x).view(b, s, -1, d).transpose(1, 2)  # [b, kv/tp, s, d]
        v = self.v(x).view(b, s, -1, d).transpose(1, 2)  # [b, kv/tp, s, d]
        q, k = plain_rope(q, cos, sin), plain_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return self.o(out.transpose(1, 2).reshape(b, s, -1))  # [b, s, h]


class PlainMLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PlainLayer(nn.Module):
    """Pre-norm block x + attn(norm x), then x + mlp(norm x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = PlainRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = PlainAttention(cfg)
        self.mlp_norm = PlainRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = PlainMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class PlainStack(nn.Module):
    """The layer stack on [b, s, h]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PlainLayer(cfg) for _ in range(cfg.num_layers))
        cos, sin = rope_tables(cfg, None, torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        for layer in self.layers:
            x = layer(x, self.cos[:s], self.sin[:s])
        return x


def dtensor_plan(cfg: ModelConfig, prepared: bool) -> dict[str, Any]:
    """Colwise on q, k, v, gate, up; rowwise on o, down; optionally one input per module."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    plan: dict[str, Any] = {}
    for i in range(cfg.num_layers):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.down"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
        if prepared:
            plan[f"layers.{i}.attn"] = PrepareModuleInput(
                input_layouts=(Replicate(), None, None),
                desired_input_layouts=(Replicate(), None, None), use_local_output=False)
            plan[f"layers.{i}.mlp"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                use_local_output=False)
    return plan


# ----------------------------------------------------------------------------- Colonnade


class ColonnadeStack(nn.Module):
    """Colonnade's TransformerLayers on [s, b, h] ([s/tp, b, h] under sp)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.layers = nn.ModuleList(TransformerLayer(cfg, ctx, i) for i in range(cfg.num_layers))
        self.rope = rope_tables(cfg, None, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, self.rope)
        return x


# ----------------------------------------------------------------------------- counting


class CollectiveBytes(TorchDispatchMode):
    """Counts the functional collectives DTensor issues: calls and payload bytes per op."""

    OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all")

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = func.overloadpacket.__name__
        if any(name.startswith(op) for op in self.OPS) and "_c10d_functional" in str(func):
            t = args[0]
            payload = t.numel() * t.element_size()
            n = self.world
            if name.startswith("all_reduce"):
                wire = 2 * (n - 1) / n * payload
            elif name.startswith("all_gather"):
                wire = (n - 1) * payload  # payload is the input shard; out = n x payload
            else:
                wire = (n - 1) / n * payload
            entry = self.ops[name]
            entry["calls"] += 1
            entry["payload_bytes"] += payload
            entry["wire_bytes"] += wire
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- ranks


def _build(shape: dict[str, int], groups: ProcessGroups) -> dict[str, Any]:
    """Every variant's model and input, with identical full weights and inputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    cfg = model_config(shape)
    models: dict[str, Any] = {}
    for sp in (False, True):
        ctx = ParallelContext(group=groups.tp, sp=sp, seed=SEED, rng=RNGTracker(SEED))
        models["colonnade_sp" if sp else "colonnade"] = ColonnadeStack(cfg, ctx)
    full = {p.sharding.key: gather_full(p, p.sharding, groups.tp)
            for p in models["colonnade"].parameters()}
    mesh = init_device_mesh("cpu", (TP,))
    for name, prepared in (("dtensor", False), ("dtensor_prepared", True)):
        plain = PlainStack(cfg)
        missing = plain.load_state_dict(full, strict=True)
        assert not missing.missing_keys and not missing.unexpected_keys
        models[name] = parallelize_module(plain, mesh, dtensor_plan(cfg, prepared))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape["batch"], shape["seq"], shape["hidden"], generator=gen)  # [b, s, h]
    x_sbh = x.transpose(0, 1).contiguous()  # [s, b, h]
    inputs = {"colonnade": x_sbh, "colonnade_sp": x_sbh.chunk(TP)[groups.tp_rank].contiguous(),
              "dtensor": x, "dtensor_prepared": x}
    return {"models": models, "inputs": inputs}


def _step(model: nn.Module, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Forward + backward of mean(out^2); returns the loss and the input gradient."""
    model.zero_grad(set_to_none=True)
    xin = x.clone().requires_grad_(True)
    loss = model(xin).pow(2).mean()
    loss.backward()
    assert xin.grad is not None
    return float(loss.detach()), xin.grad


def _check_same(built: dict[str, Any], groups: ProcessGroups) -> dict[str, float]:
    """Loss and input-gradient relative differences of each variant against colonnade."""
    models, inputs = built["models"], built["inputs"]
    ref_loss, ref_grad = _step(models["colonnade"], inputs["colonnade"])  # grad [s, b, h]
    out = {}
    for name in ("dtensor", "dtensor_prepared", "colonnade_sp"):
        loss, grad = _step(models[name], inputs[name])
        if name == "colonnade_sp":  # per-rank loss of a sequence shard: compare the sum
            t = torch.tensor([loss], dtype=torch.float64)
            groups.tp.all_reduce(t, name="bench_check")
            loss = float(t[0]) / TP
            want = ref_grad.chunk(TP)[groups.tp_rank] * TP
        else:
            want = ref_grad.transpose(0, 1)  # [b, s, h]
        out[name] = max(abs(loss - ref_loss) / abs(ref_loss),
                        float((grad - want).norm() / want.norm()))
        assert out[name] < 1e-4, f"{name} differs from colonnade by {out[name]:.2e}"
    return out


def _count_bytes(built: dict[str, Any], groups: ProcessGroups) -> dict[str, Any]:
    """Collectives of one step of every variant: {variant: {op: {calls, payload, wire}}}."""
    models, inputs = built["models"], built["inputs"]
    counts: dict[str, Any] = {}
    for name in ("colonnade", "colonnade_sp"):
        groups.stats.reset()
        _step(models[name], inputs[name])
        counts[name] = {k: {f: v[f] for f in ("calls", "payload_bytes", "wire_bytes")}
                        for k, v in groups.stats.snapshot().items()}
    for name in ("dtensor", "dtensor_prepared"):
        with CollectiveBytes(TP) as mode:
            _step(models[name], inputs[name])
        counts[name] = {k: dict(v) for k, v in sorted(mode.ops.items())}
    return counts


def bench_rank(shape: dict[str, int], rounds: int, steps: int) -> dict[str, Any]:
    """Build, check, count, then time every variant in interleaved rounds."""
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(tp=TP))
    built = _build(shape, groups)
    diffs = _check_same(built, groups)
    counts = _count_bytes(built, groups)
    names = ["colonnade", "dtensor", "dtensor_prepared", "colonnade_sp"]
    for name in names:  # warm-up
        _step(built["models"][name], built["inputs"][name])
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            model, x = built["models"][name], built["inputs"][name]
            dist.barrier()
            begin, begin_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                _step(model, x)
            used_cpu = time.process_time() - begin_cpu  # this rank, all its threads
            dist.barrier()
            times[name].append((time.perf_counter() - begin) / steps)
            cpu[name].append(used_cpu / steps)
    return {"rank": groups.rank, "diffs": diffs, "bytes": counts, "step_s": times,
            "cpu_s": cpu}


# ----------------------------------------------------------------------------- report


def summarize(results: list[dict[str, Any]], shape: dict[str, int]) -> dict[str, Any]:
    """Medians, tokens/s, bytes and ratios (wall times from rank 0, CPU times of all ranks).

    ``tokens_per_s`` = tokens per step / median wall step time. ``tokens_per_cpu_s`` = tokens
    per step / median over rounds of the CPU seconds all ranks spent on the step: on a shared,
    oversubscribed machine wall time mostly measures the scheduler, CPU time the work done.
    """
    tokens = shape["seq"] * shape["batch"]
    result = results[0]
    rows = {}
    for name, times in result["step_s"].items():
        med = statistics.median(times)
        cpu = [sum(vals) for vals in zip(*(r["cpu_s"][name] for r in results), strict=True)]
        ops = result["bytes"][name]
        rows[name] = {
            "step_s_median": med, "step_s_min": min(times), "step_s_all": times,
            "tokens_per_s": tokens / med, "cpu_s_median": statistics.median(cpu),
            "cpu_s_all": cpu, "tokens_per_cpu_s": tokens / statistics.median(cpu),
            "calls_per_step": sum(v["calls"] for v in ops.values()),
            "payload_bytes_per_step": sum(v["payload_bytes"] for v in ops.values()),
            "wire_bytes_per_step": sum(v["wire_bytes"] for v in ops.values()),
            "ops": ops,
        }
    base, base_cpu = rows["colonnade"]["tokens_per_s"], rows["colonnade"]["tokens_per_cpu_s"]
    for row in rows.values():
        row["colonnade_over_this"] = base / row["tokens_per_s"]
        row["colonnade_over_this_cpu"] = base_cpu / row["tokens_per_cpu_s"]
    s, b, h, n = shape["seq"], shape["batch"], shape["hidden"], TP
    theory = 4 * shape["layers"] * 2 * (n - 1) / n * s * b * h * 4
    return {"shape": shape, "tp": TP, "tokens_per_step": tokens, "rows": rows,
            "max_relative_difference_vs_colonnade": result["diffs"],
            "theory_wire_bytes_per_step": theory,
            "note": "forward+backward of the layer stack, fp32, gloo, 1 thread per rank; "
                    "medians over interleaved rounds"}


def print_table(summary: dict[str, Any]) -> None:
    shape = summary["shape"]
    print(f"tp={summary['tp']} llama stack: {shape['layers']} layers, h={shape['hidden']}, "
          f"heads {shape['heads']}/{shape['kv_heads']} kv, s={shape['seq']}, b={shape['batch']}"
          f" ({summary['tokens_per_step']} tokens/step), fp32, gloo, 1 thread/rank")
    head = (f"{'variant':<17} {'step ms':>8} {'min ms':>7} {'tokens/s':>9} {'col. x':>7} "
            f"{'CPU ms':>7} {'tok/CPU-s':>9} {'col. x':>7} {'calls':>5} {'wire MiB':>8}")
    print(head)
    print("-" * len(head))
    for name, row in summary["rows"].items():
        print(f"{name:<17} {1e3 * row['step_s_median']:>8.1f} {1e3 * row['step_s_min']:>7.1f} "
              f"{row['tokens_per_s']:>9.0f} {row['colonnade_over_this']:>7.3f} "
              f"{1e3 * row['cpu_s_median']:>7.1f} {row['tokens_per_cpu_s']:>9.0f} "
              f"{row['colonnade_over_this_cpu']:>7.3f} {row['calls_per_step']:>5.0f} "
              f"{row['wire_bytes_per_step'] / 2**20:>8.2f}")
    print("(step/min ms: rank 0 wall time per step, median/min over rounds; CPU ms: CPU time of "
          "both ranks per step; col. x: colonnade's throughput / this row's)")
    print(f"theory (4 all-reduces of s*b*h per layer, ring): "
          f"{summary['theory_wire_bytes_per_step'] / 2**20:.2f} MiB wire per rank per step")
    for name, row in summary["rows"].items():
        ops = ", ".join(f"{k} x{v['calls']:.0f}" for k, v in row["ops"].items())
        print(f"  {name}: {ops}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per round (default 1; 2 with --workload)")
    parser.add_argument("--quick", action="store_true", help="tiny shape, 2 rounds (smoke test)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--workload", default="layers",
                        choices=["layers", "gpt2-tiny", "llama-tiny"],
                        help="layers: the layer stack (forward + backward); a workload name: "
                             "full training steps of that model (tensor_parallel_train.py)")
    parser.add_argument("--peer-optimizer", default="fused", choices=["fused", "foreach"],
                        help="--workload: the DTensor peers' torch AdamW kernels")
    args = parser.parse_args()
    if args.workload != "layers":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from tensor_parallel_train import run

        run(args.workload, 2 if args.quick else args.rounds, 1 if args.quick else args.steps or 2,
            args.json, args.peer_optimizer)
        return
    args.json, args.steps = args.json or RESULTS, args.steps or 1
    shape = QUICK if args.quick else FULL
    rounds = 3 if args.quick else args.rounds
    begin = time.perf_counter()
    results = spawn_ranks(TP, bench_rank, shape, rounds, args.steps, timeout_s=600.0)
    summary = summarize(results, shape)
    summary["wall_s"] = time.perf_counter() - begin
    print_table(summary)
    rows = summary["rows"]
    ratio = rows["dtensor"]["colonnade_over_this"]
    best = min(rows[k]["colonnade_over_this"] for k in ("dtensor", "dtensor_prepared"))
    cpu = rows["dtensor"]["colonnade_over_this_cpu"]
    print(f"colonnade / dtensor tokens/s: {ratio:.3f}x wall median (vs the faster DTensor plan "
          f"{best:.3f}x), {cpu:.3f}x per CPU second; target >= 1.0x; "
          f"benchmark wall {summary['wall_s']:.0f} s")
    if not math.isfinite(ratio):
        raise SystemExit("no measurement")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
