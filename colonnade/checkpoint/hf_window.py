"""Sliding-window attention in Hugging Face config.json files: reading and writing
model.sliding_window and model.sliding_window_layers for each class that has it.

transformers' convention is Colonnade's (:mod:`colonnade.context_parallel.masks`): with
``sliding_window`` W the query at i attends the keys i - W < j <= i. Which layers use it:

* ``MistralForCausalLM``, ``MixtralForCausalLM`` (:data:`EVERY_LAYER`): every layer when
  ``sliding_window`` is set (null: none). The classes ignore a ``layer_types`` list, so one
  that leaves some layer in full attention is refused rather than dropped.
* ``Qwen2ForCausalLM`` (:data:`FROM_K`): only with ``use_sliding_window``; the layers of
  ``layer_types`` marked "sliding_attention", by default those with index >=
  ``max_window_layers``.
* ``Qwen2MoeForCausalLM`` (:data:`EVEN_BELOW_K`): only with ``use_sliding_window``; the layers
  of ``layer_types`` marked "sliding_attention", by default the even ones below
  ``max_window_layers``.
* ``Qwen3MoeForCausalLM`` (:data:`EVERY_LAYER_IF_USED`): every layer, only with
  ``use_sliding_window`` (the class has no ``layer_types`` nor ``max_window_layers``: both are
  ignored, so a ``layer_types`` leaving some layer in full attention is refused).
* :data:`ALTERNATE` (gpt-oss's rule): when ``sliding_window`` is set, the layers of
  ``layer_types`` marked "sliding_attention", by default the even ones (layer 0 windowed).

Written configs always carry ``layer_types`` for the Qwen classes, so any set of windowed
layers Colonnade trains is expressed exactly; ``max_window_layers`` is written to agree with
it where the default rule can (else the first windowed layer).
"""

from __future__ import annotations

from typing import Any

from colonnade.config.sections import ModelConfig

EVERY_LAYER, FROM_K, EVEN_BELOW_K, ALTERNATE = "every_layer", "from_k", "even_below_k", "alternate"
"""Which layers a class's ``sliding_window`` applies to by default (module doc)."""
EVERY_LAYER_IF_USED = "every_layer_if_used"
"""Every layer, switched by ``use_sliding_window`` (Qwen3-MoE; module doc)."""

SLIDING, FULL = "sliding_attention", "full_attention"
"""The ``layer_types`` entries of the two attention kinds."""


def _default_layers(rule: str, layers: int, k: int) -> list[int]:
    """The windowed layers of ``rule`` with ``max_window_layers`` = k."""
    if rule == FROM_K:
        return list(range(k, layers))
    if rule == EVEN_BELOW_K:
        return [i for i in range(layers) if i % 2 == 0 and i < k]
    if rule == ALTERNATE:
        return list(range(0, layers, 2))
    return list(range(layers))


def read_window(hf: dict[str, Any], rule: str) -> dict[str, Any]:
    """model.sliding_window and model.sliding_window_layers of a config.json (keyword
    arguments of ModelConfig; None for full attention). Refuses a ``layer_types`` with other
    kinds, a window below 1, and Mistral-style ``layer_types`` the class would ignore."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is not None and (len(types) != n or set(types) - {SLIDING, FULL}):
        raise ValueError(f"config.json: layer_types={types} must list {n} entries of "
                         f"{SLIDING!r} / {FULL!r}; other attention kinds are not supported")
    on = hf.get("sliding_window") is not None if rule in (EVERY_LAYER, ALTERNATE) else bool(
        hf.get("use_sliding_window"))
    every = rule in (EVERY_LAYER, EVERY_LAYER_IF_USED)
    if every and types is not None and FULL in types and on:
        raise ValueError("config.json: layer_types with full_attention layers; this class "
                         "(Mistral / Mixtral / Qwen3-MoE) windows every layer and ignores "
                         "layer_types")
    if not on:
        return {"sliding_window": None, "sliding_window_layers": None}
    window = hf.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json: sliding_window={window!r} must be an integer >= 1 "
                         "(the keys each query attends)")
    if every:
        return {"sliding_window": window, "sliding_window_layers": None}
    default = _default_layers(rule, n, hf.get("max_window_layers", n))
    layers = [i for i, t in enumerate(types) if t == SLIDING] if types is not None else default
    if not layers:
        return {"sliding_window": None, "sliding_window_layers": None}
    return {"sliding_window": window,
            "sliding_window_layers": None if layers == list(range(n)) else tuple(layers)}


def windowed_layers(cfg: ModelConfig) -> list[int]:
    """The global indices of ``cfg``'s windowed layers (none without a window)."""
    return [i for i in range(cfg.num_layers) if cfg.window(i) is not None]


def write_window(cfg: ModelConfig, rule: str, hf_class: str) -> dict[str, Any]:
    """The config.json fields of ``cfg``'s window for a class of ``rule``; refuses windowed
    layers the class cannot express."""
    layers = windowed_layers(cfg)
    if rule in (EVERY_LAYER, EVERY_LAYER_IF_USED):
        if layers and len(layers) != cfg.num_layers:
            raise ValueError(f"cannot express as {hf_class}: model.sliding_window_layers="
                             f"{list(cfg.sliding_window_layers or ())} (the class windows "
                             "every layer or none); unset sliding_window_layers")
        if rule == EVERY_LAYER_IF_USED:
            return {"use_sliding_window": bool(layers), "sliding_window": cfg.sliding_window}
        return {"sliding_window": cfg.sliding_window}
    n = cfg.num_layers
    types = [SLIDING if i in layers else FULL for i in range(n)]
    if rule == ALTERNATE:
        return {"sliding_window": cfg.sliding_window, "layer_types": types}
    k = next((k for k in range(n + 1) if _default_layers(rule, n, k) == layers),
             layers[0] if layers else n)
    return {"use_sliding_window": bool(layers), "sliding_window": cfg.sliding_window,
            "max_window_layers": k, "layer_types": types}
