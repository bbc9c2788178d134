"""Loss scaling for fp16: the dynamic scaler, and the constant scale of every other precision.

fp16 has 5 exponent bits: gradients below 2^-24 flush to zero. Backward therefore runs on
``loss * S`` and the optimizer multiplies the fp32 main gradients by 1/S. The dynamic rule:
  * an inf/NaN in any rank's gradients: skip the step, S <- max(S * backoff, min_scale),
    restart the count of clean steps;
  * ``window`` clean steps in a row: S <- S * growth.
With backoff 1/2 and growth 2, S stays a power of two when it starts as one, so scaling and
unscaling are exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DynamicLossScaler:
    """Dynamic loss scale; ``update(found_inf)`` after every step decides the next scale."""

    scale: float = 2.0**16
    window: int = 1000
    min_scale: float = 1.0
    backoff: float = 0.5
    growth: float = 2.0
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.min_scale <= 0:
            raise ValueError(f"optim.initial_loss_scale={self.scale} and optim.min_loss_scale="
                             f"{self.min_scale} must be > 0")
        if self.window < 1:
            raise ValueError(f"optim.loss_scale_window={self.window} must be >= 1")
        if not 0 < self.backoff < 1 < self.growth:
            raise ValueError("the loss scaler needs 0 < backoff < 1 < growth")

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after ``window`` clean steps."""
        if found_inf:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.scale *= self.growth
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: the scale and the count of clean steps."""
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


@dataclass
class ConstantLossScaler:
    """Scale 1 forever (fp32, fp64, bf16): nothing to grow or back off."""

    scale: float = 1.0

    def update(self, found_inf: bool) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict[str, Any]:
        """The (constant) scale."""
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale = float(state["scale"])


LossScaler = DynamicLossScaler | ConstantLossScaler
