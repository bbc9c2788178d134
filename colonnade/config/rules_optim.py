"""The validator's optimizer rules (one of :data:`colonnade.config.validate.RULES`, reported
as 'optim'): the optim section's learning rates, betas, eps, clipping and warmup, Muon's
momentum and Newton-Schulz steps (:mod:`colonnade.optim.muon`), the precision-aware state and
master dtypes (:mod:`colonnade.optim.chunked`) and the warmup-stable-decay schedule's length.
"""

from __future__ import annotations

from colonnade.config.sections import Config


def optim_rules(c: Config, _: int | None) -> list[str]:
    """AdamW's and Muon's hyper-parameters in range, the state / master dtypes against the
    precision, the LR schedule's warmup and decay inside training.steps."""
    o, out = c.optim, []
    if o.lr <= 0:
        out.append(f"optim.lr={o.lr} must be > 0.")
    if not 0 <= o.min_lr <= o.lr:
        out.append(f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}].")
    for name, b in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= b < 1:
            out.append(f"{name}={b} must be in [0, 1).")
    if o.clip_grad < 0:
        out.append(f"optim.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping).")
    if o.warmup_steps < 0:
        out.append(f"optim.warmup_steps={o.warmup_steps} must be >= 0.")
    if o.eps <= 0:
        out.append(f"optim.eps={o.eps} must be > 0.")
    if not 0 <= o.muon_momentum < 1:
        out.append(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1), e.g. 0.95.")
    if o.muon_ns_steps < 1:
        out.append(f"optim.muon_ns_steps={o.muon_ns_steps} must be >= 1 (Newton-Schulz "
                   "iterations), e.g. 5.")
    out.extend(_optim_dtypes(o.state_dtype, o.master_dtype, c.training.precision))
    if not 0 < o.decay_fraction <= 1:
        out.append(f"optim.decay_fraction={o.decay_fraction} must be in (0, 1] (the share of "
                   "training.steps spent in the final decay of decay='wsd'), e.g. 0.2.")
    elif (o.decay == "wsd"
          and o.warmup_steps + o.wsd_decay_steps(c.training.steps) > c.training.steps):
        out.append(f"optim.decay='wsd': optim.warmup_steps={o.warmup_steps} + decay steps "
                   f"{o.wsd_decay_steps(c.training.steps)} (optim.decay_fraction="
                   f"{o.decay_fraction} x training.steps={c.training.steps}) exceed "
                   "training.steps; shorten the warmup or lower decay_fraction.")
    return out


def _optim_dtypes(state: str, master: str, precision: str) -> list[str]:
    """optim.state_dtype / master_dtype against training.precision: bf16 masters only for a
    bf16 model (an fp32 / fp64 model is its own master), bf16 states not for fp64 runs."""
    out = []
    if master == "bf16" and precision != "bf16":
        out.append(f"optim.master_dtype='bf16' needs training.precision='bf16' (got "
                   f"'{precision}': its parameters are their own {precision} masters); set "
                   "optim.master_dtype='fp32' or training.precision='bf16'.")
    if state == "bf16" and precision == "fp64":
        out.append("optim.state_dtype='bf16' with training.precision='fp64' would round the "
                   "exactness runs' states; set optim.state_dtype='fp32' (fp64 runs keep fp64 "
                   "states) or another precision.")
    return out
