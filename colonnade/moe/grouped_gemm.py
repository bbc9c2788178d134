"""The one grouped matrix multiply of the routed experts.

Tokens arrive sorted by local expert: rows ``[o_e, o_e + n_e)`` of ``x`` [t_e, in] belong to
expert e (``n_e = counts[e]``, ``o_e = n_0 + .. + n_{e-1}``), and expert e's weight is
``w[e]`` [out, in] (the nn.Linear convention). The result is, per expert's row range ::

    y[o_e : o_e + n_e] = x[o_e : o_e + n_e] @ w[e]^T          y: [t_e, out]

Two implementations, chosen here and nowhere else:

* ``torch._grouped_mm`` (one kernel for all experts) where this build, device and dtype have
  it: probed once per (device type, dtype) with a tiny forward and backward
  (:func:`grouped_mm_supported`); its strides must be multiples of 16 bytes, so ``in`` and
  ``out`` must be too (checked per call);
* otherwise a loop over the local experts' contiguous row ranges (one matmul each, an expert
  with no token contributes an empty product and a zero gradient). float64 and the CPU paths
  of older builds take it.

Both compute the same products of the same rows; gradients flow to ``x`` and ``w`` through
autograd in either case. Under ``training.fp8`` the product is
:func:`~colonnade.tensor_parallel.float8.float8_grouped_mm` instead (float8 operands scaled
per expert, or per row and channel).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from colonnade.tensor_parallel.float8 import Float8GEMM, float8_grouped_mm


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward makes the incoming gradient contiguous (``_grouped_mm``'s
    backward rejects the stride-0 gradients that, e.g., ``sum()`` produces)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,  # type: ignore[override]
                 grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _kernel(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [t_e, in], w [E_local, out, in], counts [E_local] -> [t_e, out] with one
    ``torch._grouped_mm`` (offsets = cumulative counts, int32, on x's device)."""
    offs = torch.cumsum(counts.to(device=x.device), 0).to(torch.int32)  # [E_local] end rows
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)  # [t_e, out]
    return _ContiguousGrad.apply(y)


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward, correctly, on this device type
    and dtype (tried once on a tiny problem with an empty group, then remembered; safe to
    call first inside a checkpointed forward or a backward)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    # identity saved-tensor hooks: a first call inside a checkpointed forward must not add
    # the probe's tensors to the checkpoint's (recomputation would not save them again)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
            torch.enable_grad():
        return _probe(device_type, dtype)


def _probe(device_type: str, dtype: torch.dtype) -> bool:
    """The tiny forward and backward of :func:`grouped_mm_supported`."""
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 16, generator=gen).to(device_type, dtype).requires_grad_(True)
        w = torch.randn(3, 16, 16, generator=gen).to(device_type, dtype).requires_grad_(True)
        counts = torch.tensor([2, 0, 3])
        y = _kernel(x, w, counts)
        y.sum().backward()
        ref = torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T])
        ok = torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
        return bool(ok and x.grad is not None and w.grad is not None
                    and torch.all(w.grad[1] == 0).item())
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def host_counts(counts: torch.Tensor | Sequence[int]) -> list[int]:
    """``counts`` as a host list of ints (a tensor is copied to the host: a device sync)."""
    return [int(n) for n in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]


def use_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` takes ``torch._grouped_mm`` for these operands: supported on
    the device and dtype, and rows of x and of w 16-byte multiples."""
    row_bytes = (w.shape[-1] * x.element_size(), w.shape[-2] * x.element_size())
    return (x.dtype == w.dtype and all(n % 16 == 0 for n in row_bytes)
            and grouped_mm_supported(x.device.type, x.dtype))


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor,
                    counts: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The fallback: x [t_e, in], w [E_local, out, in] -> [t_e, out], one matmul per local
    expert on its contiguous row range."""
    sizes = host_counts(counts)
    if sum(sizes) != x.shape[0] or len(sizes) != w.shape[0]:
        raise ValueError(f"grouped_mm: counts {sizes} (sum {sum(sizes)}) do not match "
                         f"{x.shape[0]} rows and {w.shape[0]} experts")
    parts = [rows @ w[e].T for e, rows in enumerate(x.split(sizes))]  # [n_e, out] each
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor | Sequence[int],
               fp8: Float8GEMM | None = None) -> torch.Tensor:
    """x [t_e, in] (rows sorted by local expert), w [E_local, out, in], counts [E_local]
    (a tensor or host ints, summing to t_e) -> y [t_e, out], ``y_e = x_e w_e^T`` per expert's
    row range; in float8 with ``fp8``, else ``torch._grouped_mm`` where :func:`use_kernel`
    allows, else the loop."""
    if fp8 is not None:
        return float8_grouped_mm(x, w, host_counts(counts), fp8)
    if use_kernel(x, w):
        tensor = counts if isinstance(counts, torch.Tensor) else torch.tensor(list(counts))
        return _kernel(x, w, tensor)
    return grouped_mm_loop(x, w, counts)
