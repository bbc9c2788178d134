"""Llama 3.x (``LlamaForCausalLM``) through the family harness: a head width other than
hidden / heads (``model.head_dim``), against transformers and under parallel layouts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

from colonnade.config.sections import ModelConfig
from colonnade.models.counts import param_count
from tests.families.harness import Layout, check_layouts, hf_check, randomize, tiny


def test_head_dim_against_transformers(tmp_path: Path) -> None:
    """head_dim 12 with hidden 32 and 4 heads: q [48, 32], k / v [24, 32], o [32, 48]."""
    cfg = transformers.LlamaConfig(
        vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
        rope_theta=500.0, tie_word_embeddings=False)
    model = randomize(transformers.LlamaForCausalLM(cfg))
    ours = hf_check(model, tmp_path, vocab=67)
    assert (ours.head_dim, ours.head_size, ours.q_size) == (12, 12, 48)
    assert param_count(ours)["total"] == sum(p.numel() for p in model.parameters()) == 22_880


def test_head_dim_layouts(run_ranks: Callable[..., list[Any]]) -> None:
    model = tiny(ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4,
                             num_kv_heads=2, head_dim=12, ffn_hidden_size=48))
    check_layouts(run_ranks, model, [Layout(tp=2, sp=True)])
