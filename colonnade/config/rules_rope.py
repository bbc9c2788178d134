"""The validator's RoPE scaling rules (one of :data:`colonnade.config.validate.RULES`): the
model.rope_scaling choice, the ranges of its settings, and that a setting of another scaling
kind is refused rather than ignored (nothing is dropped silently)."""

from __future__ import annotations

import dataclasses

from colonnade.config.choices import ROPE_SCALINGS
from colonnade.config.sections import Config, ModelConfig

APPLIES: dict[str, tuple[str, ...]] = {
    "none": (),
    "linear": ("rope_factor",),
    "dynamic": ("rope_factor", "rope_original_max_seq_len"),
    "llama3": ("rope_factor", "rope_original_max_seq_len", "rope_low_freq_factor",
               "rope_high_freq_factor"),
    "yarn": ("rope_factor", "rope_original_max_seq_len", "rope_beta_fast", "rope_beta_slow",
             "rope_truncate", "rope_attention_factor", "rope_mscale", "rope_mscale_all_dim"),
}
"""model.rope_scaling -> the model.rope_* settings it reads (keys equal ROPE_SCALINGS)."""
assert tuple(APPLIES) == ROPE_SCALINGS, "every rope scaling names its settings"

_SETTINGS = sorted({name for names in APPLIES.values() for name in names})
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in _SETTINGS}


def _unused(m: ModelConfig) -> list[str]:
    """Settings changed from their default that model.rope_scaling does not read."""
    out = []
    for name in _SETTINGS:
        value = getattr(m, name)
        if name not in APPLIES[m.rope_scaling] and value != _DEFAULTS[name]:
            users = [k for k, names in APPLIES.items() if name in names]
            out.append(f"model.{name}={value} is read only with model.rope_scaling in "
                       f"{users}, not '{m.rope_scaling}'; set the scaling or drop the setting.")
    return out


def _ranges(m: ModelConfig) -> list[str]:
    """Ranges of the settings the chosen scaling reads."""
    out = []
    positive = [("rope_factor", m.rope_factor), ("rope_beta_fast", m.rope_beta_fast),
                ("rope_beta_slow", m.rope_beta_slow)]
    if m.rope_attention_factor is not None:
        positive.append(("rope_attention_factor", m.rope_attention_factor))
    if m.rope_original_max_seq_len is not None:
        positive.append(("rope_original_max_seq_len", m.rope_original_max_seq_len))
    out += [f"model.{name}={value} must be > 0." for name, value in positive if value <= 0]
    out += [f"model.{name}={value} must be >= 0." for name, value in (
        ("rope_mscale", m.rope_mscale), ("rope_mscale_all_dim", m.rope_mscale_all_dim))
        if value < 0]
    if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        out.append(f"model.rope_low_freq_factor={m.rope_low_freq_factor} and "
                   f"model.rope_high_freq_factor={m.rope_high_freq_factor}: llama3 scaling "
                   "needs 0 < low < high (Llama 3.1: 1 and 4).")
    original = m.rope_original_max_seq_len
    if m.rope_scaling == "dynamic" and original is not None and m.max_seq_len > original:
        out.append(f"model.max_seq_len={m.max_seq_len} exceeds model.rope_original_max_seq_len="
                   f"{original} under model.rope_scaling='dynamic': past the original context "
                   "HF's dynamic NTK recomputes the frequencies from the longest position seen "
                   "so far (a state carried between calls, with cached keys rotated by older "
                   "frequencies), which a position table computed once cannot reproduce. Keep "
                   "max_seq_len <= the original context, or use 'yarn' or 'linear' scaling "
                   "for a longer one.")
    return out


def rope_rules(c: Config, _: int | None) -> list[str]:
    """model.rope_scaling and its settings (see the module docstring)."""
    m = c.model
    if m.rope_scaling not in ROPE_SCALINGS:
        return [f"model.rope_scaling='{m.rope_scaling}' must be one of "
                f"{', '.join(ROPE_SCALINGS)}."]
    out = _unused(m) + _ranges(m)
    if m.rope_scaling != "none" and m.traits is not None and not m.traits.rope:
        out.append(f"model.rope_scaling='{m.rope_scaling}' needs rotary positions; "
                   f"model.arch='{m.arch}' has a learned position table: set "
                   "model.rope_scaling='none'.")
    return out
