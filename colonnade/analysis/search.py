"""Enumerate every valid layout of a workload on N devices, predict each, rank by step time.

Valid means what colonnade's config rules accept (colonnade.config.validate): tp divides the
query heads, the kv heads and the MLP width; pp * vp divides the layers, or (with
``Constraints.uneven_stages``, a fixed pp, or where no pp searched divides the layers, as
DeepSeek-V3's 61) pp <= the layers split by the balanced uneven splits of
:func:`pipeline_layouts` (parallel.pipeline_layout: lighter embedding and head stages, every
stage timed and sized with its own layers); dp = N / (tp pp)
divides the global batch and the micro-batch divides B / dp; the interleaved schedule needs
vp > 1, pp > 1 and m a multiple of pp; ZB-V runs vp = 2 only (two chunks per stage in a V,
priced by replaying its lists: :mod:`colonnade.analysis.zbv`); sp needs tp > 1 and s
divisible by tp;
ZeRO stages 1-3 need dp > 1 (stage 3 with reshard_after_forward's default: on without pp, off
with pp).
Context parallelism (``Constraints.cp``, default cp = 1 only): cp x tp divides N; s % 2cp == 0
(s % 2cp t under sp); all_to_all needs (a/t) % cp == 0 and (g/t) % cp == 0 or cp % (g/t) == 0;
ring is not searched with attention dropout (the validator rejects it).
Mixture of experts (``Constraints.ep`` and ``expert_tp``, default 1 only): ep x expert_tp divides tp
x cp x dp, ep the experts and expert_tp the expert width; tp > 1 needs sp; ZeRO stages 0 and 1 only
(the team's validator rules); a dense model is searched at ep = 1 only.
Stages trade memory for dp communication (timing._dp_exposed): the ranking by step time
within the memory cap picks the lowest stage that fits unless its communication hides.
tp is kept within one node unless ``max_tp`` says otherwise (a tp group across nodes is never
faster on these clusters).  Layouts that do not fit in memory are counted, not ranked.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

from colonnade.analysis.estimate import Estimate, estimate, on_cluster
from colonnade.analysis.hardware import GIB, Cluster
from colonnade.analysis.layout import ZERO_STAGES, Layout, Workload
from colonnade.analysis.memory import memory_per_device
from colonnade.analysis.moe import moe_param_counts
from colonnade.config.choices import RECOMPUTE_MODES, schedule_placement
from colonnade.config.choices import SCHEDULES as ALL_SCHEDULES
from colonnade.models.stages import locate

RECOMPUTE = RECOMPUTE_MODES
"""Recompute modes searched, least recomputation first."""
SCHEDULES = tuple(s for s in ALL_SCHEDULES if s != "gpipe")
"""Schedules searched: every one but GPipe, whose m in-flight micro-batches 1F1B beats."""


class PlanError(ValueError):
    """No layout can run the workload; the message says why and what to change."""


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """Degrees fixed by the user (None = free) and the options searched."""

    tp: int | None = None
    pp: int | None = None
    vp: int | None = None
    dp: int | None = None
    micro_batch: int | None = None
    recompute: tuple[str, ...] = RECOMPUTE
    sp: tuple[bool, ...] = (False, True)
    zero: tuple[int, ...] = ZERO_STAGES
    """ZeRO stages searched (each needs dp x cp > 1 but 0)."""
    cp: tuple[int, ...] = (1,)
    """Context-parallel degrees searched (``colonnade plan --cp 1,2,4``)."""
    cp_attention: tuple[str, ...] = ("ring",)
    """cp attention kinds searched at cp > 1 ('ring', 'all_to_all')."""
    ep: tuple[int, ...] = (1,)
    """Expert-parallel degrees searched for an MoE model (``colonnade plan --ep 1,2,4``)."""
    expert_tp: tuple[int, ...] = (1,)
    """Expert tensor-parallel degrees searched for an MoE model (``colonnade plan
    --expert-tp 1,2``)."""
    reshard: tuple[bool | None, ...] = (None,)
    """Stage 3's reshard_after_forward values searched (None: the default for the pp)."""
    zero_shard_size: int | None = None
    """Hybrid sharding of stages >= 1 over groups of this many dp ranks (layouts whose dp it
    does not divide get stage 0 only); None = shard over all dp ranks."""
    schedules: tuple[str, ...] = SCHEDULES
    uneven_stages: bool = False
    """Also try uneven splits (lighter embedding and head stages) where pp x vp divides the
    layers; where it does not they are always tried (:func:`pipeline_layouts`)."""
    max_tp: int | None = None
    """Largest tp searched; None = GPUs per node."""


@dataclass
class Plan:
    """Ranked predictions of every fitting layout."""

    workload: Workload
    cluster: Cluster
    gpus: int
    ranked: list[Estimate] = field(default_factory=list)
    candidates: int = 0
    smallest: Estimate | None = None
    """The layout needing the least memory (whether or not it fits)."""

    @property
    def best(self) -> Estimate:
        """The top-ranked layout."""
        return self.ranked[0]


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _tp_options(w: Workload, gpus: int, c: Cluster, cons: Constraints) -> list[int]:
    m = w.shape
    cap = cons.max_tp or c.gpus_per_node
    opts = [cons.tp] if cons.tp else [t for t in divisors(gpus) if t <= cap]
    kv = m.kv_hidden // m.head_dim
    return [t for t in opts if gpus % t == 0 and m.heads % t == 0 and kv % t == 0
            and m.ffn % t == 0]


def _schedules(pp: int, layers_per_stage: int, m: int, cons: Constraints
               ) -> Iterator[tuple[str, int]]:
    """(schedule, vp) pairs searched for pp stages of ``layers_per_stage`` layers (l // pp)
    and m micro-batches (module docstring); a vp that does not divide them gets uneven
    virtual stages (:func:`pipeline_layouts`); at least as many layers as virtual stages
    (only the embedding's or the head's virtual stage may then get none)."""
    if pp == 1:
        if cons.vp in (None, 1):
            yield "1f1b", 1
        return
    for sched in cons.schedules:
        if sched == "interleaved_1f1b":
            if m % pp:
                continue
            for v in divisors(layers_per_stage):
                if v > 1 and cons.vp in (None, v):
                    yield sched, v
        elif sched == "zbv":  # two chunks per stage, l/(2 pp) layers or uneven
            if layers_per_stage >= 2 and cons.vp in (None, 2):
                yield sched, 2
        elif cons.vp in (None, 1):
            yield sched, 1


END_LOADS = ((0, 0), (0, 1), (1, 1))
"""Extra load, in layers, credited to the virtual stage holding the embedding and to the one
holding the head when the search splits layers unevenly (:func:`pipeline_layouts`)."""


@functools.lru_cache(maxsize=1024)
def balanced_layout(num_layers: int, pp: int, vp: int, placement: str, first: int,
                    last: int) -> tuple[int, ...]:
    """Layers per virtual stage (virtual-stage order) minimising the fullest pipeline stage's
    load when virtual stage 0 already carries ``first`` layers' worth (the embedding) and the
    last one ``last`` (the head): each layer goes to a virtual stage of the least loaded
    stage (``placement`` puts virtual stages on stages), the least loaded of its chunks, a
    chunk without the embedding or the head on ties (the ends are never the heavier side)."""
    chunks = pp * vp
    counts, loads = [0] * chunks, [0] * chunks
    loads[0] += first
    loads[-1] += last
    stage = [locate(v, pp, placement)[0] for v in range(chunks)]
    held = [0] * pp
    held[stage[0]] += first
    held[stage[-1]] += last
    ends = {0, chunks - 1}
    for _ in range(num_layers):
        v = min(range(chunks), key=lambda k: (held[stage[k]], loads[k], k in ends, k))
        counts[v] += 1
        loads[v] += 1
        held[stage[v]] += 1
    return tuple(counts)


def pipeline_layouts(num_layers: int, pp: int, vp: int, placement: str = "loop",
                     uneven: bool = False) -> list[tuple[int, ...] | None]:
    """Splits of the layers over pp x vp virtual stages the search tries: None (the even
    split) when pp x vp divides them (and nothing else unless ``uneven``), else the balanced
    uneven splits whose ends carry :data:`END_LOADS` (fewer layers on the embedding's and the
    head's stages, as Megatron's --decoder-first/last-pipeline-num-layers;
    :func:`balanced_layout`)."""
    if pp * vp == 1 or (num_layers % (pp * vp) == 0 and not uneven):
        return [None]
    out: list[tuple[int, ...] | None] = []
    for first, last in END_LOADS:
        lay = balanced_layout(num_layers, pp, vp, placement, first, last)
        key = None if len(set(lay)) == 1 else lay
        if key not in out:
            out.append(key)
    return out


def cp_shape_ok(w: Workload, tp: int, cp: int, kind: str, sp: bool = False,
                a2a: int | None = None) -> bool:
    """Whether the validator accepts context parallelism ``cp`` with ``kind`` attention for
    this shape: s % 2cp == 0 (s % 2cp t with sp); all_to_all (a/t) % cp == 0 and
    (g/t) % cp == 0 or cp % (g/t) == 0; hierarchical the same with cp replaced by its
    all-to-all size ``a2a`` (a divisor of cp); ring: any head count."""
    if cp == 1:
        return not (sp and w.seq_len % tp)
    m = w.shape
    if w.seq_len % (2 * cp * (tp if sp else 1)):
        return False
    heads, kv = m.heads // tp, m.kv_hidden // m.head_dim // tp
    if kind == "hierarchical":
        if a2a is None or cp % a2a:
            return False
        cp = a2a
    if kind in ("all_to_all", "hierarchical"):
        return heads % cp == 0 and (kv % cp == 0 or cp % kv == 0)
    return True


def _cp_options(w: Workload, gpus: int, tp: int, cons: Constraints
                ) -> Iterator[tuple[int, str, int | None]]:
    """(cp, cp_attention, cp_a2a_size) valid with ``tp`` on ``gpus`` devices
    (:func:`cp_shape_ok` without sp; the sp condition is checked with sp). Hierarchical is
    searched at its proper splits 1 < a < cp (a = 1 is the ring, a = cp all_to_all)."""
    for cp in cons.cp:
        if cp < 1 or gpus % (tp * cp):
            continue
        for kind in ("ring",) if cp == 1 else cons.cp_attention:
            sizes = [a for a in range(2, cp) if cp % a == 0] if kind == "hierarchical" else [
                None]
            for a2a in sizes:
                if cp_shape_ok(w, tp, cp, kind, a2a=a2a):
                    yield cp, kind, a2a


def _zero_options(dp: int, cons: Constraints) -> Iterator[tuple[int, bool | None]]:
    """(stage, reshard_after_forward) pairs searched at this dp x cp (stages >= 1 need
    dp x cp > 1 and, with hybrid sharding, a dp x cp the shard size divides)."""
    size = cons.zero_shard_size
    for z in cons.zero:
        if z and (dp == 1 or (size is not None and dp % size)):
            continue
        for rs in (cons.reshard if z == 3 else (None,)):
            yield z, rs


def layouts(w: Workload, gpus: int, c: Cluster, cons: Constraints) -> Iterator[Layout]:
    """Every valid layout of ``w`` on ``gpus`` devices within ``cons``."""
    for tp in _tp_options(w, gpus, c, cons):
        for cp, kind, a2a in _cp_options(w, gpus, tp, cons):
            yield from _layouts_at(w, gpus, tp, cp, kind, cons, a2a)


def _layouts_at(w: Workload, gpus: int, tp: int, cp: int, kind: str, cons: Constraints,
                a2a: int | None = None) -> Iterator[Layout]:
    """The valid layouts with this tp and cp (pp, dp, micro-batch, schedule, recompute, sp,
    ZeRO searched)."""
    m, rest = w.shape, gpus // (tp * cp)
    pps = [cons.pp] if cons.pp else divisors(rest)
    uneven = _search_uneven(m.layers, pps, cons)
    for pp in pps:
        if rest % pp or m.layers < pp or (m.layers % pp and not uneven):
            continue
        dp = rest // pp
        if (cons.dp and dp != cons.dp) or w.global_batch % dp:
            continue
        per = w.global_batch // dp
        mbs = [cons.micro_batch] if cons.micro_batch else divisors(per)
        for mb in mbs:
            if per % mb:
                continue
            for sched, vp, lay in _pipelines(pp, m.layers, per // mb, cons, uneven):
                for rc in cons.recompute:
                    for sp in cons.sp:
                        if sp and (tp == 1 or not cp_shape_ok(w, tp, cp, kind, True, a2a)):
                            continue
                        if w.model.moe and tp > 1 and not sp:
                            continue  # MoE under tp needs sp (distinct tokens per tp rank)
                        for z, rs in _zero_options(dp * cp, cons):
                            for ep, etp in _ep_options(w, tp * cp * dp, cons, z):
                                yield Layout(tp=tp, cp=cp, cp_attention=kind,
                                             cp_a2a_size=a2a, pp=pp, vp=vp,
                                             dp=dp, ep=ep, expert_tp=etp, micro_batch=mb,
                                             zero=z,
                                             recompute=rc, sp=sp, schedule=sched,
                                             reshard_after_forward=rs,
                                             zero_shard_size=cons.zero_shard_size if z
                                             else None, pipeline_layout=lay)


def _search_uneven(layers: int, pps: list[int], cons: Constraints) -> bool:
    """Whether pp x vp splits that do not divide the layers are searched: with
    ``uneven_stages``, with pp fixed by the user, or when no pp > 1 searched divides the layers
    (DeepSeek-V3's 61 on any power-of-two count). Otherwise the even splits alone keep the
    search as fast as before (uneven ones multiply the zero-bubble replays)."""
    return (cons.uneven_stages or cons.pp is not None
            or not any(p > 1 and layers % p == 0 for p in pps))


def _pipelines(pp: int, layers: int, m: int, cons: Constraints, uneven: bool
               ) -> Iterator[tuple[str, int, tuple[int, ...] | None]]:
    """(schedule, vp, pipeline_layout) triples searched: every :func:`_schedules` pair with
    each of its :func:`pipeline_layouts` (only even splits unless ``uneven``)."""
    for sched, vp in _schedules(pp, layers // pp, m, cons):
        if layers % (pp * vp) and not uneven:
            continue
        for lay in pipeline_layouts(layers, pp, vp, schedule_placement(sched),
                                    cons.uneven_stages):
            yield sched, vp, lay


def _ep_options(w: Workload, inner: int, cons: Constraints, zero: int
                ) -> list[tuple[int, int]]:
    """(ep, expert tp) pairs valid for ``inner`` = tp x cp x dp ranks of a stage: ep of
    ``cons.ep`` dividing the experts, expert tp of ``cons.expert_tp`` dividing the expert
    width, their product dividing ``inner``, and with hybrid sharding (at ZeRO ``zero`` >= 1)
    leaving an expert dp that min(zero_shard_size, edp) divides (only (1, 1) for a dense
    model)."""
    if not w.model.moe:
        return [(1, 1)]
    m, size = w.model, cons.zero_shard_size if zero else None
    out = []
    for ep in cons.ep:
        for etp in cons.expert_tp:
            if inner % (ep * etp) or m.num_experts % ep or m.expert_ffn_size % etp:
                continue
            edp = inner // (ep * etp)
            if size is None or edp % min(size, edp) == 0:
                out.append((ep, etp))
    return out


def check_workload(w: Workload) -> None:
    """Reject a workload no layout could run (shape errors), naming the fields."""
    m = w.model
    if w.seq_len > m.max_seq_len:
        raise PlanError(f"seq_len={w.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise "
                        "max_seq_len or shorten --seq-len.")
    if m.hidden_size % m.num_heads or m.num_heads % m.kv_heads:
        raise PlanError(f"model.hidden_size={m.hidden_size}, num_heads={m.num_heads}, "
                        f"num_kv_heads={m.kv_heads}: heads must divide the width and kv heads "
                        "must divide the heads.")


def _factor_error(w: Workload, gpus: int, c: Cluster, cons: Constraints) -> PlanError:
    m = w.shape
    tps = _tp_options(w, gpus, c, cons)
    reach = max(16, gpus // 4)
    near = _working_counts(w, gpus, c, cons, reach)
    hint = ", ".join(str(n) for n in sorted(near)) or f"none within +-{reach}"
    return PlanError(
        f"{gpus} GPUs cannot be factored as tp x pp x dp for this workload: tp must divide "
        f"heads={m.heads}, kv heads and ffn={m.ffn} and be <= {cons.max_tp or c.gpus_per_node} "
        f"(options {tps or 'none'}); pp must divide layers={m.layers} (or be <= them with "
        "uneven stages: --uneven-stages, a fixed --pp, or where no pp divides them); "
        f"dp = GPUs/(tp pp) must divide the global batch {w.global_batch}"
        + (f"; fixed {_fixed(cons)}" if _fixed(cons) else "")
        + f". GPU counts near {gpus} that work: {hint}.")


def _working_counts(w: Workload, gpus: int, c: Cluster, cons: Constraints, reach: int,
                    want: int = 4) -> list[int]:
    """Up to ``want`` device counts closest to ``gpus`` (at most ``reach`` away) with a valid
    layout: a count that does not factor fails in its first divisor loops, so even a search
    of +-256 around 1,000 GPUs takes milliseconds."""
    found: list[int] = []
    for d in range(1, reach + 1):
        for n in (gpus - d, gpus + d):
            if n >= 1 and len(found) < want and _first(layouts(w, n, c, cons)):
                found.append(n)
        if len(found) >= want:
            break
    return found


def _fixed(cons: Constraints) -> str:
    names = ("tp", "pp", "vp", "dp", "micro_batch")
    return ", ".join(f"{n}={getattr(cons, n)}" for n in names if getattr(cons, n))


def _first(it: Iterator[Layout]) -> list[Layout]:
    for item in it:
        return [item]
    return []


def _fit_error(w: Workload, gpus: int, c: Cluster, cons: Constraints,
               smallest: Estimate) -> PlanError:
    need = None
    n = gpus
    for _ in range(16):
        n *= 2
        if any(memory_per_device(w, lay).total <= c.memory_bytes
               for lay in layouts(w, n, c, cons)):
            need = n
            break
    mem = smallest.memory.gib()
    hint = (f"at least {need} GPUs (the first power-of-two multiple of {gpus} that fits)"
            if need else "a device with more memory")
    return PlanError(
        f"the model ({moe_param_counts(w.model)['total'] / 1e9:.2f}B parameters, "
        f"seq_len={w.seq_len}, "
        f"global batch {w.global_batch}) fits on no layout of {gpus} x {c.name}: the smallest "
        f"memory per device is {mem['total']:.1f} GiB ({smallest.layout.short()}: params "
        f"{mem['params']:.1f}, grads {mem['grads']:.1f}, optimizer {mem['optimizer']:.1f}, "
        + (f"ZeRO buffers {mem['grad_buckets'] + mem['gathered']:.1f}, "
           if smallest.layout.zero >= 2 else "")
        + f"activations {mem['activations']:.1f} GiB) > {c.memory_bytes / GIB:.1f} GiB usable. "
        f"Use {hint}, or relax the fixed degrees"
        + (" or search context parallelism (--cp 1,2,4,8: activations per rank / cp)"
           if max(cons.cp) == 1 and mem["activations"] > 0.5 * mem["total"] else "") + ".")


def plan(w: Workload, cluster: Cluster, gpus: int, cons: Constraints | None = None) -> Plan:
    """Predict every valid layout and rank the fitting ones by step time (fastest first).

    Raises PlanError when no layout exists (GPU count not factorable) or none fits.
    """
    cons = cons or Constraints()
    if gpus < 1:
        raise PlanError(f"--gpus={gpus} must be >= 1.")
    check_workload(w)
    w = on_cluster(w, cluster)
    result = Plan(workload=w, cluster=cluster, gpus=gpus)
    smallest_mem, smallest = float("inf"), None
    for lay in layouts(w, gpus, cluster, cons):
        result.candidates += 1
        mem = memory_per_device(w, lay)
        if mem.total < smallest_mem:
            smallest_mem, smallest = mem.total, lay
        if mem.total <= cluster.memory_bytes:
            result.ranked.append(estimate(w, lay, cluster))
    if result.candidates == 0:
        raise _factor_error(w, gpus, cluster, cons)
    assert smallest is not None
    result.smallest = estimate(w, smallest, cluster)
    if not result.ranked:
        raise _fit_error(w, gpus, cluster, cons, result.smallest)
    result.ranked.sort(key=lambda e: (e.step_s, e.memory.total))
    return result


def explain(best: Estimate, ref: Estimate) -> str:
    """Why ``best`` is faster than ``ref``: the layout fields that differ and the time
    components that changed most (seconds per step)."""
    keys = ("tp", "cp", "cp_attention", "cp_a2a_size", "pp", "vp", "dp", "micro_batch", "zero",
            "recompute", "sp", "schedule", "reshard_after_forward")
    diffs = [f"{k}: {getattr(ref.layout, k)} -> {getattr(best.layout, k)}"
             for k in keys if getattr(ref.layout, k) != getattr(best.layout, k)]
    a, b = ref.timing.as_dict(), best.timing.as_dict()
    deltas = sorted(((b[k] - a[k], k) for k in a if k != "total"), key=lambda x: x[0])
    parts = [f"{k} {a[k]:.3g}s -> {b[k]:.3g}s" for d, k in deltas if abs(d) > 0.005 * a["total"]]
    gain = ref.step_s / best.step_s - 1
    return (f"{gain:+.1%} throughput; changed {'; '.join(diffs) or 'nothing'}; "
            f"time: {'; '.join(parts) or 'no component moved > 0.5%'}")
