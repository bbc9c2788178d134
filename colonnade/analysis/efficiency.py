"""How a GEMM's achieved FLOP/s depends on its size: the arithmetic-intensity curve.

A GEMM C[M, N] = A[M, K] B[K, N] in E-byte elements does 2 M K N FLOPs and, at best, moves
E (M K + K N + M N) bytes through HBM, so its arithmetic intensity is

    I = 2 M K N / (E (M K + K N + M N))   FLOP per byte  (~ 2 / (E (1/M + 1/K + 1/N))),

set by its smallest dimension.  A device of peak P FLOP/s and bandwidth W bytes/s is
bandwidth-bound below its balance P / W (A100 153, H100 SXM 295, H200 206 FLOP/byte) and the
cuBLAS kernels' tiles, waves and epilogues make the approach to the compute roof gradual.  The
planner models the achieved fraction of peak as the saturating curve

    eff(I) = efficiency * I / (I + knee),      knee = gemm_knee_balance * P / W,

``efficiency`` the large-GEMM asymptote and ``knee`` the intensity where half of it is reached
(:class:`~colonnade.analysis.hardware.Cluster`).  The knee is a fixed multiple of the device's
balance: one dimensionless constant, fitted with ``efficiency`` on Narayanan et al. Table 1
(A100) by :func:`colonnade.analysis.fit.fit_gemm_curve`, carries the curve to H100 / H200 by
their spec sheets.  A device twice as compute-rich per byte needs twice the intensity for the
same fraction of its peak: why models of hidden <= 4096 (and tp-sharded layers) reach a lower
fraction of an H100's peak than of an A100's.  With ``knee = 0`` (CPUs; calibrated
per machine) every GEMM runs at ``efficiency``, the earlier one-constant model.

The GEMMs of one decoder layer's forward on one tp rank (T = micro-batch x s tokens, tp t,
h_kv the key/value width, f the MLP width, d the head dim):
    QKV     [T, h] x [h, (h + 2 h_kv)/t]       out   [T, h/t] x [h/t, h]
    MLP in  [T, h] x [h, g f/t] (g = 2 SwiGLU) MLP out [T, f/t] x [f/t, h]
    core attention 4 s h T / t FLOPs, per head [s, d] x [d, s] and [s, s] x [s, d]: fused
    (flash) it streams Q, K, V, O once: I = s / E; eager (and blockwise, block by block) it
    also writes and reads the s x s scores: I of the [s, d] x [d, s] GEMM.
The output head is [T, h] x [h, V/t].  Backward GEMMs have the same shapes, transposed.
"""

from __future__ import annotations

from colonnade.analysis.hardware import Cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.models.counts import attended_keys


def gemm_intensity(m: float, k: float, n: float, elem: float, write_out: bool = True) -> float:
    """FLOP per HBM byte of [m, k] x [k, n] in ``elem``-byte elements (see module docstring);
    ``write_out=False`` leaves out the [m, n] result (a fused kernel that never stores it)."""
    traffic = m * k + k * n + (m * n if write_out else 0.0)
    return 2.0 * m * k * n / (elem * traffic)


def gemm_efficiency(c: Cluster, intensity: float) -> float:
    """Achieved fraction of peak FLOP/s of a GEMM of ``intensity`` FLOP/byte on ``c``:
    efficiency * I / (I + knee); ``efficiency`` itself where the cluster has no knee."""
    knee = c.gemm_knee
    if knee <= 0:
        return c.efficiency
    return c.efficiency * intensity / (intensity + knee)


def gemm_s(c: Cluster, flops: float, intensity: float, precision: str) -> float:
    """Seconds of ``flops`` FLOPs of GEMMs of ``intensity`` on one device of ``c``."""
    if flops <= 0:
        return 0.0
    return flops / (c.peak_flops_per_s(precision) * gemm_efficiency(c, intensity))


def layer_gemms(w: Workload, layout: Layout) -> tuple[list[tuple[float, float]],
                                                      tuple[float, float]]:
    """([(FLOPs, intensity) of each weight GEMM], (FLOPs, intensity) of the core attention)
    of one layer's forward of one micro-batch on one tp rank; under cp the rank's b s/cp
    tokens, whose queries attend over the full s (the zigzag split balances causal work)."""
    m, t, e, s = w.shape, layout.tp, float(w.elem), w.seq_len
    tokens = layout.local_tokens(s)
    h, f = m.hidden, m.ffn
    gate = m.mlp_matrices - 1  # column matrices of the MLP (gate and up, or fc)
    q = m.q_hidden
    shapes = [(h, (q + 2 * m.kv_hidden) / t), (q / t, h), (h, gate * f / t), (f / t, h)]
    mats = [(2 * tokens * k * n, gemm_intensity(tokens, k, n, e)) for k, n in shapes]
    core = gemm_intensity(s, m.head_dim, s, e, write_out=w.attention != "flash")
    return mats, (4.0 * attended_keys(m, s) * q * tokens / t, core)  # a window: min(s, W)


def layer_gemm_s(w: Workload, layout: Layout, c: Cluster) -> tuple[float, float]:
    """(seconds of the weight GEMMs, seconds of the core attention) of one layer's forward of
    one micro-batch on one tp rank."""
    mats, (core_flops, core_i) = layer_gemms(w, layout)
    weights = sum(gemm_s(c, fl, i, w.precision) for fl, i in mats)
    return weights, gemm_s(c, core_flops, core_i, w.precision)


def head_gemm_s(w: Workload, layout: Layout, c: Cluster) -> float:
    """Seconds of the output head's forward GEMM [T, h] x [h, V/t] on one tp rank (T the
    rank's b s/cp tokens)."""
    m, t = w.shape, layout.tp
    tokens = layout.local_tokens(w.seq_len)
    flops = 2.0 * tokens * m.hidden * m.vocab / t
    return gemm_s(c, flops, gemm_intensity(tokens, m.hidden, m.vocab / t, w.elem), w.precision)
