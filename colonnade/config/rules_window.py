"""The validator's sliding-window rules (one of :data:`colonnade.config.validate.RULES`):
model.sliding_window and model.sliding_window_layers.

Every attention path applies the window (fused and dropout attention, ring and all-to-all
context parallelism, KV-cache generation), so no parallel layout is refused for it; what a
Hugging Face class cannot express is refused on export by its format
(:mod:`colonnade.checkpoint.hf_archs`).
"""

from __future__ import annotations

from colonnade.config.sections import Config


def window_rules(c: Config, _: int | None) -> list[str]:
    """model.sliding_window >= 1; model.sliding_window_layers ascending global layer indices
    in [0, num_layers), only with a window."""
    m, out = c.model, []
    if m.sliding_window is not None and m.sliding_window < 1:
        out.append(f"model.sliding_window={m.sliding_window} must be >= 1 (the keys each "
                   "query attends, itself included); unset it for full attention.")
    layers = m.sliding_window_layers
    if layers is None:
        return out
    if m.sliding_window is None:
        out.append(f"model.sliding_window_layers={list(layers)} needs model.sliding_window "
                   "(the window those layers use); set it, or unset sliding_window_layers.")
    bad = [i for i in layers if not 0 <= i < m.num_layers]
    if bad:
        out.append(f"model.sliding_window_layers names layers {bad} outside 0 .. "
                   f"model.num_layers - 1 = {m.num_layers - 1}; list existing global layer "
                   "indices.")
    if list(layers) != sorted(set(layers)):
        out.append(f"model.sliding_window_layers={list(layers)} must be strictly ascending "
                   f"(each layer once), e.g. {sorted(set(layers))}.")
    return out
