"""RoPE settings in Hugging Face config.json form, for every rotary family's :class:`HFFormat`.

transformers >= 5 writes ``rope_parameters`` ({"rope_type", "rope_theta", + the type's keys});
older files hold ``rope_scaling`` (the same keys, ``type`` in place of ``rope_type`` in the
oldest ones) beside a top-level ``rope_theta``, and transformers reads ``rope_scaling`` first.
:func:`read_rope` accepts all of these spellings and maps them onto the model.rope_* fields;
a type, a key or a value it does not understand is refused with the file's words, never
dropped. :func:`write_rope` writes the ``rope_parameters`` form (and ``rope_theta`` beside it).

HF key -> model field: ``rope_type`` 'default' -> rope_scaling 'none' (others by name),
``factor`` -> rope_factor, ``original_max_position_embeddings`` -> rope_original_max_seq_len
(dynamic's is ``max_position_embeddings``), ``low_freq_factor`` / ``high_freq_factor``,
``beta_fast`` / ``beta_slow``, ``truncate``, ``attention_factor``, ``mscale`` /
``mscale_all_dim`` -> the rope_* field of that name.
"""

from __future__ import annotations

from typing import Any

from colonnade.config.sections import ModelConfig
from colonnade.models.rope import original_context

HF_KEYS: dict[str, dict[str, str]] = {
    "default": {},
    "linear": {"factor": "rope_factor"},
    "dynamic": {"factor": "rope_factor"},
    "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_seq_len"},
    "yarn": {"factor": "rope_factor", "original_max_position_embeddings":
             "rope_original_max_seq_len", "beta_fast": "rope_beta_fast",
             "beta_slow": "rope_beta_slow", "truncate": "rope_truncate",
             "attention_factor": "rope_attention_factor", "mscale": "rope_mscale",
             "mscale_all_dim": "rope_mscale_all_dim"},
}
"""HF rope_type -> {its config key: the model field it sets}."""
ROPE_FIELDS: tuple[str, ...] = ("rope_theta", "rope_scaling", *sorted(
    {field for keys in HF_KEYS.values() for field in keys.values()}))
"""The model fields :func:`read_rope` sets (a format that builds its ModelConfig from another
format's reader copies these)."""
REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
"""Keys transformers needs for each type (original_max_position_embeddings defaults to
max_position_embeddings, yarn's factor to max_position_embeddings / original)."""
YARN_UNSET = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}
"""What transformers takes for a yarn key given as null (``beta_fast or 32``, ...)."""


def _scaling(kind: str) -> str:
    """model.rope_scaling of an HF rope_type."""
    return "none" if kind == "default" else kind


def _rope_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config.json in one dict, ``rope_type`` and ``rope_theta`` set
    (``rope_scaling`` first, as transformers reads it)."""
    given = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(given, dict) or any(isinstance(v, dict) for v in given.values()):
        raise ValueError(f"config.json: rope settings {given!r} are not one flat dict "
                         "(per-layer-type RoPE is not supported)")
    out = dict(given)
    kind = out.pop("rope_type", out.pop("type", "default"))
    out.pop("type", None)
    out["rope_type"] = kind
    out.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key in hf and key not in out:
            out[key] = hf[key]
    return out


def read_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The model.rope_* fields (and rope_theta) of an HF config.json, as ModelConfig keyword
    arguments; raises ValueError naming what it cannot run (an unknown type or key, partial
    rotation, a missing required key)."""
    rope = _rope_dict(hf)
    kind = rope["rope_type"]
    if kind not in HF_KEYS:
        known = ", ".join(repr(k) for k in HF_KEYS)
        raise ValueError(f"config.json: rope_type={kind!r} is not supported (one of {known})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor={rope['partial_rotary_factor']}"
                         " (RoPE on part of each head) is not supported")
    rope.pop("partial_rotary_factor", None)
    keys = HF_KEYS[kind]
    unknown = sorted(set(rope) - set(keys) - {"rope_type", "rope_theta"})
    if unknown:
        raise ValueError(f"config.json: rope settings {unknown} are not read for rope_type="
                         f"{kind!r} (it reads {sorted(keys)}); refusing rather than ignoring "
                         "them")
    missing = [k for k in REQUIRED.get(kind, ()) if rope.get(k) is None]
    if missing:
        raise ValueError(f"config.json: rope_type={kind!r} needs {missing}")
    out: dict[str, Any] = {"rope_theta": float(rope["rope_theta"]),
                           "rope_scaling": _scaling(kind)}
    positions = hf["max_position_embeddings"]
    if kind in ("llama3", "yarn"):
        rope.setdefault("original_max_position_embeddings", positions)
    if kind == "dynamic":  # HF's original context is max_position_embeddings itself
        out["rope_original_max_seq_len"] = positions
    if kind == "yarn":
        if rope.get("factor") is None:
            rope["factor"] = positions / rope["original_max_position_embeddings"]
        rope.update({k: v for k, v in YARN_UNSET.items() if rope.get(k) is None})
    for key, field in keys.items():
        value = rope.get(key)
        if value is None:
            continue
        if field == "rope_original_max_seq_len":
            out[field] = int(value)
        elif field == "rope_truncate":
            out[field] = bool(value)
        else:  # config.json may spell 8.0 as 8
            out[field] = float(value)
    return out


def write_rope(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's rope entries of ``cfg``: ``rope_parameters`` (the type, base and each
    key of the type; an unset attention factor and zero mscales left out), ``rope_theta``
    beside it, and for 'dynamic' max_position_embeddings = the original context (HF's)."""
    kind = "default" if cfg.rope_scaling == "none" else cfg.rope_scaling
    if kind not in HF_KEYS:
        raise ValueError(f"model.rope_scaling={cfg.rope_scaling!r} has no HF form")
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": cfg.rope_theta}
    for key, field in HF_KEYS[kind].items():
        value = original_context(cfg) if key == "original_max_position_embeddings" \
            else getattr(cfg, field)
        if value is not None and not (key.startswith("mscale") and value == 0.0):
            params[key] = value
    out: dict[str, Any] = {"rope_parameters": params, "rope_theta": cfg.rope_theta}
    if kind == "dynamic":
        out["max_position_embeddings"] = original_context(cfg)
    return out
