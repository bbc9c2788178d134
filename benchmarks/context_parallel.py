"""Context parallelism on CPU: attention alone against a peer, then training steps.

    .venv/bin/python benchmarks/context_parallel.py [--seqs 4096,8192,16384] [--cps 2,4]
        [--parts attention,model] [--variants ...] [--rounds 3] [--steps 1] [--warmup 1]
        [--kv-heads 4] [--peer-max-seq 4096] [--quick] [--json PATH]

The defaults take ~6 minutes on a quiet 2-core machine (estimated from a one-round run at
8k on a loaded one: ~75 s attention, ~40 s model; cost grows ~ s^2 for attention).

Shapes: a tiny model, hidden 64, 2 layers, 4 heads (head dim d = 16), 4 kv heads
(``--kv-heads``), vocab 512, batch 1, fp32, at sequence s in 4k-16k; cp ranks are gloo CPU
processes with one compute thread each (cp 1 runs on one process; cp 4 on a 2-core machine
shares cores: its times are then not comparable, the JSON records the core count).

Part 1, attention (forward + backward of causal attention, q/k/v [1, a, s/cp, d] per rank):

  sdpa_cp1                 F.scaled_dot_product_attention on the whole sequence (cp = 1)
  colonnade_ring           context_parallel.ring_attention, zigzag rows, cp_overlap on
  colonnade_ring_no_overlap  the same with overlap=False (every p2p waited before compute)
  colonnade_all_to_all     context_parallel.all_to_all_attention around full-sequence SDPA
  picotron_ring            the peer: picotron's ring attention re-implemented here (below),
                           eager block maths; only up to ``--peer-max-seq`` (4096: it costs
                           ~10 s per pass at 8k, and at 16k its [s/2, s/2] fp32 scores per
                           head take 1 GiB each)
  picotron_ring_fused      the same ring with PyTorch's fused CPU flash kernel for the blocks
                           (colonnade's kernel): isolates the algorithm (split, overlap)

The peer (benchmarks/context_parallel_peer.py, see its doc): torch's experimental
context-parallel API does not run on CPU (probed on every run, the error recorded in the JSON),
so picotron's ring attention is re-implemented: contiguous split, eager blocks, k/v and dK/dV
passed around the ring with batch_isend_irecv.  Every variant's output and gradients are
checked in float64 against full-sequence SDPA (s = 64 cp) before timing.

Part 2, model (``Trainer.train_step``, what ``colonnade train`` runs; llama, 1 micro-batch):
cp1, cp2 ring, cp2 ring without overlap, cp2 all_to_all, cp4 ring, cp4 all_to_all (``--cps``).
Per rank: ``saved_bytes``, the storages autograd saves for backward during one step
(:class:`colonnade.analysis.measure.SavedTensorMeter`, each storage once, weights excluded: the
activation memory, which with one micro-batch is all alive at the end of forward);
``peak_bytes``, the peak of live tensor bytes allocated during one step
(:class:`~colonnade.analysis.measure.PeakTensorBytes`: activations, gradients in flight,
temporaries such as ring buffers); next to the planner's model
(:func:`colonnade.analysis.memory.memory_per_device`: ``activations`` and ``cp_buffers``).
Times: median step over rounds, steps and ranks (``cpu_s``: the rank's process CPU seconds
per pass / step, gloo threads included: less sensitive to a shared machine); exposed cp
communication = the seconds the rank waited on the cp group's p2p / all-to-all per step
(CommStats ``waited_s`` of keys 'cp/...': 'cp/p2p/cp_ring_kv' forward, 'cp/p2p/cp_ring_bwd'
backward, 'cp/all_to_all/...'), wire bytes per step.  First-step losses of every layout must
equal cp1's (1e-5 relative, fp32).

Rounds interleave the variants (order rotated); ratios are medians over rounds of per-round
ratios.  Writes benchmarks/results/context_parallel.json (``--quick``: a temporary file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from context_parallel_peer import (
    PicotronRingAttention,
    RingExchange,
    contiguous_local,
    probe_torch_cp,
)
from ratios import ratio_stats
from workloads import Workload, batches, colonnade_config, first_loss_check

from colonnade.context_parallel.layout import take_local
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPools

RESULTS = Path(__file__).resolve().parent / "results" / "context_parallel.json"
HIDDEN, LAYERS, HEADS, VOCAB = 64, 2, 4, 512
ATTENTION = ("sdpa_cp1", "colonnade_ring", "colonnade_ring_no_overlap", "colonnade_all_to_all",
             "picotron_ring", "picotron_ring_fused")
MODEL = {  # variant -> (cp, cp_attention, cp_overlap)
    "cp1": (1, "ring", True), "cp2_ring": (2, "ring", True),
    "cp2_ring_no_overlap": (2, "ring", False), "cp2_all_to_all": (2, "all_to_all", True),
    "cp4_ring": (4, "ring", True), "cp4_all_to_all": (4, "all_to_all", True)}
LOSS_TOL = 1e-5
"""First-step loss agreement with cp1 (fp32; cp changes the order of the sums)."""


def cp_workload(seq: int, kv_heads: int = HEADS) -> Workload:
    """Issue 16's tiny model at sequence ``seq``: llama, h 64, 2 layers, 4 heads, batch 1."""
    return Workload(name=f"cp-tiny-{seq}", arch="llama", hidden=HIDDEN, layers=LAYERS,
                    heads=HEADS, kv_heads=kv_heads, vocab=VOCAB, seq_len=seq, global_batch=1,
                    lr=1e-3, weight_decay=0.1)


# ----------------------------------------------------------------------------- part 1


def attention_inputs(s: int, kv: int, dtype: torch.dtype, seed: int = 0
                     ) -> tuple[torch.Tensor, ...]:
    """Full-sequence q [1, a, s, d], k/v [1, kv, s, d] and dout [1, a, s, d], same on all
    ranks."""
    gen = torch.Generator().manual_seed(seed)
    d = HIDDEN // HEADS
    q, dout = (torch.randn(1, HEADS, s, d, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, kv, s, d, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v, dout


def attention_op(name: str, cp: int) -> tuple[Callable[..., torch.Tensor],
                                              Callable[[torch.Tensor], torch.Tensor],
                                              Any]:
    """(fn(q, k, v) -> out, local(x) -> this rank's rows of a full tensor [b, a, s, d],
    what holds the exposed-time counters: ProcessGroups or RingExchange or None)."""
    rank = dist.get_rank() if dist.is_initialized() else 0

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])

    if name == "sdpa_cp1":
        return sdpa, lambda x: x, None
    if name.startswith("picotron_ring"):
        ex = RingExchange()
        scale, kernel = (HIDDEN // HEADS) ** -0.5, "fused" if name.endswith("fused") else "eager"

        def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            rep = q.shape[1] // k.shape[1]  # GQA: picotron expands kv heads before the ring
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [b, a, s/cp, d]
            out: torch.Tensor = PicotronRingAttention.apply(q, k, v, scale, ex, kernel)
            return out

        return ring, lambda x: contiguous_local(x, cp, rank, 2), ex
    groups = ProcessGroups.build(ParallelDims(cp=cp))
    if name.startswith("colonnade_ring"):
        from colonnade.context_parallel.ring import ring_attention

        overlap = not name.endswith("no_overlap")
        return (lambda q, k, v: ring_attention(q, k, v, groups.cp, causal=True, overlap=overlap),
                lambda x: take_local(x, cp, rank, 2), groups)
    if name == "colonnade_all_to_all":
        from colonnade.context_parallel.all_to_all_attention import all_to_all_attention

        return (lambda q, k, v: all_to_all_attention(q, k, v, groups.cp, sdpa),
                lambda x: take_local(x, cp, rank, 2), groups)
    raise ValueError(f"unknown attention variant {name!r}")


def attention_errors(name: str, cp: int, kv: int) -> float:
    """Max |difference| of out, dq, dk, dv against full-sequence SDPA (float64, s = 64 cp),
    relative to the largest reference value."""
    fn, local, _ = attention_op(name, cp)
    q, k, v, dout = attention_inputs(64 * cp, kv, torch.float64, seed=1)
    ref_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=kv != HEADS)
    ref.backward(dout)
    mine = [local(x).clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*mine)
    out.backward(local(dout))
    pairs = [(out, local(ref))] + [(m.grad, local(r.grad)) for m, r in zip(mine, ref_in,
                                                                          strict=True)]
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in
               ((x.detach(), y.detach()) for x, y in pairs))


def run_attention(name: str, s: int, cp: int, kv: int, steps: int, check: bool
                  ) -> dict[str, Any]:
    """Rank function: check ``name`` (float64) then time ``steps`` forward + backward passes
    (after one warm-up) at sequence ``s``, fp32."""
    torch.set_num_threads(1)
    gc.collect()
    err = attention_errors(name, cp, kv) if check else None
    fn, local, counters = attention_op(name, cp)
    q, k, v, dout = (local(x).contiguous() for x in attention_inputs(s, kv, torch.float32))
    fwd, bwd, exposed, cpu = [], [], [], []
    for i in range(steps + 1):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        if counters is not None:
            _reset_exposed(counters)
        if dist.is_initialized():
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*leaves)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        if i:  # the first pass warms up
            cpu.append(time.process_time() - c0)
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            exposed.append(_exposed(counters))
    return {"name": name, "seq": s, "cp": cp, "rank": dist.get_rank(), "error": err,
            "fwd_s": fwd, "bwd_s": bwd, "times": [a + b for a, b in zip(fwd, bwd, strict=True)],
            "exposed_s": exposed, "cpu_s": cpu}


def _reset_exposed(counters: Any) -> None:
    if isinstance(counters, RingExchange):
        counters.waited = 0.0
    else:
        counters.stats.reset()


def _exposed(counters: Any) -> float:
    """Seconds this rank waited on cp communication since the last reset."""
    if counters is None:
        return 0.0
    if isinstance(counters, RingExchange):
        return counters.waited
    return counters.stats.total("cp/", "waited_s")


# ----------------------------------------------------------------------------- part 2


def model_overrides(cp: int, attention: str, overlap: bool) -> list[str]:
    """The cp layout's ``--parallel`` overrides."""
    return [f"--parallel.cp={cp}", f"--parallel.cp_attention={attention}",
            f"--parallel.cp_overlap={str(overlap).lower()}"]


def memory_model(cfg: Any, world: int) -> dict[str, float]:
    """The planner's per-rank activation bytes and cp buffers for ``cfg``."""
    from colonnade.analysis.layout import Layout
    from colonnade.analysis.layout import Workload as PlanWorkload
    from colonnade.analysis.memory import memory_per_device

    mem = memory_per_device(PlanWorkload.from_config(cfg), Layout.from_config(cfg, world))
    return {"model_activation_bytes": mem.activations,
            "model_cp_buffer_bytes": mem.cp_buffers}


def run_model(name: str, s: int, kv: int, warmup: int, steps: int, measure: bool
              ) -> dict[str, Any]:
    """Rank function: build the Trainer of variant ``name``, ``warmup`` steps (first loss
    recorded), with ``measure`` one step under each memory meter, then ``steps`` timed."""
    from colonnade.analysis.measure import PeakTensorBytes, SavedTensorMeter
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    torch.set_num_threads(1)
    gc.collect()
    cp, attention, overlap = MODEL[name]
    w = cp_workload(s, kv)
    cfg = colonnade_config(w, 1, cp, model_overrides(cp, attention, overlap))
    groups = ProcessGroups.build(ParallelDims(cp=cp))
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    data = batches(w, warmup + steps + (2 if measure else 0), 1)
    losses = [trainer.train_step(b)["loss"] for b in data[:warmup]]
    out: dict[str, Any] = {"name": name, "seq": s, "cp": cp, "rank": groups.rank,
                           "losses": losses}
    rest = data[warmup:]
    if measure:
        with SavedTensorMeter(trainer.chunks) as meter:
            trainer.train_step(rest[0])
        with PeakTensorBytes() as peak:
            trainer.train_step(rest[1])
        out |= {"saved_bytes": meter.total, "peak_bytes": peak.peak, **memory_model(cfg, cp)}
        rest = rest[2:]
    groups.stats.reset()
    times, cpu = [], []
    for b in rest:
        if dist.is_initialized():
            dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.train_step(b)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    snap = groups.stats.snapshot()
    cp_ops = {k: v for k, v in snap.items() if k.startswith("cp/")}
    out |= {"times": times, "cpu_s": cpu,
            "cp_ops": {k: {"waited_s": v["waited_s"] / steps, "wire_bytes": v["wire_bytes"]
                           / steps, "calls": v["calls"] / steps} for k, v in cp_ops.items()},
            "exposed_s": sum(v["waited_s"] for v in cp_ops.values()) / steps,
            "wire_bytes": sum(v["wire_bytes"] for v in cp_ops.values()) / steps}
    return out


# ----------------------------------------------------------------------------- summary


def round_medians(results: list[dict[str, Any]], world: int, key: str = "times") -> list[float]:
    """Per round (``world`` consecutive rank results): the median of ``key`` over its ranks'
    timed passes (a list) or over its ranks (a number)."""
    out = []
    for i in range(0, len(results), world):
        values: list[float] = []
        for r in results[i:i + world]:
            values += r[key] if isinstance(r[key], list) else [r[key]]
        out.append(statistics.median(values))
    return out


def summarize_attention(runs: dict[tuple[int, str, int], list[dict[str, Any]]]
                        ) -> list[dict[str, Any]]:
    """One row per (seq, variant, cp): medians; time ratios against sdpa_cp1 and, for
    colonnade's variants, picotron_ring(_fused) / colonnade (> 1: colonnade faster)."""
    rows = []
    for (s, name, cp), res in runs.items():
        world = 1 if name == "sdpa_cp1" else cp
        rounds = round_medians(res, world)
        row: dict[str, Any] = {
            "seq": s, "variant": name, "cp": world,
            "step_s": statistics.median(t for r in res for t in r["times"]),
            "fwd_s": statistics.median(t for r in res for t in r["fwd_s"]),
            "bwd_s": statistics.median(t for r in res for t in r["bwd_s"]),
            "cpu_s": statistics.median(t for r in res for t in r["cpu_s"]),
            "exposed_s": statistics.median(t for r in res for t in r["exposed_s"]),
            "max_rel_error": max((r["error"] for r in res if r["error"] is not None),
                                 default=None),
            "round_step_s": rounds}
        base = runs.get((s, "sdpa_cp1", 1))
        if base is not None and name != "sdpa_cp1":
            row["vs_cp1"] = ratio_stats(round_medians(base, 1), rounds)
        for peer_name in ("picotron_ring", "picotron_ring_fused"):
            peer = runs.get((s, peer_name, cp))
            if peer is not None and name.startswith("colonnade"):
                row[f"vs_{peer_name}"] = ratio_stats(round_medians(peer, cp), rounds)
        rows.append(row)
    return rows


def summarize_model(runs: dict[tuple[int, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (seq, variant): median step, exposed cp time, bytes (largest rank), the
    first loss, and ratios against cp1 (time: cp1 / variant, > 1 faster; memory: variant /
    cp1, ~ 1/cp expected)."""
    rows = []
    for (s, name), res in runs.items():
        cp = MODEL[name][0]
        rounds = round_medians(res, cp)
        row: dict[str, Any] = {
            "seq": s, "variant": name, "cp": cp, "cp_attention": MODEL[name][1],
            "cp_overlap": MODEL[name][2], "loss": res[0]["losses"][0],
            "step_s": statistics.median(t for r in res for t in r["times"]),
            "cpu_s": statistics.median(t for r in res for t in r["cpu_s"]),
            "exposed_s": statistics.median(r["exposed_s"] for r in res),
            "wire_bytes": statistics.median(r["wire_bytes"] for r in res),
            "round_step_s": rounds,
            "cp_ops_waited_s": {k: statistics.median(r["cp_ops"][k]["waited_s"] for r in res)
                                for k in res[0]["cp_ops"]}}
        for key in ("saved_bytes", "peak_bytes", "model_activation_bytes",
                    "model_cp_buffer_bytes"):
            values = [r[key] for r in res if key in r]
            if values:
                row[key] = max(values)
        if "saved_bytes" in row and row.get("model_activation_bytes"):
            row["saved_vs_model"] = row["saved_bytes"] / row["model_activation_bytes"]
        base = runs.get((s, "cp1"))
        if base is not None and name != "cp1":
            row["speedup_vs_cp1"] = ratio_stats(round_medians(base, 1), rounds)
            b_saved = max((r["saved_bytes"] for r in base if "saved_bytes" in r), default=0)
            if b_saved and "saved_bytes" in row:
                row["saved_vs_cp1"] = row["saved_bytes"] / b_saved
            b_peak = max((r["peak_bytes"] for r in base if "peak_bytes" in r), default=0)
            if b_peak and "peak_bytes" in row:
                row["peak_vs_cp1"] = row["peak_bytes"] / b_peak
        rows.append(row)
    return rows


def check_model_losses(rows: list[dict[str, Any]]) -> None:
    """Every layout's first loss equals cp1's at the same sequence (:data:`LOSS_TOL`)."""
    ref = {r["seq"]: r["loss"] for r in rows if r["variant"] == "cp1"}
    for r in rows:
        if r["seq"] in ref:
            try:
                first_loss_check(r["loss"], ref[r["seq"]], LOSS_TOL)
            except AssertionError as err:
                raise AssertionError(f"{r['variant']} s={r['seq']}: {err}") from None


def _mib(row: dict[str, Any], key: str) -> str:
    return f"{row[key] / 2**20:9.1f}" if key in row else f"{'-':>9}"


def print_attention(rows: list[dict[str, Any]]) -> None:
    """Part 1's table."""
    head = (f"{'seq':>6} {'variant':<26}{'cp':>3}{'fwd ms':>9}{'bwd ms':>9}{'cpu ms':>9}"
            f"{'exposed':>9}"
            f"{'speedup':>8}{'pico/x':>7}{'picoF/x':>8}{'rel err':>9}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        vs1 = f"{r['vs_cp1']['ratio']:8.2f}" if "vs_cp1" in r else f"{'-':>8}"
        vsp = "".join(f"{r[k]['ratio']:{w}.2f}" if k in r else f"{'-':>{w}}" for k, w in
                      (("vs_picotron_ring", 7), ("vs_picotron_ring_fused", 8)))
        err = f"{r['max_rel_error']:9.1e}" if r["max_rel_error"] is not None else f"{'-':>9}"
        print(f"{r['seq']:>6} {r['variant']:<26}{r['cp']:>3}{1e3 * r['fwd_s']:9.1f}"
              f"{1e3 * r['bwd_s']:9.1f}{1e3 * r['cpu_s']:9.1f}{1e3 * r['exposed_s']:9.1f}"
              f"{vs1}{vsp}{err}")


def print_model(rows: list[dict[str, Any]]) -> None:
    """Part 2's table."""
    head = (f"{'seq':>6} {'variant':<21}{'step ms':>9}{'speedup':>8}{'cpu ms':>8}{'exposed':>9}"
            f"{'saved MiB':>10}{'/cp1':>6}{'model MiB':>10}{'peak MiB':>9}{'/cp1':>6}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        sp = f"{r['speedup_vs_cp1']['ratio']:8.2f}" if "speedup_vs_cp1" in r else f"{'-':>8}"
        sv = f"{r['saved_vs_cp1']:6.2f}" if "saved_vs_cp1" in r else f"{'-':>6}"
        pk = f"{r['peak_vs_cp1']:6.2f}" if "peak_vs_cp1" in r else f"{'-':>6}"
        print(f"{r['seq']:>6} {r['variant']:<21}{1e3 * r['step_s']:9.1f}{sp}"
              f"{1e3 * r['cpu_s']:8.1f}{1e3 * r['exposed_s']:9.1f} {_mib(r, 'saved_bytes')}{sv} "
              f"{_mib(r, 'model_activation_bytes')}{_mib(r, 'peak_bytes')}{pk}")


# ----------------------------------------------------------------------------- driver


def attention_part(pools: RankPools, seqs: list[int], cps: list[int], kv: int, rounds: int,
                   steps: int, peer_max_seq: int, names: list[str]
                   ) -> dict[tuple[int, str, int], list[dict[str, Any]]]:
    """Interleaved rounds of the attention variants ``names`` at every sequence and cp (the
    eager peer up to ``peer_max_seq``)."""
    keys = [(s, "sdpa_cp1", 1) for s in seqs if "sdpa_cp1" in names]
    keys += [(s, n, cp) for s in seqs for cp in cps for n in names if n != "sdpa_cp1"
             and (n != "picotron_ring" or s <= peer_max_seq)]
    runs: dict[tuple[int, str, int], list[dict[str, Any]]] = {k: [] for k in keys}
    for rnd in range(rounds):
        shift = rnd % len(keys)
        for s, name, cp in keys[shift:] + keys[:shift]:
            runs[(s, name, cp)] += pools.run(cp, run_attention, name, s, cp, kv, steps, rnd == 0)
        print(f"attention round {rnd + 1}/{rounds} done ({time.strftime('%X')})", flush=True)
    return runs


def model_part(pools: RankPools, seqs: list[int], cps: list[int], kv: int, rounds: int,
               steps: int, warmup: int, names: list[str]
               ) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """Interleaved rounds of the model variants ``names`` (those with cp 1 or in ``cps``);
    memory measured in the first round."""
    names = [n for n in names if MODEL[n][0] == 1 or MODEL[n][0] in cps]
    keys = [(s, n) for s in seqs for n in names]
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {k: [] for k in keys}
    for rnd in range(rounds):
        shift = rnd % len(keys)
        for s, name in keys[shift:] + keys[:shift]:
            runs[(s, name)] += pools.run(MODEL[name][0], run_model, name, s, kv, warmup, steps,
                                         rnd == 0)
        print(f"model round {rnd + 1}/{rounds} done ({time.strftime('%X')})", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="4096,8192,16384")
    parser.add_argument("--cps", default=None, help="cp degrees besides 1 (default 2,4; "
                        "--quick: 2)")
    parser.add_argument("--kv-heads", type=int, default=HEADS)
    parser.add_argument("--parts", default="attention,model")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated subset of {ATTENTION} and {tuple(MODEL)}")
    parser.add_argument("--peer-max-seq", type=int, default=4096,
                        help="longest sequence for the eager picotron_ring")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1, help="timed passes / steps per run "
                        "(after one warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="model steps before measuring")
    parser.add_argument("--quick", action="store_true",
                        help="s = 256, 1 round, 1 step, cp 2 unless --cps (a smoke run)")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"default {RESULTS} (--quick: context_parallel_quick.json in the "
                             "temporary directory, so a smoke run never replaces results)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.rounds, args.steps = "256", 1, 1
    args.cps = args.cps or ("2" if args.quick else "2,4")
    if args.json is None:
        args.json = (Path(tempfile.gettempdir()) / "context_parallel_quick.json" if args.quick
                     else RESULTS)
    seqs = [int(x) for x in args.seqs.split(",")]
    cps = [int(x) for x in args.cps.split(",")]
    parts = set(args.parts.split(","))
    chosen = args.variants.split(",") if args.variants else [*ATTENTION, *MODEL]
    unknown = set(chosen) - {*ATTENTION, *MODEL}
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}")
    payload: dict[str, Any] = {"config": {
        "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": args.kv_heads,
        "vocab": VOCAB, "batch": 1, "seqs": seqs, "cps": cps, "rounds": args.rounds,
        "steps": args.steps, "warmup": args.warmup, "peer_max_seq": args.peer_max_seq,
        "precision": "fp32",
        "device": "cpu (gloo, 1 thread per rank)", "cpu_cores": os.cpu_count(),
        "torch": torch.__version__}}
    pools = RankPools(timeout_s=1800.0)
    try:
        probe = pools.run(2, probe_torch_cp)[0]
        payload["torch_context_parallel"] = probe or "runs on CPU (not benchmarked: see doc)"
        print(f"torch experimental context_parallel on CPU/gloo: {probe or 'runs'}")
        if "attention" in parts:
            start = time.perf_counter()
            runs = attention_part(pools, seqs, cps, args.kv_heads, args.rounds, args.steps,
                                  args.peer_max_seq, [n for n in chosen if n in ATTENTION])
            payload["config"]["attention_wall_s"] = time.perf_counter() - start
            payload["attention"] = summarize_attention(runs)
            print_attention(payload["attention"])
            payload["attention_runs"] = [r for res in runs.values() for r in res]
        if "model" in parts:
            start = time.perf_counter()
            mruns = model_part(pools, seqs, cps, args.kv_heads, args.rounds, args.steps,
                               args.warmup, [n for n in chosen if n in MODEL])
            payload["config"]["model_wall_s"] = time.perf_counter() - start
            payload["model"] = summarize_model(mruns)
            print_model(payload["model"])
            check_model_losses(payload["model"])
            payload["model_runs"] = [r for res in mruns.values() for r in res]
    finally:
        pools.close()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
