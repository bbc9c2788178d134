"""Float8 training of the linear layers (``training.fp8``): torchao's dynamic float8 recipes.

Every GEMM of a linear Y = X W^T (X [m, k] rows of tokens, W [n, k] the nn.Linear weight) and
of its two gradient GEMMs reads float8 operands, each scaled from the amax of the region it
shares a scale with, and accumulates and outputs in the model's dtype::

    scale(A)   = fp8_max / max(amax(A), 1e-12)       float64 maths, stored float32
    q(A)       = fp8(clamp(float32(A) * scale, -fp8_max, fp8_max))        (saturated)
    deq(q, s)  = q / s
    Y          = deq(q(X)) deq(q(W))^T                                      [m, n]
    dX         = deq(q(dY)) deq(q(W))                                       [m, k]
    dW         = deq(q(dY))^T deq(q(X))                                     [n, k]

'tensorwise' (torchao's default, Float8LinearRecipeName.TENSORWISE): one amax per tensor,
X and W in e4m3, dY in e5m2 (both gradient GEMMs share dY's scale; X and W keep their forward
scales). 'rowwise' (torchao's ROWWISE): every operand in e4m3 with one amax per row of the
GEMM's output it feeds, scales rounded down to a power of two: forward per row of X and per
output channel of W (amax over k); dgrad per row of dY and per input channel of W (amax over
n); wgrad per output channel of dY and per input channel of X (amax over m). The masters,
gradients and optimizer states stay in their own dtypes: float8 exists only inside a GEMM.

Grouped GEMMs (the routed experts, G groups of rows, group e multiplying W_e) are the same
maths per group: a "tensor" amax is one per group (each expert's rows, each expert's weight).

Logical scales. A tensor split over a group (tp, expert tp) has the scale of the whole logical
tensor: an amax whose region spans the split dim is all-reduced (MAX) over that group, so a
layout quantises exactly as the single process does. Column-parallel (n split): W's tensor
amax and dY's (tensor, or per row under rowwise) and, rowwise, W's per-input-channel amax for
dgrad; row-parallel (k split): X's and W's amaxes that span k. All of a pass's amaxes that
need it travel in one all-reduce, on the same group and in the same order on every rank:
tensorwise, column-parallel 1 float forward (W) and 1 backward (dY), row-parallel 2 forward
(X, W) and none backward; rowwise, column-parallel none forward and m + k floats backward
(dY's rows, W's input channels), row-parallel m + n forward (X's rows, W's output channels)
and none backward (m = tokens of the micro-batch). These are latency-bound collectives (a few
microseconds to tens on NVLink) that the next GEMM waits for; torchao's tensor-parallel
float8 reduces the same amaxes. The rows dim m is never split at a GEMM (the sequence is
gathered under sp); dp and cp split the batch and the sequence, so activation and gradient
amaxes there are each rank's own tokens', as with torchao under FSDP.

Two kernels: ``torch._scaled_mm`` (the float8 tensor cores of CUDA sm89+, where
:func:`colonnade.device.fp8_gemm_supported` says so; it also runs on CPU, where the tests
check it against the emulation) and the emulation, ``deq(q(A)) deq(q(B))^T`` in float32
(float64 for a float64 model), chosen per call by :func:`kernel_for`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from colonnade.device import fp8_gemm_supported
from colonnade.parallel.comm import CommGroup

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12
"""Smallest amax a scale is computed from (torchao's EPS): an all-zero tensor gets a finite
scale."""


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """fp8_max / max(amax, EPS) in float64, as float32; ``pow2`` rounds it down to a power
    of two (torchao's round_scales_to_power_of_2)."""
    scale = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturated float8 of ``t * scale`` (``scale`` float32, broadcast against ``t``)."""
    top = torch.finfo(dtype).max
    return (t.to(torch.float32) * scale).clamp(-top, top).to(dtype)


def dequantize(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``bits`` in ``dtype`` divided by the float32 ``scale`` (torch's type promotion, as
    torchao's to_original_precision: float64 stays float64)."""
    return bits.to(dtype) / scale


def kernel_for(device: torch.device, dtype: torch.dtype) -> str:
    """'scaled_mm' where the device has float8 GEMMs (CUDA sm89+) and the model's dtype is a
    training dtype (bf16, fp16, fp32), else 'emulate' (CPU, older GPUs, float64)."""
    if dtype != torch.float64 and fp8_gemm_supported(device):
        return "scaled_mm"
    return "emulate"


@dataclass(frozen=True)
class Float8GEMM:
    """How one parallel linear's GEMMs run in float8."""

    recipe: str
    """'tensorwise' or 'rowwise' (``training.fp8``)."""
    group: CommGroup | None = None
    """The group that splits a dim of the GEMM (tp, expert tp); None or one rank: no split."""
    split: str = "none"
    """Which dim ``group`` splits: 'n' (output features, column-parallel), 'k' (input
    features, row-parallel) or 'none'."""

    @property
    def rowwise(self) -> bool:
        """Whether scales are per row (else per tensor)."""
        return self.recipe == "rowwise"


# Regions, per operand: which GEMM dims an amax spans. x [m, k], w [n, k], dy [m, n].
_SPANS: dict[tuple[str, str], str] = {
    ("x", "tensor"): "mk", ("x", "row"): "k", ("x", "column"): "m",
    ("w", "tensor"): "nk", ("w", "row"): "k", ("w", "column"): "n",
    ("dy", "tensor"): "mn", ("dy", "row"): "n", ("dy", "column"): "m",
}


def rows_amax(t: torch.Tensor, sizes: list[int], region: str) -> torch.Tensor:
    """amax of a rows operand t [m, c] in groups of ``sizes`` rows: 'tensor' one per group
    [G], 'row' one per row [m], 'column' one per group and column [G, c] (empty groups 0)."""
    a = t.detach().abs()
    if region == "row":
        return a.amax(dim=1) if t.shape[0] else a.new_zeros(0)  # [m]
    if len(sizes) == 1 and t.shape[0]:  # one group (a dense linear): no split
        return a.amax().view(1) if region == "tensor" else a.amax(dim=0, keepdim=True)
    parts = a.split(sizes)
    if region == "tensor":
        return torch.stack([p.amax() if p.numel() else a.new_zeros(()) for p in parts])  # [G]
    return torch.stack([p.amax(dim=0) if p.shape[0] else a.new_zeros(t.shape[1])
                        for p in parts])  # [G, c]


def weight_amax(w: torch.Tensor, region: str) -> torch.Tensor:
    """amax of the weights w [G, n, k]: 'tensor' [G], 'row' (over k) [G, n], 'column' (over
    n) [G, k]."""
    a = w.detach().abs()
    if region == "tensor":
        return a.flatten(1).amax(dim=1)  # [G]
    return a.amax(dim=2 if region == "row" else 1)


def _reduce(cfg: Float8GEMM, amaxes: list[tuple[torch.Tensor, str, str]]) -> list[torch.Tensor]:
    """Each (amax, operand, region) all-reduced (MAX) over ``cfg.group`` when its region spans
    the split dim: the ones that need it in one flat collective, the others as they are."""
    out = [a for a, _, _ in amaxes]
    group = cfg.group
    if group is None or group.size == 1 or cfg.split == "none":
        return out
    pick = [i for i, (_, op, region) in enumerate(amaxes) if cfg.split in _SPANS[op, region]]
    if not pick:
        return out
    flat = torch.cat([out[i].reshape(-1) for i in pick])  # exact: each amax is a value
    group.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, name="fp8_amax")
    for i, piece in zip(pick, flat.split([out[i].numel() for i in pick]), strict=True):
        out[i] = piece.view_as(out[i]).to(out[i].dtype)
    return out


def _rows_scale(scale: torch.Tensor, sizes: list[int], region: str, m: int) -> torch.Tensor:
    """A rows operand's scales as [m, 1]: 'tensor' [G] repeated over each group's rows
    ([1, 1], broadcast, for one group), 'row' [m] as it is."""
    if region == "row":
        return scale.unsqueeze(1)  # [m, 1]
    if len(sizes) == 1:
        return scale.view(1, 1)
    counts = torch.tensor(sizes, device=scale.device)
    return scale.unsqueeze(1).repeat_interleave(counts, dim=0, output_size=m)  # [m, 1]


def _mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
        out_dtype: torch.dtype, rowwise: bool) -> torch.Tensor:
    """deq(a) deq(b)^T for float8 a [M, K] with scales sa [M, 1] and b [N, K] with scales
    sb [N, 1] (under tensorwise every entry of sa, and of sb, is the same) -> [M, N] in
    ``out_dtype``: ``torch._scaled_mm`` where :func:`kernel_for` chose it, every dim is a
    positive multiple of 16 and, rowwise, the output is bf16 (cuBLAS / CUTLASS rowwise
    kernels write only bf16), else the emulation."""
    m, k, n = a.shape[0], a.shape[1], b.shape[0]
    if (m and k and n and m % 16 == k % 16 == n % 16 == 0
            and (not rowwise or out_dtype == torch.bfloat16)
            and kernel_for(a.device, out_dtype) == "scaled_mm"):
        inv_a, inv_b = sa.reciprocal(), sb.reciprocal()
        if rowwise:
            inv_a, inv_b = inv_a.contiguous(), inv_b.t().contiguous()  # [M, 1], [1, N]
        else:
            inv_a, inv_b = inv_a.reshape(-1)[0], inv_b.reshape(-1)[0]  # scalars
        # a row-major [M, K], b^T column-major [K, N]; the tensor cores accumulate in fp32
        return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=inv_a,
                                scale_b=inv_b, out_dtype=out_dtype)
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    return (dequantize(a, sa, compute) @ dequantize(b, sb, compute).t()).to(out_dtype)


def _grouped(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
             sizes: list[int], rowwise: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Per group e: rows e of float8 a [m, c] (scales sa [m, 1]) times b[e]^T (float8 b
    [G, o, c], scales sb [G, o, 1] or [G, 1, 1]) -> [m, o] in ``out_dtype``."""
    o = b.shape[1]
    if len(sizes) == 1:  # one group (a dense linear); sa may be [1, 1], broadcast
        return _mm(a, sa, b[0], sb[0].expand(o, 1), out_dtype, rowwise)
    parts = [_mm(a_e, s_e, b[e], sb[e].expand(o, 1), out_dtype, rowwise)
             for e, (a_e, s_e) in enumerate(zip(a.split(sizes), sa.split(sizes), strict=True))]
    return torch.cat(parts) if parts else torch.zeros((0, o), dtype=out_dtype, device=a.device)


class ScaledMM(torch.autograd.Function):
    """y = x w_e^T per group of rows, every GEMM (forward, dgrad, wgrad) on float8 operands
    with dynamic scales (see the module docstring).

    x [m, k] (rows sorted by group, ``sizes`` [G] rows each), w [G, n, k] -> y [m, n] in x's
    dtype; dx [m, k] in x's dtype, dw [G, n, k] in w's dtype. Saves x and w as they are (no
    float8 copy outlives the GEMM) and, under tensorwise, their scales (the gradient GEMMs
    reuse them, so backward needs no second amax of x or w).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, sizes: list[int],
                cfg: Float8GEMM) -> torch.Tensor:
        region = "row" if cfg.rowwise else "tensor"
        ax, aw = _reduce(cfg, [(rows_amax(x, sizes, region), "x", region),
                               (weight_amax(w, region), "w", region)])
        sx = amax_to_scale(ax, E4M3, cfg.rowwise)  # [G] or [m]
        sw = amax_to_scale(aw, E4M3, cfg.rowwise)  # [G] or [G, n]
        sx_rows = _rows_scale(sx, sizes, region, x.shape[0])  # [m, 1]
        sw_b = sw.view(-1, 1, 1) if region == "tensor" else sw.unsqueeze(2)  # [G, 1|n, 1]
        qx, qw = quantize(x, sx_rows, E4M3), quantize(w, sw_b, E4M3)  # [m, k], [G, n, k]
        ctx.save_for_backward(x, w, sx, sw)
        ctx.sizes, ctx.cfg = sizes, cfg
        return _grouped(qx, sx_rows, qw, sw_b, sizes, cfg.rowwise, x.dtype)  # [m, n]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, sx, sw = ctx.saved_tensors
        sizes, cfg = ctx.sizes, ctx.cfg
        dy = dy.contiguous()  # [m, n]
        if cfg.rowwise:
            ady, awc = _reduce(cfg, [(rows_amax(dy, sizes, "row"), "dy", "row"),
                                     (weight_amax(w, "column"), "w", "column")])
            sdy = amax_to_scale(ady, E4M3, True).unsqueeze(1)  # [m, 1]
            sdy_g = sdy
            sw_t = amax_to_scale(awc, E4M3, True).unsqueeze(2)  # [G, k, 1]
            qdy = quantize(dy, sdy, E4M3)
        else:
            (ady,) = _reduce(cfg, [(rows_amax(dy, sizes, "tensor"), "dy", "tensor")])
            sdy_g = amax_to_scale(ady, E5M2, False)  # [G]
            sdy = _rows_scale(sdy_g, sizes, "tensor", dy.shape[0])  # [m, 1]
            sw_t = sw.view(-1, 1, 1)  # [G, 1, 1]
            qdy = quantize(dy, sdy, E5M2)  # both gradient GEMMs read this one
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qw_t = quantize(w.transpose(1, 2), sw_t, E4M3)  # [G, k, n]
            dx = _grouped(qdy, sdy, qw_t, sw_t, sizes, cfg.rowwise, x.dtype)  # [m, k]
        if ctx.needs_input_grad[1]:
            dw = _wgrad(x, dy, qdy, sx, sdy_g, sizes, cfg.rowwise, w.dtype)  # [G, n, k]
        return dx, dw, None, None


def _wgrad(x: torch.Tensor, dy: torch.Tensor, qdy: torch.Tensor, sx: torch.Tensor,
           sdy: torch.Tensor, sizes: list[int], rowwise: bool,
           out_dtype: torch.dtype) -> torch.Tensor:
    """dW_e = deq(q(dy_e))^T deq(q(x_e)) per group -> [G, n, k]. Tensorwise: dy's e5m2
    (``qdy``, its group scales ``sdy`` [G]) and x's forward scales ``sx`` [G]; rowwise: dy and x
    re-quantised in e4m3 per column over the group's rows (this rank's full rows: no
    reduction)."""
    out = []
    for e, (x_e, dy_e) in enumerate(zip(x.split(sizes), dy.split(sizes), strict=True)):
        if rowwise:
            s_dy = amax_to_scale(rows_amax(dy_e, [dy_e.shape[0]], "column")[0], E4M3, True)
            s_x = amax_to_scale(rows_amax(x_e, [x_e.shape[0]], "column")[0], E4M3, True)
            a, b = quantize(dy_e, s_dy, E4M3), quantize(x_e, s_x, E4M3)  # [m_e, n], [m_e, k]
            s_a, s_b = s_dy.unsqueeze(1), s_x.unsqueeze(1)  # [n, 1], [k, 1]
        else:
            a = qdy.narrow(0, sum(sizes[:e]), sizes[e])  # [m_e, n]
            b = quantize(x_e, sx[e], E4M3)  # [m_e, k]
            s_a = sdy[e].view(1, 1).expand(dy.shape[1], 1)  # [n, 1]
            s_b = sx[e].view(1, 1).expand(x.shape[1], 1)  # [k, 1]
        out.append(_mm(a.t(), s_a, b.t(), s_b, out_dtype, rowwise))  # [n, k]
    return torch.stack(out)


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  cfg: Float8GEMM) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its GEMMs in float8: x [..., k], weight [n, k],
    bias [n] or None -> [..., n] (the bias added after the GEMM, in the model's dtype)."""
    rows = x.reshape(-1, x.shape[-1])  # [m, k]
    y = ScaledMM.apply(rows, weight.unsqueeze(0), [rows.shape[0]], cfg)  # [m, n]
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           cfg: Float8GEMM | None) -> torch.Tensor:
    """The one linear of the parallel layers: :func:`float8_linear` when ``cfg`` is set
    (``training.fp8`` on), else ``F.linear``."""
    if cfg is None:
        return F.linear(x, weight, bias)
    return float8_linear(x, weight, bias, cfg)


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes: list[int],
                      cfg: Float8GEMM) -> torch.Tensor:
    """The routed experts' grouped GEMM in float8: x [t_e, in] sorted by local expert
    (``sizes`` rows each), w [E_local, out, in] -> [t_e, out]."""
    if sum(sizes) != x.shape[0] or len(sizes) != w.shape[0]:
        raise ValueError(f"float8_grouped_mm: sizes {sizes} do not match {x.shape[0]} rows "
                         f"and {w.shape[0]} experts")
    out: torch.Tensor = ScaledMM.apply(x, w, sizes, cfg)
    return out
