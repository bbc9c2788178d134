"""Time of one optimizer step of a layout on a cluster.

Per micro-batch, per layer, on one device (tokens T = b s, element bytes E, tp degree t):
  compute  = sum over GEMMs FLOPs / (eff(I) * peak) + elementwise bytes / (eff * HBM bandwidth)
             eff(I) the GEMM's achieved fraction at its arithmetic intensity I
             (:mod:`colonnade.analysis.efficiency`; = eff for every GEMM without a knee),
             forward FLOPs T (2 * matrix params + 4 s h) / t (Narayanan et al.), backward
             ``backward_ratio`` x (2 by FLOPs; measured on CPUs), on the CUDA path a fused
             attention's backward + 0.5 x its forward (:data:`FLASH_BACKWARD_EXTRA`),
             full recompute +1 forward, selective +the core attention (4 s h T / t).
             Elementwise bytes per token (norms 4E h, residual add (+dropout) 2 (3E + 1) h,
             GeLU 2E f or SwiGLU 3E f, RoPE 2E (h + h_kv), eager or blockwise softmax
             2E a s (+ dropout (2E + 1) a s)); backward 2x.  Norms and residual adds run on
             every tp rank unless sp; the rest is split by t.  This memory-bound part is what
             makes small models reach a lower fraction of peak than large ones.
  cp       = context parallelism: T = b s / cp tokens per rank in every term above and below
             (attention FLOPs per rank 4 s h T / t: the full s of keys, 1/cp of the queries;
             the zigzag split balances the causal work); plus the cp attention's exposed
             communication per layer (:mod:`colonnade.analysis.cp_comm`: ring p2p beyond its
             overlap with each ring step's block attention, or all_to_all's 8 all-to-alls),
             reported as ``Timing.cp_comm``; gradients are reduced over dp x cp.
  moe      = each MoE layer of the stage (:mod:`colonnade.analysis.moe`): its MLP's forward
             FLOPs replace the dense MLP's (T/t tokens routed per rank, tp requires sp),
             backward ``backward_ratio`` x; plus the dispatch's bytes (all_to_all or
             all_gather, forward + backward) at the ep group's link, 4 (all_to_all) or 6
             (all_gather) collectives' latency, exposed (not overlapped), reported as
             ``Timing.ep_comm``; with expert tp n > 1 also its exchange
             (:func:`~colonnade.analysis.moe.expert_tp_bytes`) at the expert tp group's link,
             5 collectives' latency.  The routed experts' gradients are reduced over
             expert_dp (edp = t cp dp / (ep n) ranks) and their ZeRO-1 states sharded over it
             (:func:`_expert_dp_s`: dp communication and optimizer time).
  tp comm  = per layer 2 all-reduces (or all-gather + reduce-scatter pairs with sp) of T h E
             bytes forward, 2 backward, +2 with full recompute: 8 T h E (t-1)/t bytes per
             device without recompute (the issue's term), exposed (not overlapped).
Pipeline (p stages, v chunks, m micro-batches; T_j = t_f + t_b of stage j per micro-batch,
  k the slowest stage): step = m T_k + bubble, the bubble being the fill and drain through the
  other stages: sum_{j != k} T_j for 1F1B/GPipe (the first micro-batch's forward reaches k
  through the stages before it, the last backward leaves through them), / v interleaved, and
  sum_{j != k} (T_j - 2 t_w,j) for ZB-H1 (t_w the weight-gradient GEMMs; its backward also
  pays ``split_backward_us`` per layer for the B / W split).  With equal stages
  this is Narayanan's (p-1)/m (or (p-1)/(v m)) of the ideal time; with the head on the last
  stage (the usual bottleneck) the fill/drain is the cheaper stages', not the mean stage's.
  The stages are the first (embedding), p-2 middle ones (layers only) and the last (head).
  ZB-V (vp = 2, the "v" placement): stage 0 holds the embedding and the head + loss, the
  others two chunks of layers each; its step is the replay of its own action lists with
  every chunk's F, B (input gradient) and W (weight-gradient GEMMs) seconds
  (:mod:`colonnade.analysis.zbv`), the bubble being that makespan minus m T_k; it pays
  ``split_backward_us`` like ZB-H1, and with tied embeddings no embedding/head all-reduce.
  p2p sends T h E / t bytes (scatter/gather, Narayanan et al.) and an intra-node all-gather
  when tp > 1 without sp; 2 f transfers are exposed when p2p is overlapped, 2 (m v + f)
  when it is not, f = p-1 hops of fill (2 (p-1) for ZB-V: down and back up the V).
Data parallel (:func:`_dp_exposed`): all-reduce of the gradient buffer (ZeRO-1: reduce-scatter
  of it + all-gather of the 16-bit weights).  With overlap, the reduction hides behind the last
  micro-batch's backward (the first micro-batch's forward for the weight all-gather), except the
  last bucket.  ZeRO-2 reduce-scatters every micro-batch (m per step); ZeRO-3 also all-gathers
  the weights before every forward and again before every backward (once per step without
  reshard_after_forward), each hidden behind that pass's compute when prefetched.
Optimizer: Adam reads/writes ~30 bytes per owned parameter (mixed precision) from HBM.
CPU: with more ranks than cores, the step is at least the ranks' summed busy time / cores
(each rank busy for its own stage's m T_j: a pipeline's cheaper stages leave cores to the
others), plus the communication waits; with tp > 1 also at least the critical path (slowest
stage + fill/drain) with its compute slowed by ranks / cores, since a tp group's members,
synchronising every few hundred microseconds, only progress while co-scheduled;
``compute_units`` may be the fractional number of cores free on a shared machine
(calibrate.measure_cores).
Per step, the small blocking collectives (grad-norm over tp, pp (and dp with ZeRO-1), the
logged loss over the world, sp-partial and tied gradients) each pay their latency
(:func:`step_collectives_s`); per micro-batch, vocab-parallel cross entropy adds 2
all-reduces under tp.  Ranks wait for the slowest at each blocking collective: the step's
compute grows by ``Cluster.skew_fraction(world)``, measured in calibration (0 on GPUs).
GPUs: kernels are launched asynchronously, so the host's per-operation cost (``launch_us``)
hides behind them unless they are shorter: the step is at least :func:`launch_floor_s`.
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, replace

from colonnade.analysis.cp_comm import cp_comm
from colonnade.analysis.efficiency import head_gemm_s, layer_gemm_s
from colonnade.analysis.hardware import Cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import (
    moe_stage_params,
    stage_layers,
    stage_moe_count,
    stage_params,
    stage_state_bytes,
)
from colonnade.analysis.moe import (
    MoEShape,
    dispatch_bytes,
    expert_tp_bytes,
    mlp_forward_flops_per_token,
)
from colonnade.analysis.zbv import zbv_makespan
from colonnade.config.choices import schedule_placement, tied_across_stages
from colonnade.models.counts import (
    LayerShape,
)
from colonnade.models.stages import virtual_stage, virtual_stage_layers

OPS_PER_LAYER = 24
"""Tensor operations in one layer's forward (2 norms, 4 attention and 2-3 MLP matmuls,
reshapes/transposes, RoPE, attention kernel, activation, dropouts, adds); the host pays
``op_overhead_us`` for each (backward counted as 2x)."""
HEAD_OPS = 12
"""Tensor operations of the final norm, output layer and cross entropy's forward (norm, GEMM,
max, shift, gather, exp, sum, log, div, ...), backward counted as 2x."""


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
    cp_comm: float = 0.0
    """Exposed cp attention communication (ring p2p beyond its overlap, or all-to-alls),
    part of the steady time like ``tp_comm``."""
    ep_comm: float = 0.0
    """Exposed MoE token dispatch (all-to-all or all-gather over ep), part of the steady
    time like ``tp_comm``."""

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
    cp: float = 0.0  # exposed cp attention communication inside bwd (fwd + bwd traffic)
    ep: float = 0.0  # exposed MoE dispatch communication inside fwd + bwd


def moe_layer_s(w: Workload, layout: Layout, c: Cluster) -> tuple[float, float]:
    """(forward compute seconds an MoE layer adds over a dense layer, its dispatch seconds
    forward + backward: the ep dispatcher's and the expert tp exchange's) for one
    micro-batch on one rank (module docstring)."""
    x = MoEShape.of(w.model)
    tokens = layout.local_tokens(w.seq_len) / layout.tp  # routed by this rank (sp under tp)
    moe, dense = mlp_forward_flops_per_token(x)
    delta = tokens * (moe - dense) / c.flops_per_s(w.precision)
    sent = dispatch_bytes(x, tokens, w.elem, layout.ep, w.moe_dispatcher)
    seconds = 0.0
    if sent:
        bw, lat = c.link(layout.ep, min(layout.ep, c.gpus_per_node))
        calls = 4 if w.moe_dispatcher == "all_to_all" else 6
        seconds += sent / bw + calls * (layout.ep - 1) * lat
    n = layout.expert_tp
    if n > 1:  # the expert tp exchange: counts, rows' all-gather and reduce-scatter, fwd + bwd
        bw, lat = c.link(n, min(n, c.gpus_per_node))
        rows = tokens * x.top_k
        seconds += expert_tp_bytes(rows, x.hidden, w.elem, n, x.experts // layout.ep) / bw \
            + 5 * (n - 1) * lat
    return delta, seconds


def _elementwise_bytes_per_token(m: LayerShape, w: Workload, layout: Layout) -> tuple[float,
                                                                                     float]:
    """(forward bytes per token of one layer on one device, of which core attention)."""
    e, h, t = w.elem, m.hidden, layout.tp
    rep = 4 * e * h + 2 * (3 * e + (1 if m.hidden_dropout else 0)) * h
    shard = m.mlp_matrices * e * m.ffn
    if m.rope:
        shard += 2 * e * (m.q_hidden + m.kv_hidden)
    core = 0.0
    if w.attention != "flash":  # eager or blockwise: the softmax runs over s x s scores
        core = 2 * e * m.heads * w.seq_len
        if m.attention_dropout:
            core += (2 * e + 1) * m.heads * w.seq_len
    return rep / (t if layout.sp else 1) + (shard + core) / t, core / t


FLASH_BACKWARD_EXTRA = 0.5
"""A fused (flash) attention's backward runs 5 GEMMs of the forward's 2 per head (it
recomputes the scores Q K^T: Dao 2023, FlashAttention-2, Sec. 3.1.2), 2.5x the forward, where
``backward_ratio`` counts 2x: on the CUDA path (whose ``backward_ratio`` is the FLOP ratio; a
CPU cluster's is measured on the kernel itself) the backward adds 0.5 x the core's forward."""


def layer_forward_s(w: Workload, layout: Layout, c: Cluster) -> tuple[float, float]:
    """(roofline seconds, host seconds) of one layer's forward of one micro-batch on a device.

    Roofline = GEMM seconds (each at its intensity's efficiency) + elementwise bytes /
    (eff * bandwidth); host = ``OPS_PER_LAYER * op_overhead_us``.  Backward without recompute
    costs ``backward_ratio`` (2 by FLOPs) x both.
    """
    tokens = layout.local_tokens(w.seq_len)
    b_fwd = tokens * _elementwise_bytes_per_token(w.shape, w, layout)[0]
    roof = sum(layer_gemm_s(w, layout, c)) + b_fwd / c.bytes_per_s()
    return roof, OPS_PER_LAYER * c.op_overhead_us * 1e-6


def head_fwd_bwd_s(w: Workload, layout: Layout, c: Cluster) -> tuple[float, float, float]:
    """(roofline seconds, host seconds, of which forward) of the output layer and the
    vocab-parallel cross entropy of one micro-batch, forward + backward, on one device.

    GEMM 2 T h V / t FLOPs forward, 2x backward; fp32 elementwise bytes: the GEMM writes the
    logits, then max (read), shift (read + write), exp_ and div_ in place (read + write
    each), sum (read): (E + 32) V / t per token forward; backward softmax x grad (read +
    write), read again by the head's GEMMs: (E + 8) V / t."""
    m, t = w.shape, layout.tp
    tokens = layout.local_tokens(w.seq_len)
    gemm, bw = head_gemm_s(w, layout, c), c.bytes_per_s()
    fwd = gemm + tokens * m.vocab / t * (w.elem + 32) / bw
    bwd = 2 * gemm + tokens * m.vocab / t * (w.elem + 8) / bw
    host = HEAD_OPS * c.op_overhead_us * 1e-6
    return fwd + bwd, 3 * host, fwd + host


def _layers_cost(w: Workload, layout: Layout, c: Cluster, layers: int, n_moe: int
                 ) -> _Stage:
    """Per-micro-batch costs of ``layers`` decoder layers (``n_moe`` of them MoE) on one
    device: forward, backward (recompute, the zero-bubble split's host work), the
    weight-gradient GEMMs, tp / cp / ep communication (module docstring)."""
    m, t = w.shape, layout.tp
    tokens = layout.local_tokens(w.seq_len)
    bw = c.bytes_per_s()
    weights_s, core_s = layer_gemm_s(w, layout, c)
    b_fwd, b_core = (tokens * x for x in _elementwise_bytes_per_token(m, w, layout))
    fwd = weights_s + core_s + b_fwd / bw + OPS_PER_LAYER * c.op_overhead_us * 1e-6
    bwd = c.backward_ratio * fwd
    if w.attention == "flash" and w.kernels == "cuda":  # the fused backward recomputes scores
        bwd += FLASH_BACKWARD_EXTRA * core_s
    if layout.schedule in ("zb_h1", "zbv") and layout.pp > 1:
        bwd += c.split_backward_us * 1e-6  # the B / W split's host work
    if layout.recompute == "full":
        bwd += fwd
    elif layout.recompute == "selective":
        bwd += core_s + b_core / bw
    per_node = min(t, c.gpus_per_node)
    ar = c.all_reduce_s(tokens * m.hidden * w.elem, t, per_node)
    if layout.sp:  # each all-reduce becomes an all-gather + a reduce-scatter pair
        ar = (c.gather_s(tokens * m.hidden * w.elem, t, per_node, "all_gather")
              + c.gather_s(tokens * m.hidden * w.elem, t, per_node, "reduce_scatter"))
    comm_f, comm_b = 2 * ar, (4 if layout.recompute == "full" else 2) * ar
    ring = cp_comm(w, layout, c).exposed_s  # cp attention's exposed traffic, fwd + bwd
    fwd_s = layers * (fwd + comm_f)
    bwd_s = layers * (bwd + comm_b + ring)
    ep_s = 0.0
    if w.model.moe:
        delta, ep_s = (n_moe * v for v in moe_layer_s(w, layout, c))
        fwd_s += delta + ep_s / 2
        bwd_s += c.backward_ratio * delta + ep_s / 2
    wgrad = layers * weights_s  # the weight-gradient GEMMs: the forward's shapes, transposed
    return _Stage(fwd=fwd_s, bwd=bwd_s, wgrad=wgrad, comm=layers * (comm_f + comm_b),
                  cp=layers * ring, ep=ep_s)


def _embedding_cost(w: Workload, layout: Layout, c: Cluster) -> _Stage:
    """The vocab-parallel embedding's forward all-reduce over tp (its lookup is free)."""
    tokens = layout.local_tokens(w.seq_len)
    emb = c.all_reduce_s(tokens * w.shape.hidden * w.elem, layout.tp,
                         min(layout.tp, c.gpus_per_node))
    return _Stage(fwd=emb, bwd=0.0, wgrad=0.0, comm=emb)


def _head_cost(w: Workload, layout: Layout, c: Cluster) -> _Stage:
    """Output layer and vocab-parallel cross entropy: compute (:func:`head_fwd_bwd_s`), the
    loss's 2 fp32 all-reduces in the forward (max [tokens], packed (sum exp, target logit)
    [2, tokens]) and the input gradient's all-reduce in the backward."""
    tokens = layout.local_tokens(w.seq_len)
    t, per_node = layout.tp, min(layout.tp, c.gpus_per_node)
    roof, host, head_f = head_fwd_bwd_s(w, layout, c.head())
    head_comm = c.all_reduce_s(tokens * w.shape.hidden * w.elem, t, per_node)
    ce = c.all_reduce_s(tokens * 4, t, per_node) + c.all_reduce_s(tokens * 8, t, per_node)
    return _Stage(fwd=ce + head_f, bwd=roof + host - head_f + head_comm,
                  wgrad=head_gemm_s(w, layout, c.head()), comm=ce + head_comm)


def _plus(a: _Stage, b: _Stage) -> _Stage:
    """Field-wise sum of two costs (a stage of several parts)."""
    return _Stage(*(x + y for x, y in zip(astuple(a), astuple(b), strict=True)))


def _stage_costs(w: Workload, layout: Layout, c: Cluster, stage: str,
                 index: int | None = None) -> _Stage:
    """Per-micro-batch costs of pipeline ``stage``: l/pp layers (uneven stages: those of
    stage ``index``, or of the stage the kind stands for), plus the embedding on
    'first' / 'only' / 'ends' and the head + loss on 'last' / 'only' / 'ends'."""
    n_moe = 0
    if layout.pipeline_layout is not None:
        j = layout.stage_index(stage if index is None else index, w.shape.layers)
        layers = len(layout.stage_layers(w.shape.layers)[j])
        n_moe = stage_moe_count(w, layout, j) or 0
    else:
        layers = w.shape.layers // layout.pp
        if w.model.moe:
            n_moe = MoEShape.of(w.model).stage_moe_layers(
                layout.pp, "max" if stage == "middle" else stage, _placement(layout))
    cost = _layers_cost(w, layout, c, layers, n_moe)
    if stage in ("first", "only", "ends"):
        cost = _plus(cost, _embedding_cost(w, layout, c))
    if stage in ("last", "only", "ends"):
        cost = _plus(cost, _head_cost(w, layout, c))
    return cost


def _placement(layout: Layout) -> str:
    """The virtual-stage placement of the layout's schedule ("v" for zbv, else "loop")."""
    return schedule_placement(layout.schedule) if layout.pp > 1 else "loop"


def _zbv_chunks(w: Workload, layout: Layout, c: Cluster) -> list[tuple[_Stage, _Stage]]:
    """Per stage, the costs of its two ZB-V chunks: chunk k of stage s is virtual stage
    v (s on the way down, 2 pp - 1 - s on the way up) with l/(2 pp) layers and v's MoE
    layers, plus the embedding on v = 0 and the head + loss on v = 2 pp - 1."""
    pp, counts = layout.pp, layout.chunk_layers(w.shape.layers)
    x = MoEShape.of(w.model) if w.model.moe else None
    chunk_layers = (virtual_stage_layers(w.shape.layers, pp, 2, layout.pipeline_layout)
                    if x and layout.pipeline_layout is not None else None)
    out = []
    for s in range(pp):
        pair = []
        for k in range(2):
            v = virtual_stage(s, k, pp, "v")
            n_moe = 0
            if x and chunk_layers is not None:
                n_moe = x.moe_layers_of(tuple(chunk_layers[v]), v == 2 * pp - 1)
            elif x:
                n_moe = x.chunk_moe_layers(pp, 2, v)
            cost = _layers_cost(w, layout, c, counts[v], n_moe)
            if v == 0:
                cost = _plus(cost, _embedding_cost(w, layout, c))
            if v == 2 * pp - 1:
                cost = _plus(cost, _head_cost(w, layout, c))
            pair.append(cost)
        out.append((pair[0], pair[1]))
    return out


def _stage_names(pp: int, schedule: str = "1f1b") -> list[str]:
    """Stage kinds of a pipeline, in order: 'only', or 'first', p-2 x 'middle', 'last'; ZB-V's
    'ends' (embedding and head on stage 0) and p-1 x 'middle'."""
    if pp == 1:
        return ["only"]
    if schedule == "zbv":
        return ["ends", *["middle"] * (pp - 1)]
    return ["first", *["middle"] * (pp - 2), "last"]


def _pipeline(layout: Layout, m: int, stages: list[_Stage],
              chunks: list[tuple[_Stage, _Stage]] | None = None
              ) -> tuple[float, float, float]:
    """(steady time, bubble time, of which tp comm in the steady part) of the slowest stage.

    ZB-V: the bubble is the replayed makespan (:func:`colonnade.analysis.zbv.zbv_makespan`)
    minus the steady time, with ``chunks`` the stages' chunk costs (default: each stage's
    halves)."""
    v = layout.vp
    k = max(range(len(stages)), key=lambda j: stages[j].fwd + stages[j].bwd)
    worst = stages[k]
    steady = m * (worst.fwd + worst.bwd)
    steady_comm = m * worst.comm
    others = [st for j, st in enumerate(stages) if j != k]
    if layout.schedule == "zbv" and layout.pp > 1:
        if chunks is None:
            half = [_Stage(*(x / 2 for x in astuple(st))) for st in stages]
            chunks = [(h, h) for h in half]
        span = zbv_makespan([tuple((ch.fwd, ch.bwd, ch.wgrad) for ch in pair)
                             for pair in chunks], m)
        bubble = max(span - steady, 0.0)
    elif layout.schedule == "zb_h1":
        bubble = sum(max(st.fwd + st.bwd - 2 * st.wgrad, 0.0) for st in others)
    else:
        bubble = sum(st.fwd + st.bwd for st in others)
        if layout.schedule == "interleaved_1f1b":
            bubble /= v
    return steady, bubble, steady_comm


def _hidden(comm: float, window: float, last: float, overlap: bool) -> float:
    """Exposed part of ``comm`` seconds overlapped with ``window`` seconds of compute: all of
    it without overlap, else what exceeds the window but at least the last bucket's share."""
    return max(comm - window, comm * last) if overlap else comm


def _dp_exposed(w: Workload, layout: Layout, c: Cluster, params: float, stage: _Stage,
                m: int) -> tuple[float, float]:
    """(exposed dp communication, full dp communication) seconds per step.

    Stage 0 all-reduces the gradient buffer, stage 1 reduce-scatters it and all-gathers the
    weights, both once per step, hidden behind the last micro-batch's backward (the first
    one's forward for the gather: windows of one chunk, bwd / vp and fwd / vp).  Stage 2
    reduce-scatters every micro-batch (m per step, in the reduce dtype) behind that
    micro-batch's backward, and all-gathers the weights once.  Stage 3 all-gathers each
    bucket before its forward and again before its backward (2 m gathers per step; one per
    step without reshard_after_forward), prefetched behind the compute when zero_prefetch
    > 0, and reduce-scatters m times; no gather after the optimizer.  Hybrid sharding adds
    an all-reduce of the gradient shard over the dp / S replicas once per step.
    """
    dp = layout.dp_cp  # gradients are reduced over dp x cp
    if dp == 1:
        return 0.0, 0.0
    t, g, z, s = layout.tp, c.gpus_per_node, layout.zero, layout.shard
    per_node = dp if layout.world <= g else max(1, min(dp, g // t))
    wb, gb, _ = stage_state_bytes(w.precision, 0, 1)
    last = min(1.0, w.bucket_size / max(params, 1.0))
    bwd, fwd = stage.bwd, stage.fwd
    if z == 0:
        red = c.all_reduce_s(params * gb, dp, per_node)
        return _hidden(red, bwd / layout.vp, last, w.overlap_grad_reduce), red
    node_s = min(per_node, s)
    replicas = dp // s
    rep = c.all_reduce_s(params * gb / s, replicas, max(1, per_node // s))
    gather = c.gather_s(params * wb, s, node_s, "all_gather")
    if z == 1:
        red = c.gather_s(params * gb, s, node_s, "reduce_scatter") + rep
        exposed = _hidden(red, bwd / layout.vp, last, w.overlap_grad_reduce)
        exposed += _hidden(gather, fwd / layout.vp, last, w.overlap_param_gather)
        return exposed, red + gather
    rs = c.gather_s(params * w.reduce_bytes, s, node_s, "reduce_scatter")
    if z == 2:
        exposed = m * _hidden(rs, bwd, last, w.overlap_grad_reduce) + rep
        exposed += _hidden(gather, fwd / layout.vp, last, w.overlap_param_gather)
        return exposed, m * rs + rep + gather
    ahead = w.zero_prefetch > 0
    if layout.reshard:
        exposed = m * (_hidden(gather, fwd, last, ahead)
                       + _hidden(gather + rs, bwd, last, ahead and w.overlap_grad_reduce))
        return exposed + rep, m * (2 * gather + rs) + rep
    exposed = _hidden(gather, fwd, last, ahead) + m * _hidden(rs, bwd, last,
                                                              w.overlap_grad_reduce)
    return exposed + rep, gather + m * rs + rep


def _optimizer_s(w: Workload, layout: Layout, c: Cluster, params: float) -> float:
    """Adam's HBM traffic: ~30 bytes per owned parameter (mixed precision; 7 E otherwise)
    plus 8 (2 E) per parameter of the gradient buffer (read for the norm, zeroed), which is
    sharded from stage 2 on."""
    s = layout.shard
    full = s if layout.zero >= 2 else 1
    per_param = 8 / full + 30 / s if w.mixed else 2 * w.elem / full + 7 * w.elem / s
    return params * per_param / c.bytes_per_s()


def step_collectives_s(w: Workload, layout: Layout, c: Cluster) -> float:
    """Seconds of the small blocking collectives issued once per step (latency-bound).

    grad-norm all-reduce (one float64) over tp, over pp, and over dp with ZeRO; the logged
    loss all-reduce ([2] float64) over the world; the fused sp-partial gradient all-reduce
    over tp (norm weights: (2 l/p + 1) h) with sp; the tied embedding/head gradient
    all-reduce (V h / t) over the pp ends with tied embeddings (not under ZB-V, whose stage 0
    holds both ends: one shared copy)."""
    t, p, g = layout.tp, layout.pp, c.gpus_per_node
    m = w.shape

    def ar(nbytes: float, n: int) -> float:
        return c.all_reduce_s(nbytes, n, min(n, g))

    total = ar(8, t) + ar(8, p) + (ar(8, layout.dp_cp) if layout.zero else 0.0)
    total += ar(16, layout.world)
    if layout.sp and t > 1:
        layers = (m.layers / p if layout.pipeline_layout is None
                  else layout.max_stage_layers(m.layers))
        total += ar((2 * layers + 1) * m.hidden * w.elem, t)
    if p > 1 and tied_across_stages(m.tied, layout.schedule):  # ZB-V: one copy, stage 0
        total += ar(m.vocab * m.hidden / t * w.elem, 2)
    return total


def launch_floor_s(w: Workload, layout: Layout, c: Cluster) -> float:
    """Host seconds to issue one step's tensor operations on the last (or only) stage, the
    least a step of asynchronously launched kernels takes: per micro-batch l/p layers x
    ``OPS_PER_LAYER`` x (forward + 2 backward (+1 full recompute)) + ``HEAD_OPS`` x 3, each
    ``launch_us``; plus ``step_overhead_s``.  0 where the cluster has no ``launch_us``."""
    if c.launch_us <= 0:
        return 0.0
    passes = 4 if layout.recompute == "full" else 3
    layers = int(stage_layers(w.shape.layers, layout, "last" if layout.pp > 1 else "only"))
    per_mb = layers * OPS_PER_LAYER * passes + HEAD_OPS * 3
    return layout.microbatches(w.global_batch) * per_mb * c.launch_us * 1e-6 + c.step_overhead_s


def step_time(w: Workload, layout: Layout, c: Cluster) -> Timing:
    """Predicted seconds per optimizer step of ``layout`` (see the module docstring)."""
    m = layout.microbatches(w.global_batch)
    names = _stage_names(layout.pp, layout.schedule)
    chunks = None
    if layout.schedule == "zbv" and layout.pp > 1:
        chunks = _zbv_chunks(w, layout, c)
        stages = [_plus(*pair) for pair in chunks]
    else:
        stages = [_stage_costs(w, layout, c, n, j) for j, n in enumerate(names)]
    steady, bubble, tp_comm = _pipeline(layout, m, stages, chunks)
    slowest = max(stages, key=lambda st: st.fwd + st.bwd)
    cp_s = m * slowest.cp  # the slowest stage's, as above
    ep_s = m * slowest.ep
    p2p = p2p_full = 0.0
    if layout.pp > 1:
        tokens = layout.local_tokens(w.seq_len)
        full = tokens * w.shape.hidden * w.elem
        one = c.p2p_s(full / layout.tp, layout.world > c.gpus_per_node)
        if layout.tp > 1 and not layout.sp:
            one += c.gather_s(full, layout.tp, min(layout.tp, c.gpus_per_node), "all_gather")
        fill = layout.pp - 1
        if layout.schedule == "zbv":
            fill *= 2  # down and back up the V (the turn is a local hand-over)
        hops = 2 * fill
        p2p_full = 2 * (m * layout.vp + fill) * one
        p2p = hops * one if w.overlap_p2p else p2p_full
    params = max(_dense_stage_params(w, layout, n) for n in names)
    dp, dp_full = _dp_exposed(w, layout, c, params, stages[0], m)
    opt = _optimizer_s(w, layout, c, params)
    if w.model.moe:
        e_dp, e_full, e_opt = _expert_dp_s(w, layout, c, names, stages[0], m)
        dp, dp_full, opt = dp + e_dp, dp_full + e_full, opt + e_opt
    extra = step_collectives_s(w, layout, c)
    skew = c.skew_fraction(layout.world)
    # ranks wait for the slowest at every blocking collective: a measured fraction of the
    # compute between them (the whole step's compute is cut into such segments)
    total = (steady + bubble + p2p + dp + opt + extra + c.step_overhead_s
             + skew * (steady - tp_comm - cp_s - ep_s))
    if c.compute_units and layout.world > c.compute_units:
        # Compute (and the optimizer) time-shares the cores; the communication waits then
        # follow on top (a rank blocked in a collective gives its core to the others, but
        # its partner only answers once it has had its own share).
        own = sum(m * (st.fwd + st.bwd - st.comm - st.cp - st.ep)  # one rank per stage
                  + _optimizer_s(w, layout, c, _dense_stage_params(w, layout, n))
                  for st, n in zip(stages, names, strict=True))
        busy = own * layout.tp * layout.cp * layout.dp / c.compute_units
        waits = tp_comm + cp_s + ep_s + p2p_full + dp_full + extra
        total = max(total, busy * (1 + skew) + waits + c.step_overhead_s)
        if layout.tp > 1:
            # a tp group synchronises every ~ms: its members progress only while co-scheduled,
            # so the critical path's compute (the slowest stage and the fill/drain) runs at
            # cores / ranks speed, not just the step's summed work
            share = layout.world / c.compute_units
            crit = share * (1 + skew) * (steady - tp_comm - cp_s - ep_s + bubble + opt)
            total = max(total, crit + tp_comm + cp_s + ep_s + p2p_full + dp + extra
                        + c.step_overhead_s)
    total = max(total, launch_floor_s(w, layout, c))  # kernels shorter than their launches
    return Timing(compute=steady - tp_comm - cp_s - ep_s, tp_comm=tp_comm, bubble=bubble,
                  p2p=p2p, dp_comm=dp, optimizer=opt,
                  overhead=total - (steady + bubble + p2p + dp + opt), total=total,
                  cp_comm=cp_s, ep_comm=ep_s)


def _expert_dp_s(w: Workload, layout: Layout, c: Cluster, names: list[str], stage: _Stage,
                 m: int) -> tuple[float, float, float]:
    """(exposed, full) seconds of the routed experts' gradient reduction and their optimizer
    seconds: :func:`_dp_exposed` / :func:`_optimizer_s` over expert_dp (edp = tp cp dp / (ep
    expert_tp) ranks, the layout's ZeRO stage sharding over them or their hybrid shard groups)
    with the fullest stage's expert parameters, in the same backward window as the dense
    reduction (each exposed part added)."""
    uneven = layout.pipeline_layout is not None  # 'middle': the fullest middle stage
    experts = max(moe_stage_params(w, layout, "first" if n == "middle" and not uneven
                                   else n)[1] for n in names)
    elay = replace(layout, dp=layout.edp, cp=1, ep=1, expert_tp=1,
                   zero_shard_size=layout.expert_shard_size)
    exposed, full = _dp_exposed(w, elay, c, experts, stage, m)
    return exposed, full, _optimizer_s(w, elay, c, experts)


def _dense_stage_params(w: Workload, layout: Layout, stage: str) -> float:
    """Parameters of ``stage`` reduced over dp x cp with the dense stage's ZeRO sharding:
    the stage's dense parameters with its MoE layers' non-expert change.  (The routed
    experts' own reduction over edp is not timed yet.)  A middle stage counts as the first
    one (as many layers and the embedding), except under ZB-V, whose middle stages hold layers
    only (stage 0 holds both ends); with uneven stages as the larger of the first and the
    fullest middle stage."""
    kinds = [stage]
    if stage == "middle" and layout.schedule != "zbv":
        kinds = ["first", "middle"] if layout.pipeline_layout is not None else ["first"]
    return max(stage_params(w.shape, layout, k)
               + (moe_stage_params(w, layout, k)[0] if w.model.moe else 0.0) for k in kinds)
