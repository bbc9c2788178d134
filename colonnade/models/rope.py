"""Rotary position tables: RoPE's inverse frequencies, their context scaling and the cos / sin
tables every attention layer reads (:func:`rope_cos_sin`, the one path, which
:func:`colonnade.models.blocks.rope_tables` calls with the model's rotated width).

Notation: d the rotated width (the head dim), i < d/2 a frequency index, theta the base
(model.rope_theta), s the scaling factor (model.rope_factor), L the pre-trained context
(model.rope_original_max_seq_len, default model.max_seq_len). The unscaled inverse frequencies
are w_i = theta^(-2i/d); a position p rotates the pair (x_i, x_{i+d/2}) by the angle p w_i.

model.rope_scaling (HF's ``rope_type``) picks how w is stretched for a context beyond L:

* ``none``: w.
* ``linear`` (position interpolation): w / s.
* ``llama3``: with the wavelength lambda_i = 2 pi / w_i, w_i when lambda_i < L / high
  (rope_high_freq_factor), w_i / s when lambda_i > L / low (rope_low_freq_factor), else
  (1 - t) w_i / s + t w_i with t = (L / lambda_i - low) / (high - low).
* ``yarn`` (Peng et al. 2023, "YaRN"): dim j of d rotates L / lambda_j times over the original
  context; r(b) = d ln(L / (2 pi b)) / (2 ln theta) is the (fractional) dim that rotates b
  times. Between lo = max(r(beta_fast), 0) and hi = min(r(beta_slow), d - 1) (floor and ceil
  when rope_truncate) a linear ramp g_i = clamp((i - lo) / (hi - lo), 0, 1) blends
  w_i = w_i / s * g_i + w_i * (1 - g_i): high frequencies kept, low ones interpolated. cos and
  sin are multiplied by the attention factor m (model.rope_attention_factor, default
  :func:`yarn_attention_factor`), which scales every attention logit by m^2.
* ``dynamic`` (HF's dynamic NTK): w inside the original context. HF recomputes
  theta' = theta (s p_max / L - (s - 1))^(d / (d - 2)) only once a batch's longest position
  p_max passes L; the validator keeps max_seq_len <= L, so every position Colonnade reaches is
  in the unscaled range and its tables equal HF's exactly.

Everything is computed once per table in float64 and cast at the end (transformers computes
the frequencies in float32; the family harness checks them against its own rope init at that
precision).
"""

from __future__ import annotations

import math

import torch

from colonnade.config.sections import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(scale) + 1 (1 for scale <= 1), the paper's
    eq. 21 (DeepSeek-V3's softmax scale multiplies by yarn_mscale(s, mscale_all_dim)^2)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """m, the factor on yarn's cos and sin: model.rope_attention_factor, else
    yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim) when both are set (DeepSeek),
    else yarn_mscale(s)."""
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    s = cfg.rope_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(s, cfg.rope_mscale) / yarn_mscale(s, cfg.rope_mscale_all_dim)
    return yarn_mscale(s)


def original_context(cfg: ModelConfig) -> int:
    """L, the pre-trained context of the scaling (rope_original_max_seq_len or max_seq_len)."""
    if cfg.rope_original_max_seq_len is not None:
        return cfg.rope_original_max_seq_len
    return cfg.max_seq_len


def _llama3(cfg: ModelConfig, w: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's piecewise scaling of w [d/2] (module docstring)."""
    s, length = cfg.rope_factor, original_context(cfg)
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / w  # [d/2]
    t = (length / wavelen - low) / (high - low)  # [d/2]
    smooth = (1 - t) * w / s + t * w
    out = torch.where(wavelen > length / low, w / s, smooth)
    return torch.where(wavelen < length / high, w, out)


def _yarn(cfg: ModelConfig, w: torch.Tensor, d: int) -> torch.Tensor:
    """YaRN's ramp between w / s and w over the dims [d/2] (module docstring)."""
    s, length, theta = cfg.rope_factor, original_context(cfg), cfg.rope_theta

    def dim_of(rotations: float) -> float:  # r(b): the dim that turns b times over L
        return d * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(cfg.rope_beta_fast), dim_of(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)  # [d/2]
    return w / s * ramp + w * (1 - ramp)


def inv_freq(cfg: ModelConfig, d: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [d/2] in float64, attention factor) of ``cfg``'s RoPE over
    ``d`` rotated dims under model.rope_scaling."""
    w = cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    kind = cfg.rope_scaling
    if kind in ("none", "dynamic"):  # dynamic: unscaled within the original context
        return w, 1.0
    if kind == "linear":
        return w / cfg.rope_factor, 1.0
    if kind == "llama3":
        return _llama3(cfg, w), 1.0
    if kind == "yarn":
        return _yarn(cfg, w, d), yarn_attention_factor(cfg)
    raise ValueError(f"model.rope_scaling={kind!r} has no frequencies here")


def rope_cos_sin(cfg: ModelConfig, d: int, device: torch.device | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, d/2] of positions 0 .. max_seq_len - 1 over ``d`` rotated dims,
    each multiplied by the attention factor (yarn's m, else 1) as HF multiplies its cos and
    sin: angles p w_i in float64, then cast to ``dtype``."""
    w, factor = inv_freq(cfg, d)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), w)  # [S, d/2]
    cos, sin = angles.cos() * factor, angles.sin() * factor
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
