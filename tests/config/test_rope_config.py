"""The validator's RoPE rules (config/rules_rope.py) and model.head_dim's: each bad setting is
refused by name with its fix, and a setting the chosen scaling does not read is refused, not
ignored."""

from __future__ import annotations

from typing import Any

import pytest

from colonnade.config.sections import Config, ModelConfig
from colonnade.config.validate import problems

BAD: dict[str, tuple[dict[str, Any], list[str]]] = {
    "unknown_scaling": ({"rope_scaling": "ntk"},
                        ["model.rope_scaling='ntk' must be one of none, linear, dynamic"]),
    "factor_without_scaling": ({"rope_factor": 8.0},
                               ["model.rope_factor=8.0 is read only with model.rope_scaling in",
                                "not 'none'"]),
    "yarn_setting_under_llama3": ({"rope_scaling": "llama3", "rope_factor": 8.0,
                                   "rope_beta_fast": 16.0},
                                  ["model.rope_beta_fast=16.0", "['yarn']", "not 'llama3'"]),
    "llama3_low_not_below_high": ({"rope_scaling": "llama3", "rope_factor": 8.0,
                                   "rope_low_freq_factor": 4.0},
                                  ["llama3 scaling needs 0 < low < high"]),
    "zero_factor": ({"rope_scaling": "linear", "rope_factor": 0.0},
                    ["model.rope_factor=0.0 must be > 0"]),
    "dynamic_past_original": ({"rope_scaling": "dynamic", "rope_factor": 2.0,
                               "rope_original_max_seq_len": 128},
                              ["model.max_seq_len=256 exceeds model.rope_original_max_seq_len=128",
                               "dynamic NTK recomputes the frequencies"]),
    "scaling_on_learned_positions": ({"arch": "gpt2", "rope_scaling": "linear",
                                      "rope_factor": 2.0},
                                     ["needs rotary positions", "model.arch='gpt2'"]),
    "head_dim_zero": ({"head_dim": 0}, ["model.head_dim=0 must be >= 1"]),
    "odd_head_dim": ({"head_dim": 7}, ["head dim 7 (model.head_dim) must be even for RoPE"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rope_settings_are_refused_by_name(case: str) -> None:
    changes, expected = BAD[case]
    found = problems(Config(model=ModelConfig(**changes)))
    assert len(found) == 1, found
    for words in expected:
        assert words in found[0], found[0]


def test_published_rope_settings_are_valid() -> None:
    """Llama 3.1, gpt-oss's yarn, DeepSeek-V3's yarn, dynamic inside its context, and a
    head_dim that does not divide the width."""
    for changes in ({"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_max_seq_len":
                     64, "rope_high_freq_factor": 4.0, "rope_theta": 500000.0},
                    {"rope_scaling": "yarn", "rope_factor": 32.0, "rope_truncate": False,
                     "rope_original_max_seq_len": 64, "rope_beta_fast": 32.0},
                    {"rope_scaling": "yarn", "rope_factor": 40.0, "rope_mscale": 1.0,
                     "rope_mscale_all_dim": 1.0, "rope_original_max_seq_len": 64},
                    {"rope_scaling": "dynamic", "rope_factor": 2.0,
                     "rope_original_max_seq_len": 256},
                    {"hidden_size": 48, "num_heads": 5, "head_dim": 16}):
        assert problems(Config(model=ModelConfig(**changes))) == [], changes
