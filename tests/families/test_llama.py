"""Llama (``LlamaForCausalLM``) through the family harness: transformers' logits, loss,
gradients, greedy text and a bit-for-bit round trip; the single-process run's losses and
parameters under tp2 + sp, pp2 (1F1B), dp2 + ZeRO-3 and cp2 (ring)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

from colonnade.config.sections import ModelConfig
from tests.families.harness import Layout, check_layouts, hf_check, randomize, tiny


def test_llama_against_transformers(tmp_path: Path) -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500.0, tie_word_embeddings=False)
    ours = hf_check(randomize(transformers.LlamaForCausalLM(cfg)), tmp_path, vocab=67)
    assert (ours.arch, ours.kv_heads, ours.ffn_size, ours.rope_theta) == ("llama", 2, 48, 500.0)


def test_llama_layouts(run_ranks: Callable[..., list[Any]]) -> None:
    model = tiny(ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4,
                             num_kv_heads=2, ffn_hidden_size=48))
    check_layouts(run_ranks, model, [Layout(tp=2, sp=True), Layout(pp=2),
                                     Layout(dp=2, zero=3), Layout(cp=2)])
