"""A user's fine-tune of each family through the CLI (issue 36; :mod:`tests.families.finetune`):
an HF folder with the family's chat template, SFT chats prepared with its tokenizer,
``train --init-from`` under a layout of several axes whose loss falls, ``convert --to-hf``
whose export transformers loads with zero warnings, the family's settings and our logits.

* Llama 3 (llama3 rope at a tiny original context, Llama 3's chat tokens) in tp2 x pp2;
* Qwen2.5 (q/k/v biases, tied embeddings, ``use_sliding_window`` with ``max_window_layers``
  1 of 2, window 8 on 32-token samples) in tp2 x pp2 (the tied head on the other stage);
* Qwen3-MoE (q/k norms, head_dim 16 != hidden / heads, a window on every layer, a dense first
  layer) in cp2 (ring, windowed) x ep2;
* gpt-oss (sinks, alternating windows, biased router and experts) in cp2 (all-to-all) x ep2;
* DeepSeek-V3 (MLA, group-limited router, shared expert, a dense first layer) in pp2 x dp2 x
  ep2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers

from tests.families.finetune import (
    assert_same_logits,
    conversations,
    export_and_load,
    fine_tune,
    hf_folder,
)
from tests.families.test_deepseek_v3 import HF_TINY
from tests.families.test_gpt_oss import hf_gpt_oss
from tests.workflow.cli import Cli

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' "
          "+ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""Qwen's ChatML template, without the system prompt and thinking blocks."""
LLAMA3 = ("{{ '<|begin_of_text|>' }}{% for message in messages %}"
          "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
          "+ message['content'] + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
"""Llama 3's chat template (its header and end-of-turn tokens), without the date preamble."""
HARMONY = ("{% for message in messages %}{{ '<|start|>' + message['role'] + '<|message|>' "
           "+ message['content'] + '<|end|>' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start|>assistant<|message|>' }}{% endif %}")
"""gpt-oss's harmony chat format, reduced to role and content (no channels, no preamble)."""
ROPE = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
"""Llama 3.1's rope scaling at a tiny original context (the model's is 64)."""
TP2_PP2 = ["--nproc", "4", "--parallel.tp=2", "--parallel.pp=2"]


def _prompt_ends(tok: Any, suffix: str) -> None:
    """The exported tokenizer renders a user turn with the family's generation prompt."""
    prompt = tok.apply_chat_template(conversations()[0][:1], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith(suffix), prompt


def test_llama3_fine_tune_in_tp2_pp2(cli: Cli, tmp_path: Path) -> None:
    hf, vocab = hf_folder(tmp_path / "hf", lambda v: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=v, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 rope_parameters=ROPE, tie_word_embeddings=False)),
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        LLAMA3, "<|eot_id|>")
    saved = fine_tune(cli, tmp_path, hf, TP2_PP2, steps=8)
    assert 'rope_scaling = "llama3"' in saved and "rope_original_max_seq_len = 16" in saved
    model, tok, exported = export_and_load(cli, tmp_path)
    assert exported["rope_parameters"] == ROPE
    _prompt_ends(tok, "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert_same_logits(tmp_path, model, vocab)


def test_qwen2_fine_tune_in_tp2_pp2(cli: Cli, tmp_path: Path) -> None:
    hf, vocab = hf_folder(tmp_path / "hf", lambda v: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(vocab_size=v, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 use_sliding_window=True, sliding_window=8,
                                 max_window_layers=1, tie_word_embeddings=True)),
        ["<|im_start|>", "<|im_end|>"], CHATML, "<|im_end|>")
    saved = fine_tune(cli, tmp_path, hf, TP2_PP2, steps=8)
    assert 'arch = "qwen2"' in saved and "sliding_window = 8" in saved, saved
    model, _, exported = export_and_load(cli, tmp_path)
    assert (exported["use_sliding_window"], exported["sliding_window"],
            exported["max_window_layers"], exported["tie_word_embeddings"]) == (True, 8, 1, True)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert_same_logits(tmp_path, model, vocab, seq=24)


def test_qwen3_moe_fine_tune_in_cp2_ep2(cli: Cli, tmp_path: Path) -> None:
    hf, vocab = hf_folder(tmp_path / "hf", lambda v: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=v, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, use_sliding_window=True, sliding_window=8,
            tie_word_embeddings=False)),
        ["<|im_start|>", "<|im_end|>"], CHATML, "<|im_end|>")
    saved = fine_tune(cli, tmp_path, hf, ["--nproc", "2", "--parallel.cp=2", "--parallel.ep=2"],
                      steps=10)
    assert 'arch = "qwen3"' in saved and "sliding_window = 8" in saved and "head_dim = 16" in saved
    model, tok, exported = export_and_load(cli, tmp_path)
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (exported["use_sliding_window"], exported["sliding_window"]) == (True, 8)
    _prompt_ends(tok, "<|im_start|>assistant\n")
    assert_same_logits(tmp_path, model, vocab)


def test_gpt_oss_fine_tune_in_cp2_ep2(cli: Cli, tmp_path: Path) -> None:
    hf, vocab = hf_folder(tmp_path / "hf", lambda v: hf_gpt_oss(vocab_size=v),
                          ["<|start|>", "<|message|>", "<|end|>"], HARMONY, "<|end|>")
    saved = fine_tune(cli, tmp_path, hf, ["--nproc", "2", "--parallel.cp=2",
                                     "--parallel.cp_attention=all_to_all", "--parallel.ep=2"],
                      steps=10)
    assert 'arch = "gpt_oss"' in saved, saved
    model, _, exported = export_and_load(cli, tmp_path)
    assert exported["architectures"] == ["GptOssForCausalLM"]
    assert_same_logits(tmp_path, model, vocab, seq=12)


def test_deepseek_v3_fine_tune_in_pp2_dp2_ep2(cli: Cli, tmp_path: Path) -> None:
    hf, vocab = hf_folder(tmp_path / "hf", lambda v: transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**(HF_TINY | {"vocab_size": v, "num_hidden_layers": 2,
                                                    "n_routed_experts": 4}))),
        ["<|im_start|>", "<|im_end|>"], CHATML, "<|im_end|>")
    saved = fine_tune(cli, tmp_path, hf, ["--nproc", "4", "--parallel.pp=2", "--parallel.ep=2"],
                      steps=8)
    assert 'arch = "deepseek_v3"' in saved and "moe_n_group = 2" in saved, saved
    model, _, exported = export_and_load(cli, tmp_path)
    assert exported["architectures"] == ["DeepseekV3ForCausalLM"]
    assert_same_logits(tmp_path, model, vocab)
