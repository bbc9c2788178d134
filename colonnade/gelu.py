"""GPT-2's tanh-approximated GELU, with a faster forward on CPU.

    gelu_tanh(z) = z/2 (1 + tanh(c (z + a z^3)))       c = sqrt(2/pi), a = 0.044715
                 = z sigmoid(2c z (1 + a z^2))          since 1 + tanh(t) = 2 sigmoid(2t)

aten's CPU kernel evaluates the tanh form, and its vectorized tanh dominates: 3.6 ms for the
[2048, 1024] fp32 MLP activation of issue 19's GPT-2 workload on one thread of the 2-core
machine (0.88 ms at [512, 1024], one pipeline micro-batch), four calls in a
~560 ms step. The sigmoid form in three in-place passes over one new tensor (``addcmul``:
2c (1 + a z^2); ``mul_`` by z then ``sigmoid_``; ``mul_`` by z) takes 2.3 ms (0.46 ms): about
1% of a GPT-2 step on CPU, forward and recomputed forward alike.

:class:`GeluTanh` saves only its input, as ``F.gelu`` does, and its backward is aten's
``gelu_backward`` of that input: the same saved memory and the same gradient bits as
``F.gelu(z, approximate="tanh")``. Its forward agrees with aten's to rounding (to 1e-6
in fp32 and 1e-14 in fp64 as rtol and atol; `tests/models/test_gelu.py`).

:func:`gelu_tanh` uses it for float32 / float64 CPU tensors outside ``torch.compile`` and
``F.gelu`` everywhere else: on a GPU aten's kernel reads and writes the tensor once where the
passes would three times (it is memory-bound there), bf16 / fp16 passes would round between
steps, and inductor fuses ``F.gelu`` into one loop itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
"""c in gelu_tanh(z) = z/2 (1 + tanh(c (z + a z^3)))."""
CUBIC = 0.044715
"""a in gelu_tanh(z) = z/2 (1 + tanh(c (z + a z^3)))."""
TWO_C = {dtype: torch.tensor(2.0 * SQRT_2_OVER_PI, dtype=dtype)
         for dtype in (torch.float32, torch.float64)}
"""2c as a 0-d CPU tensor per dtype whose CPU forward takes the sigmoid form (each pass rounds
to the dtype); constants, read only."""


def _forward(z: torch.Tensor) -> torch.Tensor:
    """z sigmoid(2c z (1 + a z^2)) in three passes over one new tensor, z [..., f] -> [..., f]."""
    y = torch.addcmul(TWO_C[z.dtype], z, z, value=2.0 * SQRT_2_OVER_PI * CUBIC)  # 2c(1 + a z^2)
    y.mul_(z).sigmoid_()  # sigmoid(2c (z + a z^3)) = (1 + tanh(c (z + a z^3))) / 2
    return y.mul_(z)


class GeluTanh(torch.autograd.Function):
    """gelu_tanh(z) by its sigmoid form; backward d/dz by aten's ``gelu_backward`` of z."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z)
        return _forward(z)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        (z,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(dy, z, approximate="tanh")


def gelu_tanh(z: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (``gelu_new``) of z, elementwise [...] -> [...]: :class:`GeluTanh` for
    float32 / float64 CPU tensors in eager mode, ``F.gelu(z, approximate="tanh")`` otherwise."""
    if z.device.type == "cpu" and z.dtype in TWO_C and not torch.compiler.is_compiling():
        if z.requires_grad and torch.is_grad_enabled():
            return GeluTanh.apply(z)
        return _forward(z)
    return F.gelu(z, approximate="tanh")
