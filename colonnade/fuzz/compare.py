"""How the fuzzer (and every parity test, through ``tests/parity.py``) measures a mismatch.

Relative error, the measure of every parity assertion (``b`` the reference)::

    rel_err(a, b, floor) = ||a - b||_2 / max(||b||_2, floor)      (||a - b|| when both are 0)

computed in float64 (IEEE division of two doubles: the same number however it is spelled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOL = 1e-10
"""Largest relative error accepted in float64 parity (any larger mismatch is a bug)."""

GRAD_FLOOR_SHARE = 1e-3
"""float64's :attr:`Tolerance.grad_share`: a gradient tensor's error is measured against at
least this share of the norm of all the step's gradients. A gradient that is 0 in exact
arithmetic (the key bias's: adding b to every key adds q.b to a whole row of scores, which
softmax ignores) is round-off, ~1e-17, whose relative error between two summation orders is
O(1). A real bug is an O(1) error of a tensor
of any size above this share."""
PARAM_FLOOR_SHARE = 1.0
"""Parameters are measured against the norm of all parameters: AdamW turns a round-off
gradient g into an update lr g / (|g| + eps) (~1e-11 for g ~ 1e-17), which differs between
summation orders by its own size; a parameter that is wrong for a real reason (a shard not
updated, a wrong gradient) is off by ~lr per element, 1e-3 of the total or more."""


@dataclass(frozen=True)
class Tolerance:
    """Largest relative errors a case may show against its single-process reference."""

    loss: float
    """Of each step's loss."""
    grads: float
    """Of each gathered gradient tensor, each step (and of the global gradient norm)."""
    params: float
    """Of each parameter after the last step."""
    floor: float
    """Absolute denominator floor of :func:`rel_err` for gradients and parameters."""
    grad_share: float = 1e-3
    """A gradient tensor's error is measured against at least this share of the norm of all
    the step's gradients (:data:`GRAD_FLOOR_SHARE`)."""


TOLERANCES: dict[str, Tolerance] = {
    "fp64": Tolerance(loss=TOL, grads=TOL, params=TOL, floor=0.0, grad_share=GRAD_FLOOR_SHARE),
    "bf16": Tolerance(loss=2e-2, grads=1e-1, params=5e-2, floor=1e-2, grad_share=1.0),
}
"""Per training.precision. fp64: exact up to summation order. bf16 (bf16 weights and
activations, fp32 gradients and masters, reductions in another order than the reference's):
the bounds of the repository's bf16 parity tests (loss 2e-2, parameters 5e-2 over a 1e-2
floor); gradients 1e-1 against the norm of all the step's gradients: a token whose top-k
scores tie to bf16 round-off goes to another expert in one run than in the other (a
discontinuity, not a bug), moving that expert's gradient by O(1) of itself (0.25 relative
measured on an expert of a 6-expert top-1 layer) but little of the whole."""


HF_TOLERANCE = Tolerance(loss=TOL, grads=TOL, params=TOL, floor=0.0,
                         grad_share=GRAD_FLOOR_SHARE)
"""The single-process run against its transformers twin: float64 with transformers' float32
islands removed (:func:`colonnade.fuzz.hf_twin.float64_twin`), so exact up to summation
order like the parallel runs (measured ~1e-15 after one step, ~1e-13 after two)."""

def floor_of(tensors: dict[str, torch.Tensor], share: float, floor: float) -> float:
    """max(``floor``, ``share`` x the norm of all ``tensors`` together)."""
    total = sum(float(t.double().pow(2).sum()) for t in tensors.values()) ** 0.5
    return max(floor, share * total)


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """||a - b|| / max(||b||, floor) in float64; ||a - b|| when the denominator is 0."""
    ref = max(float(b.double().norm()), floor)
    diff = float((a.double() - b.double()).norm())
    return diff / ref if ref > 0 else diff


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
          floor: float = 0.0) -> tuple[float, str]:
    """The largest :func:`rel_err` over same-named tensors and its name; names missing on
    either side give ``inf`` under the first such name."""
    missing = sorted(set(got) ^ set(want))
    if missing:
        return float("inf"), f"{missing[0]} (names differ: {len(missing)})"
    errors = {k: rel_err(got[k], ref, floor) for k, ref in want.items()}
    name = max(errors, key=errors.__getitem__, default="")
    return errors.get(name, 0.0), name
