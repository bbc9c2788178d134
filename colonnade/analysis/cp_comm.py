"""Context-parallel attention communication: bytes and exposed seconds per layer per micro-batch.

One layer, one micro-batch [b, s], one rank of a cp group of size c (s_l = s/c rows, the zigzag
chunks r and 2c-1-r), tp degree t, kv heads g (g_l = g/t per tp rank), head size d, E bytes
per element, A = max(E, 4) the log-sum-exp dtype's.  A kv block is the rank's (k, v) packed:
K = 2 b s_l g_l d E bytes; a dK/dV accumulator the same elements in A: G = K A / E.

ring (:mod:`colonnade.context_parallel.ring`): the forward passes kv blocks around the ring,
    c - 1 steps, one block sent (and one received) per step while the rank attends the block it
    holds: (c - 1) K bytes.  The backward's c steps pass the kv blocks again (steps 0 .. c-2)
    and the accumulators (steps 1 .. c-1), then one last hop hands every accumulator home:
    (c - 1) K + c G bytes.  Each step overlaps its transfer with one block's attention,
    core / c of the layer's core attention time (the zigzag split gives every rank the same
    causal work per step), so a step exposes max(0, transfer - compute); the last hop has no
    compute beside it.  With cp_overlap = False every transfer is exposed.
all_to_all (:mod:`colonnade.context_parallel.all_to_all_attention`): the forward re-shards q,
    k, v (sequence -> heads) and the output back (heads -> sequence), 4 all-to-alls; the
    backward the same 4 for their gradients.  Each moves (c - 1)/c of the rank's tensor:
    q and out b s_l h/t E, k and v b s_l d g_x E with g_x = c k_r (= g_l, or c when kv heads
    are replicated because c is a multiple of g_l).  Not overlapped: all exposed.
hierarchical (:mod:`colonnade.context_parallel.hierarchical`): the all-to-all above over
    a = cp_a2a_size consecutive cp ranks (c replaced by a; its inner groups span a t ranks,
    so they stay inside a node when a t <= gpus per node), then the ring above over the
    r = c / a ranks of an outer group on the all-to-all's head share: its kv block is
    K = 2 b (a s_l) h_kv d E, h_kv = g_l / a (or 1 replicated head), and each of its steps
    hides behind core / r.  At a = c it is all_to_all, at a = 1 the ring.
Recompute: full recompute repeats the forward's traffic in backward.  Selective recompute
checkpoints all_to_all's core and re-runs its q, k, v all-to-alls (not the output's: the
checkpoint stops once the tensors backward needs are recomputed); it leaves the ring alone
(the ring Function keeps only q, k, v, output and log-sum-exp), so no ring traffic repeats;
nor hierarchical's (its all-to-alls feed the ring, which keeps what backward needs).
"""

from __future__ import annotations

from dataclasses import dataclass

from colonnade.analysis.efficiency import layer_gemm_s
from colonnade.analysis.hardware import Cluster
from colonnade.analysis.layout import Layout, Workload


@dataclass(frozen=True)
class CpComm:
    """cp attention traffic and time of one layer for one micro-batch on one rank."""

    fwd_bytes: float
    """Bytes this rank sends in the forward (recomputation not counted)."""
    bwd_bytes: float
    """Bytes this rank sends in the backward (plus ``fwd_bytes`` again under recompute)."""
    full_s: float
    """Seconds of all transfers (forward + backward, recompute included)."""
    exposed_s: float
    """Seconds of them not hidden behind attention compute."""


def _kv_heads(w: Workload, layout: Layout, a2a: int) -> tuple[int, int]:
    """(kv_l, h_kv): the tp-local kv heads, and those a rank holds after an all-to-all over
    ``a2a`` ranks (kv_l / a2a, or 1 replicated head when a2a is a multiple of kv_l)."""
    kv_local = w.shape.kv_hidden // w.shape.head_dim // layout.tp
    return kv_local, (kv_local // a2a if kv_local % a2a == 0 else 1)


def _cross_node(layout: Layout, c: Cluster) -> bool:
    """Whether the cp group spans nodes (order tp-cp-dp-pp: cp ranks are tp apart)."""
    return layout.tp * layout.cp > c.gpus_per_node


def _recomputes(layout: Layout) -> bool:
    """Whether backward re-runs the ring's forward traffic: under full recompute only."""
    return layout.recompute == "full"


def _ring(w: Workload, layout: Layout, c: Cluster, size: int, blk: float) -> CpComm:
    """Ring attention over ``size`` ranks passing kv blocks of ``blk`` bytes (module doc)."""
    if size == 1:
        return CpComm(fwd_bytes=0.0, bwd_bytes=0.0, full_s=0.0, exposed_s=0.0)
    cross = _cross_node(layout, c)
    acc = blk * max(w.elem, 4) / w.elem  # G: the dK/dV accumulator
    core = layer_gemm_s(w, layout, c)[1]  # the layer's core attention forward, this rank
    step_f, step_b = core / size, c.backward_ratio * core / size
    fwd = [blk] * (size - 1)  # bytes sent at each overlapped step
    bwd = [blk] + [blk + acc] * (size - 2) + [acc]
    hop = c.p2p_s(acc, cross)  # the last hop home, nothing to hide behind
    full_f = sum(c.p2p_s(x, cross) for x in fwd)
    full_b = sum(c.p2p_s(x, cross) for x in bwd) + hop
    if w.cp_overlap:
        exp_f = sum(max(0.0, c.p2p_s(x, cross) - step_f) for x in fwd)
        exp_b = sum(max(0.0, c.p2p_s(x, cross) - step_b) for x in bwd) + hop
    else:
        exp_f, exp_b = full_f, full_b
    rep = 1 if _recomputes(layout) else 0
    fwd_bytes, bwd_bytes = sum(fwd), sum(bwd) + acc
    return CpComm(fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes + rep * fwd_bytes,
                  full_s=(1 + rep) * full_f + full_b, exposed_s=(1 + rep) * exp_f + exp_b)


def _all_to_all(w: Workload, layout: Layout, c: Cluster, size: int,
                selective_redo: bool) -> CpComm:
    """All-to-all re-sharding over ``size`` consecutive cp ranks (all exposed);
    ``selective_redo``: selective recompute re-runs the q, k, v all-to-alls."""
    if size == 1:
        return CpComm(fwd_bytes=0.0, bwd_bytes=0.0, full_s=0.0, exposed_s=0.0)
    m, t = w.shape, layout.tp
    tokens = layout.local_tokens(w.seq_len)
    _, h_kv = _kv_heads(w, layout, size)
    kv_x = size * h_kv  # kv heads' rows passing through (replicated ones counted each time)
    qkv = [tokens * m.q_hidden / t * w.elem] + [tokens * m.head_dim * kv_x * w.elem] * 2
    tensors = [*qkv, tokens * m.q_hidden / t * w.elem]  # q, k, v, out
    redo = {"full": tensors, "selective": qkv if selective_redo else []}.get(
        layout.recompute, [])
    per_node = min(size, max(1, c.gpus_per_node // t))

    def moved(xs: list[float]) -> tuple[float, float]:  # (bytes sent, seconds)
        return (size - 1) / size * sum(xs), sum(c.gather_s(x, size, per_node) for x in xs)

    (sent, secs), (again, again_s) = moved(tensors), moved(redo)
    return CpComm(fwd_bytes=sent, bwd_bytes=sent + again, full_s=2 * secs + again_s,
                  exposed_s=2 * secs + again_s)


def ring_comm(w: Workload, layout: Layout, c: Cluster) -> CpComm:
    """Ring attention's per-layer traffic and exposed time (module docstring); the kv block
    K = 2 b s_l g_l d E (GQA: kv not expanded)."""
    kv_local, _ = _kv_heads(w, layout, 1)
    blk = 2.0 * layout.local_tokens(w.seq_len) * kv_local * w.shape.head_dim * w.elem
    return _ring(w, layout, c, layout.cp, blk)


def all_to_all_comm(w: Workload, layout: Layout, c: Cluster) -> CpComm:
    """The all-to-all variant's per-layer traffic and time (all exposed)."""
    return _all_to_all(w, layout, c, layout.cp, selective_redo=True)


def hierarchical_comm(w: Workload, layout: Layout, c: Cluster) -> CpComm:
    """Hierarchical cp's per-layer traffic and time: the all-to-all over a = cp_a2a_size
    ranks (never checkpointed by selective recompute) plus the ring over r = cp / a ranks on
    the a2a's head share, kv block K = 2 b (a s_l) h_kv d E (module docstring)."""
    a = layout.cp_a2a_size or 1
    _, h_kv = _kv_heads(w, layout, a)
    blk = 2.0 * layout.local_tokens(w.seq_len) * a * h_kv * w.shape.head_dim * w.elem
    inner = _all_to_all(w, layout, c, a, selective_redo=False)
    outer = _ring(w, layout, c, layout.cp // a, blk)
    return CpComm(fwd_bytes=inner.fwd_bytes + outer.fwd_bytes,
                  bwd_bytes=inner.bwd_bytes + outer.bwd_bytes,
                  full_s=inner.full_s + outer.full_s,
                  exposed_s=inner.exposed_s + outer.exposed_s)


def cp_comm(w: Workload, layout: Layout, c: Cluster) -> CpComm:
    """Per-layer cp attention communication of ``layout`` (zeros at cp = 1)."""
    if layout.cp == 1:
        return CpComm(fwd_bytes=0.0, bwd_bytes=0.0, full_s=0.0, exposed_s=0.0)
    if layout.cp_attention == "all_to_all":
        return all_to_all_comm(w, layout, c)
    if layout.cp_attention == "hierarchical":
        return hierarchical_comm(w, layout, c)
    return ring_comm(w, layout, c)


def step_cp_bytes(w: Workload, layout: Layout, c: Cluster) -> float:
    """Bytes one rank sends for cp attention per optimizer step: layers per stage x
    micro-batches x (forward + backward) of :func:`cp_comm`."""
    one = cp_comm(w, layout, c)
    layers = layout.max_stage_layers(w.shape.layers)
    return layers * layout.microbatches(w.global_batch) * (one.fwd_bytes + one.bwd_bytes)
