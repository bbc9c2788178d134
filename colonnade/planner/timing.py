"""Time of one optimizer step of a layout on a cluster.

Per micro-batch, per layer, on one device (tokens T = b s, element bytes E, tp degree t):
  compute  = FLOPs / (eff * peak) + elementwise bytes / (eff * HBM bandwidth)
             forward FLOPs T (2 * matrix params + 4 s h) / t (Narayanan et al.), backward 2x,
             full recompute +1 forward, selective +the core attention (4 s h T / t).
             Elementwise bytes per token (norms 4E h, residual add (+dropout) 2 (3E + 1) h,
             GeLU 2E f or SwiGLU 3E f, RoPE 2E (h + h_kv), eager softmax 2E a s (+ dropout
             (2E + 1) a s)); backward 2x.  Norms and residual adds run on every tp rank
             unless sp; the rest is split by t.  This memory-bound part is what makes small
             models reach a lower fraction of peak than large ones.
  tp comm  = per layer 2 all-reduces (or all-gather + reduce-scatter pairs with sp) of T h E
             bytes forward, 2 backward, +2 with full recompute: 8 T h E (t-1)/t bytes per
             device without recompute (the issue's term), exposed (not overlapped).
Pipeline (p stages, v chunks, m micro-batches; t_f, t_b a stage's per-micro-batch times):
  step = m * max_stage(t_f + t_b) + bubble, with bubble (p-1) mean(t_f + t_b) for 1F1B/GPipe,
  (p-1)/v mean(t_f + t_b) interleaved and (p-1) mean(t_f + t_b - 2 t_w) for ZB-H1 (t_w the
  weight-gradient GEMMs).  p2p sends T h E / t bytes (scatter/gather, Narayanan et al.) and an
  intra-node all-gather when tp > 1 without sp; 2 (p-1) transfers are exposed when p2p is
  overlapped, 2 (m v + p - 1) when it is not.
Data parallel: all-reduce of the gradient buffer (ZeRO-1: reduce-scatter of it + all-gather of
  the 16-bit weights).  With overlap, the reduction hides behind the last micro-batch's backward
  (the first micro-batch's forward for the weight all-gather), except the last bucket.
Optimizer: Adam reads/writes ~30 bytes per owned parameter (mixed precision) from HBM.
CPU: with more ranks than cores, the step is at least the ranks' summed busy time / cores,
busy time counting communication (gloo polls while waiting); ``compute_units`` may be the
fractional number of cores free on a shared machine (calibrate.measure_cores).
Per step, the small blocking collectives (grad-norm over tp, pp (and dp with ZeRO-1), the
logged loss over the world, sp-partial and tied gradients) each pay their latency
(:func:`step_collectives_s`); per micro-batch, vocab-parallel cross entropy adds 2
all-reduces under tp.  Ranks wait for the slowest at each blocking collective: the step's
compute grows by ``Cluster.skew_fraction(world)``, measured in calibration (0 on GPUs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from colonnade.planner.hardware import Cluster
from colonnade.planner.layout import Layout, Workload
from colonnade.planner.memory import stage_params, state_bytes_per_param
from colonnade.planner.model_math import (
    LayerShape,
    attention_core_flops_per_token,
    layer_forward_flops_per_token,
    layer_matrix_params,
    logits_forward_flops_per_token,
)

OPS_PER_LAYER = 24
"""Tensor operations in one layer's forward (2 norms, 4 attention and 2-3 MLP matmuls,
reshapes/transposes, RoPE, attention kernel, activation, dropouts, adds); the host pays
``op_overhead_us`` for each (backward counted as 2x)."""


@dataclass(frozen=True)
class Timing:
    """Seconds per optimizer step, by cause; ``total`` is the predicted step time."""

    compute: float
    tp_comm: float
    bubble: float
    p2p: float
    dp_comm: float
    optimizer: float
    overhead: float
    total: float

    def as_dict(self) -> dict[str, float]:
        """Plain dict for JSON."""
        return asdict(self)


@dataclass(frozen=True)
class _Stage:
    """Per-micro-batch costs of one pipeline stage (all its chunks) on one device."""

    fwd: float
    bwd: float
    wgrad: float
    comm: float  # tp communication inside fwd + bwd


def _elementwise_bytes_per_token(m: LayerShape, w: Workload, layout: Layout) -> tuple[float,
                                                                                     float]:
    """(forward bytes per token of one layer on one device, of which core attention)."""
    e, h, t = w.elem, m.hidden, layout.tp
    rep = 4 * e * h + 2 * (3 * e + (1 if m.hidden_dropout else 0)) * h
    shard = (3 if m.swiglu else 2) * e * m.ffn
    if m.arch == "llama":
        shard += 2 * e * (h + m.kv_hidden)
    core = 0.0
    if w.attention == "eager":
        core = 2 * e * m.heads * w.seq_len
        if m.attention_dropout:
            core += (2 * e + 1) * m.heads * w.seq_len
    return rep / (t if layout.sp else 1) + (shard + core) / t, core / t


def layer_forward_s(w: Workload, layout: Layout, c: Cluster) -> tuple[float, float]:
    """(roofline seconds, host seconds) of one layer's forward of one micro-batch on a device.

    Roofline = FLOPs / (eff * peak) + elementwise bytes / (eff * bandwidth); host =
    ``OPS_PER_LAYER * op_overhead_us``.  Backward without recompute costs 2x both.
    """
    m, t = w.shape, layout.tp
    tokens = float(layout.micro_batch) * w.seq_len
    f_fwd = tokens * layer_forward_flops_per_token(m, w.seq_len) / t
    b_fwd = tokens * _elementwise_bytes_per_token(m, w, layout)[0]
    roof = f_fwd / c.flops_per_s(w.precision) + b_fwd / c.bytes_per_s()
    return roof, OPS_PER_LAYER * c.op_overhead_us * 1e-6


def _stage_costs(w: Workload, layout: Layout, c: Cluster, stage: str) -> _Stage:
    m, t = w.shape, layout.tp
    tokens = float(layout.micro_batch) * w.seq_len
    flops, bw = c.flops_per_s(w.precision), c.bytes_per_s()
    layers = m.layers // layout.pp
    f_fwd = tokens * layer_forward_flops_per_token(m, w.seq_len) / t
    f_w = tokens * 2 * layer_matrix_params(m) / t
    b_fwd, b_core = (tokens * x for x in _elementwise_bytes_per_token(m, w, layout))
    fwd = f_fwd / flops + b_fwd / bw + OPS_PER_LAYER * c.op_overhead_us * 1e-6
    bwd = 2 * fwd
    if layout.recompute == "full":
        bwd += fwd
    elif layout.recompute == "selective":
        bwd += tokens * attention_core_flops_per_token(m, w.seq_len) / t / flops + b_core / bw
    per_node = min(t, c.gpus_per_node)
    ar = c.all_reduce_s(tokens * m.hidden * w.elem, t, per_node)
    if layout.sp:  # each all-reduce becomes an all-gather + a reduce-scatter pair
        ar = (c.gather_s(tokens * m.hidden * w.elem, t, per_node, "all_gather")
              + c.gather_s(tokens * m.hidden * w.elem, t, per_node, "reduce_scatter"))
    comm_f, comm_b = 2 * ar, (4 if layout.recompute == "full" else 2) * ar
    fwd_s = layers * (fwd + comm_f)
    bwd_s = layers * (bwd + comm_b)
    wgrad = layers * f_w / flops
    comm = layers * (comm_f + comm_b)
    if stage in ("first", "only"):
        emb = c.all_reduce_s(tokens * m.hidden * w.elem, t, per_node)
        fwd_s, comm = fwd_s + emb, comm + emb
    if stage in ("last", "only"):
        lf = tokens * logits_forward_flops_per_token(m) / t
        lb = tokens * m.vocab / t * (w.elem + 8)  # logits, fp32 softmax, its gradient
        head_comm = c.all_reduce_s(tokens * m.hidden * w.elem, t, per_node)
        # vocab-parallel cross entropy: all-reduce of the max [tokens] and of the packed
        # (sum exp, target logit) [2, tokens], fp32, in the forward
        ce = c.all_reduce_s(tokens * 4, t, per_node) + c.all_reduce_s(tokens * 8, t, per_node)
        fwd_s += ce
        comm += ce
        fwd_s += lf / flops + lb / bw
        bwd_s += 2 * lf / flops + lb / bw + head_comm
        wgrad += lf / flops
        comm += head_comm
    return _Stage(fwd=fwd_s, bwd=bwd_s, wgrad=wgrad, comm=comm)


def _pipeline(layout: Layout, m: int, stages: list[_Stage]) -> tuple[float, float, float]:
    """(steady time, bubble time, of which tp comm in the steady part)."""
    p, v = layout.pp, layout.vp
    worst = max(stages, key=lambda st: st.fwd + st.bwd)
    steady = m * (worst.fwd + worst.bwd)
    steady_comm = m * worst.comm
    if p == 1:
        return steady, 0.0, steady_comm
    first, last = stages
    mean = ((first.fwd + first.bwd) + (last.fwd + last.bwd)) / 2
    if layout.schedule == "interleaved_1f1b":
        bubble = (p - 1) / v * mean
    elif layout.schedule == "zb_h1":
        mean_w = (first.wgrad + last.wgrad) / 2
        bubble = (p - 1) * max(mean - 2 * mean_w, 0.0)
    else:
        bubble = (p - 1) * mean
    return steady, bubble, steady_comm


def _dp_exposed(w: Workload, layout: Layout, c: Cluster, params: float, window_b: float,
                window_f: float) -> tuple[float, float]:
    """(exposed dp communication, full dp communication) seconds per step."""
    if layout.dp == 1:
        return 0.0, 0.0
    t, g = layout.tp, c.gpus_per_node
    per_node = layout.dp if layout.world <= g else max(1, min(layout.dp, g // t))
    wb, gb, _ = state_bytes_per_param(w, layout)
    last_bucket = min(1.0, w.bucket_size / max(params, 1.0))
    if layout.zero1:
        red = c.gather_s(params * gb, layout.dp, per_node, "reduce_scatter")
        gather = c.gather_s(params * wb, layout.dp, per_node, "all_gather")
    else:
        red, gather = c.all_reduce_s(params * gb, layout.dp, per_node), 0.0
    exposed_red = max(red - window_b, red * last_bucket) if w.overlap_grad_reduce else red
    exposed_gather = gather
    if w.overlap_param_gather and gather:
        exposed_gather = max(gather - window_f, gather * last_bucket)
    return exposed_red + exposed_gather, red + gather


def _optimizer_s(w: Workload, layout: Layout, c: Cluster, params: float) -> float:
    shard = layout.dp if layout.zero1 else 1
    per_param = 8 + 30 / shard if w.mixed else 2 * w.elem + 7 * w.elem / shard
    return params * per_param / c.bytes_per_s()


def step_collectives_s(w: Workload, layout: Layout, c: Cluster) -> float:
    """Seconds of the small blocking collectives issued once per step (latency-bound).

    grad-norm all-reduce (one float64) over tp, over pp, and over dp with ZeRO-1; the logged
    loss all-reduce ([2] float64) over the world; the fused sp-partial gradient all-reduce
    over tp (norm weights: (2 l/p + 1) h) with sp; the tied embedding/head gradient
    all-reduce (V h / t) over the pp ends with tied embeddings."""
    t, p, g = layout.tp, layout.pp, c.gpus_per_node
    m = w.shape

    def ar(nbytes: float, n: int) -> float:
        return c.all_reduce_s(nbytes, n, min(n, g))

    total = ar(8, t) + ar(8, p) + (ar(8, layout.dp) if layout.zero1 else 0.0)
    total += ar(16, layout.world)
    if layout.sp and t > 1:
        total += ar((2 * m.layers / p + 1) * m.hidden * w.elem, t)
    if m.tied and p > 1:
        total += ar(m.vocab * m.hidden / t * w.elem, 2)
    return total


def step_time(w: Workload, layout: Layout, c: Cluster) -> Timing:
    """Predicted seconds per optimizer step of ``layout`` (see the module docstring)."""
    m = layout.microbatches(w.global_batch)
    names = ["only"] if layout.pp == 1 else ["first", "last"]
    stages = [_stage_costs(w, layout, c, n) for n in names]
    steady, bubble, tp_comm = _pipeline(layout, m, stages)
    p2p = p2p_full = 0.0
    if layout.pp > 1:
        tokens = float(layout.micro_batch) * w.seq_len
        full = tokens * w.shape.hidden * w.elem
        one = c.p2p_s(full / layout.tp, layout.world > c.gpus_per_node)
        if layout.tp > 1 and not layout.sp:
            one += c.gather_s(full, layout.tp, min(layout.tp, c.gpus_per_node), "all_gather")
        hops = 2 * (layout.pp - 1)
        p2p_full = 2 * (m * layout.vp + layout.pp - 1) * one
        p2p = hops * one if w.overlap_p2p else p2p_full
    params = max(stage_params(w.shape, layout, n) for n in names)
    dp, dp_full = _dp_exposed(w, layout, c, params, stages[0].bwd / layout.vp,
                              stages[0].fwd / layout.vp)
    opt = _optimizer_s(w, layout, c, params)
    extra = step_collectives_s(w, layout, c)
    skew = c.skew_fraction(layout.world)
    # ranks wait for the slowest at every blocking collective: a measured fraction of the
    # compute between them (the whole step's compute is cut into such segments)
    total = (steady + bubble + p2p + dp + opt + extra + c.step_overhead_s
             + skew * (steady - tp_comm))
    if c.compute_units and layout.world > c.compute_units:
        # Compute (and the optimizer) time-shares the cores; the communication waits then
        # follow on top (a rank blocked in a collective gives its core to the others, but
        # its partner only answers once it has had its own share).
        busy = (steady - tp_comm + opt) * layout.world / c.compute_units
        waits = tp_comm + p2p_full + dp_full + extra
        total = max(total, busy * (1 + skew) + waits + c.step_overhead_s)
    return Timing(compute=steady - tp_comm, tp_comm=tp_comm, bubble=bubble, p2p=p2p,
                  dp_comm=dp, optimizer=opt, overhead=total - (steady + bubble + p2p + dp + opt),
                  total=total)
