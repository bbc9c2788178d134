"""Mistral (``MistralForCausalLM``) and Mixtral with a sliding window through the family
harness: a window of 5 keys on a 12-token sequence and 32 greedy tokens (the KV cache crosses
the window's edge), transformers' logits, loss, gradients and text, a bit-for-bit round trip;
the single-process run's losses and parameters under every layout with a window shorter than
a cp rank's chunk (ring blocks outside the window skipped), also with document resets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

from colonnade.config.sections import ModelConfig
from tests.families.harness import Layout, check_layouts, hf_check, randomize, tiny


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


def test_mistral_window_layouts_with_document_reset(run_ranks: Callable[..., list[Any]]) -> None:
    """A window of 3 on every layer with packed documents (vocabulary 7, EOD id 0: ~2
    documents a sequence) under tp2 + sp, pp2 and both cp2 attentions: the window's band and
    the document mask together, in the ring's blocks and all-to-all's full mask."""
    model = dataclasses.replace(
        tiny(ModelConfig(arch="mistral", num_layers=2, hidden_size=32, num_heads=4,
                         num_kv_heads=2, ffn_hidden_size=48, sliding_window=3)), vocab_size=7)
    check_layouts(run_ranks, model, [Layout(tp=2, sp=True), Layout(pp=2), Layout(cp=2),
                                     Layout(cp=2, cp_attention="all_to_all")], eod=0)
