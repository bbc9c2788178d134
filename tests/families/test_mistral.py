"""Mistral (``MistralForCausalLM``) and Mixtral with a sliding window through the family
harness: a window of 5 keys on a 12-token sequence and 32 greedy tokens (the KV cache crosses
the window's edge), transformers' logits, loss, gradients and text, a bit-for-bit round trip;
the single-process run's losses and parameters under every layout with a window shorter than
a cp rank's chunk (ring blocks outside the window skipped), also with document resets."""

from __future__ import annotations

from pathlib import Path

import transformers

from tests.families.harness import hf_check, randomize


def test_mistral_window_against_transformers(tmp_path: Path) -> None:
    cfg = transformers.MistralConfig(
        vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500.0, sliding_window=5, tie_word_embeddings=False)
    ours = hf_check(randomize(transformers.MistralForCausalLM(cfg)), tmp_path, vocab=67)
    assert (ours.arch, ours.sliding_window, ours.sliding_window_layers) == ("mistral", 5, None)


def test_mixtral_window_against_transformers(tmp_path: Path) -> None:
    cfg = transformers.MixtralConfig(
        vocab_size=67, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500.0, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        tie_word_embeddings=False)
    ours = hf_check(randomize(transformers.MixtralForCausalLM(cfg)), tmp_path, vocab=67)
    assert (ours.arch, ours.num_experts, ours.sliding_window) == ("mistral", 4, 5)
