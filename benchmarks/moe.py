"""Mixture of experts on CPU: one MoE layer against peers, then training steps.

    .venv/bin/python benchmarks/moe.py [--parts layer,model] [--rounds 3] [--steps 3]
        [--hidden 128] [--experts 8] [--top-k 2] [--expert-ffn 256] [--seq 128] [--batch 4]
        [--no-deepspeed] [--quick] [--json PATH]

Sized for a quiet 2-core machine: the defaults (3 rounds x 3 steps) take about a minute (a
1-round, 1-step run of the default shapes took 14 s on a loaded machine; ``--quick``: tiny
shapes, one round, seconds).  Larger runs: raise --hidden, --expert-ffn, --seq, --batch.
Ranks are gloo CPU processes with one compute thread each; ep 2 on 2 cores.

Part 1, layer (forward + backward of one SwiGLU MoE layer, x [s, b, h] per rank, t = s b
tokens, softmax top-k router, dropless, fp32):

  colonnade_ep1            colonnade.moe.layer.MoELayer (grouped experts, ep 1)
  colonnade_ep2_a2a        the same at ep 2 (2 ranks, each its own tokens), 'all_to_all'
  colonnade_ep2_ag         ep 2, 'all_gather' dispatcher
  plain_loop               the peer everybody writes first: a plain-PyTorch MoE looping over
                           experts with index masks (:func:`plain_moe`, ep 1), checked equal
                           to colonnade's layer in float64 before timing
  deepspeed_ep1 / _ep2     DeepSpeed-MoE (``deepspeed.moe.layer.MoE``, top-k gating, capacity
                           t per expert: dropless but padded, :data:`DEEPSPEED_SETTING`; the
                           same SwiGLU expert) when it runs here: it does
                           on CPU / gloo after ``deepspeed.init_distributed('gloo')`` (probed
                           on every run, the error recorded in the JSON otherwise); processes
                           of its own (mp.spawn), since its comm backend is process-global

Per colonnade variant: the dispatch + combine share of the forward (wall seconds inside the
dispatcher's two calls over the layer's forward) and the ep group's wire bytes per forward +
backward (CommGroup) beside :func:`colonnade.analysis.moe.dispatch_bytes` (uniform routing)
and the exact formula at the routing that happened (equal to the byte).

Part 2, model (``Trainer.train_step``; llama, 2 layers, both ranks dp 2): the MoE model at
ep 2 ('all_to_all' and 'all_gather') against its dense-FLOP-equivalent model (one dense MLP of
width k x expert width per layer: the same active matmul FLOPs but the router) on the same
ranks; step seconds, the ep group's waited seconds and wire bytes per step beside the
planner's (:func:`colonnade.analysis.moe.step_dispatch_bytes`).

Rounds interleave the variants (order rotated); times are medians over rounds of the ranks'
medians, ratios medians of per-round ratios.  Writes benchmarks/results/moe.json
(``--quick``: a temporary file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ratios import ratio_stats
from workloads import Workload, batches, colonnade_config

from colonnade.analysis.moe import (
    MoEShape,
    all_gather_bytes,
    all_to_all_bytes,
    dispatch_bytes,
    step_dispatch_bytes,
)
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPools

RESULTS = Path(__file__).resolve().parent / "results" / "moe.json"
LAYER = ("colonnade_ep1", "colonnade_ep2_a2a", "colonnade_ep2_ag", "plain_loop")
COLONNADE = {"colonnade_ep1": (1, "all_to_all"), "colonnade_ep2_a2a": (2, "all_to_all"),
             "colonnade_ep2_ag": (2, "all_gather")}
MODEL = {"dense_equivalent": (1, "all_to_all"), "moe_ep2_a2a": (2, "all_to_all"),
         "moe_ep2_ag": (2, "all_gather")}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The benchmark's MoE shape."""

    hidden: int = 128
    experts: int = 8
    top_k: int = 2
    expert_ffn: int = 256
    seq: int = 128
    batch: int = 4

    @property
    def tokens(self) -> int:
        """t = s b tokens per rank."""
        return self.seq * self.batch

    def workload(self, layers: int = 2) -> Workload:
        """The llama workload of the model part (2 samples per rank per step)."""
        return Workload(name="moe", arch="llama", hidden=self.hidden, layers=layers, heads=4,
                        kv_heads=4, vocab=512, seq_len=self.seq, global_batch=2 * self.batch,
                        lr=1e-3, weight_decay=0.0)


QUICK = Shape(hidden=32, experts=4, top_k=2, expert_ffn=32, seq=16, batch=2)


def moe_overrides(shape: Shape, ep: int, kind: str, dense: bool = False) -> list[str]:
    """Config overrides of the MoE model (or, ``dense``, its dense-FLOP-equivalent: one MLP
    of width k x expert width)."""
    if dense:
        return [f"--model.ffn_hidden_size={shape.top_k * shape.expert_ffn}"]
    return [f"--model.num_experts={shape.experts}", f"--model.moe_top_k={shape.top_k}",
            f"--model.moe_ffn_hidden_size={shape.expert_ffn}", f"--parallel.ep={ep}",
            f"--parallel.moe_dispatcher={kind}"]


def dense_equivalent_flops(shape: Shape) -> tuple[float, float]:
    """(MoE MLP, dense-equivalent MLP) forward FLOPs per token: 2 (E h + k 3 h f_e) and
    2 x 3 h (k f_e): equal but the router's 2 E h."""
    moe = 2.0 * (shape.experts * shape.hidden + shape.top_k * 3 * shape.hidden * shape.expert_ffn)
    return moe, 2.0 * 3 * shape.hidden * shape.top_k * shape.expert_ffn


# ----------------------------------------------------------------------------- peers


def plain_moe(x: torch.Tensor, router: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor, k: int) -> torch.Tensor:
    """Plain-PyTorch MoE (the loop everybody writes first): x [t, h], router [E, h], gate /
    up [E, f, h], down [E, h, f]; softmax over the E logits (fp32, or fp64), top-k, renormalised,
    out[i] = sum_c w_ic down_e (silu(gate_e x_i) * up_e x_i) looping over experts."""
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 logits (fp64 for fp64 runs)
    probs = torch.softmax(F.linear(x.to(acc), router.to(acc)), dim=-1)  # [t, E]
    weight, expert = probs.topk(k, dim=-1)  # [t, k]
    weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(router.shape[0]):
        rows, slot = torch.nonzero(expert == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        xe = x[rows]  # [n_e, h]
        ye = F.linear(F.silu(F.linear(xe, gate[e])) * F.linear(xe, up[e]), down[e])
        out = out.index_add(0, rows, ye * weight[rows, slot].unsqueeze(1))
    return out


class SwiGLUExpert(torch.nn.Module):
    """One SwiGLU expert for DeepSpeed-MoE (it deep-copies one per local expert)."""

    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(h, f, bias=False)
        self.up = torch.nn.Linear(h, f, bias=False)
        self.down = torch.nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, h] -> [n, h]."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


DEEPSPEED_SETTING = (
    "top-k gating with capacity_factor = E / k, so each expert's fixed capacity is t slots "
    "(ceil(t / E x capacity_factor x k)): nothing is dropped (a token picks an expert at most "
    "once) and every rank's all_to_all has the same size; drop_tokens=False (capacity = the "
    "step's largest expert load) crashed here at ep 2: its per-rank capacities differed and "
    "gloo's all_to_all aborted ('Received data size doesn't match expected size')")
"""How the DeepSpeed peer is configured, and why (recorded in the JSON)."""


def deepspeed_version() -> str:
    """The installed DeepSpeed's version, or why it cannot be imported."""
    try:
        import deepspeed
    except Exception as err:  # recorded, not raised: the peer is optional
        return f"not importable: {type(err).__name__}: {err}"
    return str(deepspeed.__version__)


def deepspeed_capacity_factor(shape: Shape) -> float:
    """E / k: DeepSpeed's top-k capacity ceil(t / E x factor x k) becomes t (dropless)."""
    return shape.experts / shape.top_k


def deepspeed_body(rank: int, world: int, shape: Shape, steps: int, port: int, out: str) -> None:
    """mp.spawn body: DeepSpeed-MoE forward + backward timings (or the error) to ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE

        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(rank)
        factor = deepspeed_capacity_factor(shape)
        layer = MoE(hidden_size=shape.hidden, expert=SwiGLUExpert(shape.hidden, shape.expert_ffn),
                    num_experts=shape.experts, ep_size=world, k=shape.top_k,
                    capacity_factor=factor, eval_capacity_factor=factor, drop_tokens=True)
        x = torch.randn(shape.batch, shape.seq, shape.hidden, requires_grad=True)
        times = []
        for i in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            y, _, _ = layer(x)
            y.sum().backward()
            if i:
                times.append(time.perf_counter() - start)
        result["times"] = times
    except Exception as err:  # the peer's failure is a result, recorded verbatim
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc(limit=4)
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    os._exit(0)  # DeepSpeed's shm comm aborts at interpreter exit; the result is written


def run_deepspeed(world: int, shape: Shape, steps: int) -> list[dict[str, Any]]:
    """DeepSpeed-MoE on ``world`` spawned processes; each rank's result (or error)."""
    import torch.multiprocessing as mp

    out = tempfile.mktemp(prefix="moe_ds_")
    try:
        mp.spawn(deepspeed_body, args=(world, shape, steps, 29600 + os.getpid() % 300, out),
                 nprocs=world, join=True)
    except Exception as err:  # a crashed rank leaves no file: reported below
        print(f"deepspeed ep{world}: {err}", flush=True)
    results = []
    for r in range(world):
        path = Path(f"{out}.{r}")
        results.append(json.loads(path.read_text()) if path.exists()
                       else {"rank": r, "error": "the process died before writing a result"})
        path.unlink(missing_ok=True)
    return results


# ----------------------------------------------------------------------------- colonnade


def _moe_layer(chunk: torch.nn.Module) -> Any:
    """The first MoE layer of a built chunk (the module holding a dispatcher)."""
    return next(m for m in chunk.modules() if hasattr(m, "dispatcher"))


def _instrument(layer: Any, ep_rank: int, kind: str, record: dict[str, Any]) -> None:
    """Wrap the layer's dispatcher: seconds inside dispatch + combine, and per call the
    rows it sent to / computed for other ranks (the exact byte formula's R and R')."""
    disp = layer.dispatcher
    plain_dispatch, plain_combine = disp.dispatch, disp.combine

    def dispatch(x: torch.Tensor, routing: Any, keep: Any) -> Any:
        start = time.perf_counter()
        out = plain_dispatch(x, routing, keep)
        record["dispatch_s"] += time.perf_counter() - start
        handle = out[2]
        if kind == "all_to_all" and handle.send_splits:
            record["rows"].append((sum(handle.send_splits) - handle.send_splits[ep_rank],
                                   sum(handle.recv_splits) - handle.recv_splits[ep_rank]))
        return out

    def combine(y: torch.Tensor, handle: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = plain_combine(y, handle)
        record["dispatch_s"] += time.perf_counter() - start
        return out

    disp.dispatch, disp.combine = dispatch, combine


def run_layer(name: str, shape: Shape, steps: int, check: bool) -> dict[str, Any]:
    """Rank function: forward + backward of one colonnade MoE layer (or, 'plain_loop', the
    plain peer on the same weights), ``steps`` timed after one warm-up."""
    torch.set_num_threads(1)
    ep, kind = COLONNADE.get(name, (1, "all_to_all"))
    w = shape.workload(layers=1)
    cfg = colonnade_config(w, shape.batch, ep, [f"--parallel.dp={ep}",
                                                *moe_overrides(shape, ep, kind)])
    groups = ProcessGroups.build(ParallelDims.from_config(cfg.parallel, ep), experts=True)
    from colonnade.models.build import build_chunks

    (chunk,) = build_chunks(cfg, groups)
    layer = _moe_layer(chunk)
    gen = torch.Generator().manual_seed(groups.rank)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=gen,
                    requires_grad=True)  # [b, s, h]: the batch-first residual stream (no sp)
    e = layer.experts
    weights = (layer.router.weight, e.gate, e.up, e.down)
    if name == "plain_loop":
        def op() -> torch.Tensor:
            return plain_moe(x.view(-1, shape.hidden), *weights, shape.top_k)
    else:
        def op() -> torch.Tensor:
            return layer(x)
    out: dict[str, Any] = {"name": name, "rank": groups.rank}
    if check and name == "colonnade_ep1":
        out["check_max_err"] = plain_check(layer, shape)
    record: dict[str, Any] = {"dispatch_s": 0.0, "rows": []}
    _instrument(layer, groups.ep.rank if ep > 1 else 0, kind, record)
    op().sum().backward()  # warm-up
    times, fwd = [], []
    groups.stats.reset()
    record.update(dispatch_s=0.0, rows=[])
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        y = op()
        mid = time.perf_counter()
        y.sum().backward()
        times.append(time.perf_counter() - start)
        fwd.append(mid - start)
    x_shape = MoEShape.of(cfg.model)
    out |= {"times": times, "forward_s": statistics.median(fwd),
            "dispatch_share": record["dispatch_s"] / max(sum(fwd), 1e-12)}
    if ep > 1:
        sent = groups.stats.total("ep/") / steps
        exact = (sum(all_to_all_bytes(a, shape.hidden, 4, ep, shape.experts // ep, received=b)
                     for a, b in record["rows"]) / steps if kind == "all_to_all"
                 else all_gather_bytes(shape.tokens, shape.top_k, shape.hidden, 4, ep))
        out |= {"wire_bytes": sent, "wire_exact_formula": exact,
                "wire_uniform_formula": dispatch_bytes(x_shape, shape.tokens, 4, ep, kind)}
    return out


def plain_check(layer: Any, shape: Shape) -> float:
    """Max relative error of :func:`plain_moe` against the colonnade layer in float64."""
    layer64 = layer.double()
    x = torch.randn(shape.batch, shape.seq, shape.hidden, dtype=torch.float64)  # [b, s, h]
    e = layer64.experts
    want = layer64(x).reshape(-1, shape.hidden)
    got = plain_moe(x.reshape(-1, shape.hidden), layer64.router.weight, e.gate, e.up, e.down,
                    shape.top_k)
    layer.float()
    return float(((got - want).abs().max() / want.abs().max()).detach())


def run_model(name: str, shape: Shape, warmup: int, steps: int) -> dict[str, Any]:
    """Rank function: ``Trainer.train_step`` of the MoE model (or its dense equivalent) on 2
    ranks (dp 2, ep 2 folded inside); step seconds, ep waits and wire bytes per step."""
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    torch.set_num_threads(1)
    ep, kind = MODEL[name]
    w = shape.workload()
    cfg = colonnade_config(w, shape.batch, 2, moe_overrides(shape, ep, kind,
                                                            dense=name == "dense_equivalent"))
    groups = ProcessGroups.build(ParallelDims.from_config(cfg.parallel, 2),
                                 experts=cfg.model.moe)
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    data = batches(w, warmup + steps, shape.batch, dp=2, rank=groups.dp_rank)
    for b in data[:warmup]:
        trainer.train_step(b)
    groups.stats.reset()
    times = []
    for b in data[warmup:]:
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(b)
        times.append(time.perf_counter() - start)
    snap = {k: v for k, v in groups.stats.snapshot().items() if k.startswith("ep/")}
    model_bytes = step_dispatch_bytes(cfg.model, float(shape.tokens), 1, 1, 4, ep, kind) \
        if cfg.model.moe else 0.0
    return {"name": name, "rank": groups.rank, "times": times,
            "ep_waited_s": sum(v["waited_s"] for v in snap.values()) / steps,
            "wire_bytes": sum(v["wire_bytes"] for v in snap.values()) / steps,
            "wire_formula": model_bytes}


# ----------------------------------------------------------------------------- summary


def round_medians(results: list[dict[str, Any]], world: int) -> list[float]:
    """Per round (``world`` consecutive rank results): the median of its ranks' times."""
    return [statistics.median([t for r in results[i:i + world] for t in r["times"]])
            for i in range(0, len(results), world)]


def summarize(runs: dict[str, list[dict[str, Any]]], worlds: dict[str, int], base: str
              ) -> list[dict[str, Any]]:
    """One row per variant: median seconds over rounds, ratio to ``base`` (per round), and
    the first round's rank-0 extras (bytes, dispatch share, check)."""
    rows = []
    base_rounds = round_medians(runs[base], worlds[base]) if runs.get(base) else None
    for name, results in runs.items():
        if not results or "times" not in results[0]:
            rows.append({"name": name, **(results[0] if results else {})})
            continue
        rounds = round_medians(results, worlds[name])
        row: dict[str, Any] = {"name": name, "ranks": worlds[name],
                               "median_s": statistics.median(rounds)}
        if base_rounds and len(base_rounds) == len(rounds):
            row |= {f"vs_{base}": ratio_stats(rounds, base_rounds)}
        row |= {k: v for k, v in results[0].items()
                if k not in ("times", "name", "rank", "traceback")}
        rows.append(row)
    return rows


def print_rows(title: str, rows: list[dict[str, Any]], base: str) -> None:
    """A plain table of the summary rows."""
    print(f"\n{title}")
    print(f"{'variant':<22}{'ranks':>6}{'median ms':>11}{'vs ' + base:>22}"
          f"{'wire KB':>10}{'formula KB':>12}{'dispatch %':>12}")
    for r in rows:
        if "median_s" not in r:
            print(f"{r['name']:<22}  not run: {r.get('error', '?')}")
            continue
        ratio = r.get(f"vs_{base}", {}).get("ratio")
        formula = r.get("wire_exact_formula", r.get("wire_formula"))
        share = r.get("dispatch_share")
        print(f"{r['name']:<22}{r['ranks']:>6}{r['median_s'] * 1e3:>11.2f}"
              f"{'' if ratio is None else f'{ratio:.3f}':>22}"
              f"{r.get('wire_bytes', 0) / 1e3:>10.1f}"
              f"{'' if formula is None else f'{formula / 1e3:.1f}':>12}"
              f"{'' if share is None else f'{share:.1%}':>12}")


def interleaved(pools: RankPools, names: list[str], worlds: dict[str, int], rounds: int,
                fn: Any, *args: Any) -> dict[str, list[dict[str, Any]]]:
    """Interleaved rounds (order rotated) of ``fn(name, *args)`` on each variant's ranks."""
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rnd in range(rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            runs[name] += pools.run(worlds[name], fn, name, *args)
        print(f"round {rnd + 1}/{rounds} done ({time.strftime('%X')})", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="layer,model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    for field in dataclasses.fields(Shape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 round, 1 step")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else Shape()
    shape = dataclasses.replace(shape, **{f.name: getattr(args, f.name)
                                          for f in dataclasses.fields(Shape)
                                          if getattr(args, f.name) is not None})
    if args.quick:
        args.rounds, args.steps = 1, 1
    if args.json is None:
        args.json = (Path(tempfile.gettempdir()) / "moe_quick.json" if args.quick else RESULTS)
    payload: dict[str, Any] = {"shape": dataclasses.asdict(shape), "rounds": args.rounds,
                               "steps": args.steps, "cores": os.cpu_count(),
                               "torch": torch.__version__,
                               "flops_per_token": dict(zip(("moe", "dense_equivalent"),
                                                           dense_equivalent_flops(shape),
                                                           strict=True))}
    parts = args.parts.split(",")
    pools = RankPools(timeout_s=1800.0)
    try:
        if "layer" in parts:
            worlds = {n: COLONNADE.get(n, (1, ""))[0] for n in LAYER}
            runs = interleaved(pools, list(LAYER), worlds, args.rounds, run_layer, shape,
                               args.steps, True)
            if not args.no_deepspeed:
                for world in (1, 2):
                    name = f"deepspeed_ep{world}"
                    worlds[name] = world
                    runs[name] = []
                    for _ in range(args.rounds):
                        runs[name] += run_deepspeed(world, shape, args.steps)
                payload["deepspeed_setting"] = DEEPSPEED_SETTING
                payload["deepspeed_version"] = deepspeed_version()
            payload["layer"] = summarize(runs, worlds, "colonnade_ep1")
            print_rows("one MoE layer, forward + backward", payload["layer"], "colonnade_ep1")
        if "model" in parts:
            worlds = dict.fromkeys(MODEL, 2)
            runs = interleaved(pools, list(MODEL), worlds, args.rounds, run_model, shape, 1,
                               args.steps)
            payload["model"] = summarize(runs, worlds, "dense_equivalent")
            print_rows("training step (2 ranks)", payload["model"], "dense_equivalent")
    finally:
        pools.close()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
