"""config.json's RoPE settings (checkpoint/hf_rope.py): every spelling transformers reads is
read (rope_parameters, rope_scaling with rope_type or the older type, a top-level
rope_theta), what Colonnade does not run is refused by name, and write -> read keeps every
setting."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from colonnade.checkpoint.hf import hf_config_from_model, model_config_from_hf
from colonnade.config.sections import ModelConfig

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
"""A Llama config.json without rope settings."""


def _read(**rope: Any) -> ModelConfig:
    return model_config_from_hf({**BASE, **rope})


def test_old_spellings_are_read() -> None:
    old = _read(rope_scaling={"type": "linear", "factor": 4.0})  # before rope_type
    assert (old.rope_scaling, old.rope_factor, old.rope_theta) == ("linear", 4.0, 10000.0)
    llama31 = _read(rope_theta=500000.0, rope_scaling={  # Llama-3.1-8B's config.json
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    assert (llama31.rope_scaling, llama31.rope_theta, llama31.rope_factor,
            llama31.rope_original_max_seq_len, llama31.rope_low_freq_factor,
            llama31.rope_high_freq_factor) == ("llama3", 500000.0, 8.0, 8192, 1.0, 4.0)
    plain = _read(rope_scaling=None, rope_theta=1e6)
    assert (plain.rope_scaling, plain.rope_theta, plain.rope_factor) == ("none", 1e6, 1.0)
    dynamic = _read(rope_scaling={"type": "dynamic", "factor": 2})
    assert (dynamic.rope_scaling, dynamic.rope_factor, dynamic.rope_original_max_seq_len) \
        == ("dynamic", 2.0, 256)
    yarn = _read(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                  "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False})  # gpt-oss
    assert (yarn.rope_scaling, yarn.rope_theta, yarn.rope_factor, yarn.rope_truncate,
            yarn.rope_original_max_seq_len) == ("yarn", 150000.0, 32.0, False, 4096)


@pytest.mark.parametrize(("rope", "words"), [
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type='longrope' is not"),
    ({"rope_scaling": {"rope_type": "su"}}, "rope_type='su' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
     "rope settings ['low_freq_factor'] are not read for rope_type='linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "scale": 2.0}},
     "rope settings ['scale'] are not read for rope_type='yarn'"),
    ({"rope_scaling": {"type": "linear"}}, "rope_type='linear' needs ['factor']"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "not one flat dict"),
], ids=["longrope", "unknown_type", "foreign_key", "unknown_key", "missing_factor",
        "partial_rotary", "per_layer_type"])
def test_rope_settings_it_does_not_run_are_refused(rope: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=r"config\.json") as err:
        _read(**rope)
    assert words in str(err.value)


@pytest.mark.parametrize("changes", [
    {"rope_scaling": "none", "rope_theta": 500.0},
    {"rope_scaling": "linear", "rope_factor": 4.0},
    {"rope_scaling": "dynamic", "rope_factor": 2.0, "rope_original_max_seq_len": 256},
    {"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_max_seq_len": 64,
     "rope_low_freq_factor": 2.0, "rope_high_freq_factor": 8.0},
    {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_seq_len": 64,
     "rope_beta_fast": 16.0, "rope_beta_slow": 2.0, "rope_truncate": False,
     "rope_attention_factor": 1.5},
    {"rope_scaling": "yarn", "rope_factor": 40.0, "rope_original_max_seq_len": 64,
     "rope_mscale": 1.0, "rope_mscale_all_dim": 0.8},
], ids=["none", "linear", "dynamic", "llama3", "yarn", "yarn_mscale"])
def test_written_rope_settings_read_back(changes: dict[str, Any]) -> None:
    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, vocab_size=64,
                      max_seq_len=256, **changes)
    back = model_config_from_hf(hf_config_from_model(cfg))
    names = [f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("rope_")]
    assert {n: getattr(back, n) for n in names} == {n: getattr(cfg, n) for n in names}
