"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``: q/k/v biases, tied embeddings, ``use_sliding_window``
with ``max_window_layers``) through the family harness, and the published Qwen2.5 and Mistral
presets' parameter counts against transformers' on the meta device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from colonnade.config.sections import ModelConfig
from tests.families.harness import Layout, check_layouts, hf_check, randomize, tiny


def test_qwen2_against_transformers(tmp_path: Path) -> None:
    """Layers 1 and 2 of 3 windowed (max_window_layers=1), window 4 on 12 tokens."""
    cfg = transformers.Qwen2Config(
        vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500.0, tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
        max_window_layers=1)
    ours = hf_check(randomize(transformers.Qwen2ForCausalLM(cfg)), tmp_path, vocab=67)
    assert (ours.arch, ours.qkv_bias, ours.bias, ours.tie_embeddings) == ("qwen2", True, False,
                                                                         True)
    assert (ours.sliding_window, ours.sliding_window_layers) == (4, (1, 2))


def test_qwen2_window_layouts(run_ranks: Callable[..., list[Any]]) -> None:
    """q/k/v biases, tied embeddings, a window of 3 on layers 1-3 of 4 (shorter than a cp
    rank's zigzag chunk of 4 rows: ring blocks skipped, diagonal blocks cut)."""
    model = tiny(ModelConfig(arch="qwen2", num_layers=4, hidden_size=32, num_heads=4,
                             num_kv_heads=2, ffn_hidden_size=48, qkv_bias=True,
                             tie_embeddings=True, sliding_window=3,
                             sliding_window_layers=(1, 2, 3)))
    check_layouts(run_ranks, model, [
        Layout(tp=2, sp=True), Layout(pp=2), Layout(pp=2, vp=2, schedule="interleaved_1f1b"),
        Layout(dp=2, zero=1), Layout(dp=2, zero=3), Layout(cp=2),
        Layout(cp=2, cp_attention="all_to_all")])


PRESETS = {"mistral-7b-v0.1": 7_241_732_096, "qwen2.5-7b": 7_615_616_512,
           "qwen2.5-0.5b": 494_032_768}
"""Published shapes: transformers' parameter count of each (meta device)."""


def test_mistral_qwen2_presets_count_as_transformers(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """Each preset's count equals transformers' on the meta device, the model built from the
    preset's own HF export config (Mistral's window 4096 on every layer, Qwen2.5's tied 0.5B
    and full attention); `train --dry-run` prints it."""
    from colonnade.analysis.cli import configs_dir
    from colonnade.checkpoint.hf import hf_config_from_model
    from colonnade.cli import main
    from colonnade.config.load import load_config
    from colonnade.models.counts import param_count

    for name, count in PRESETS.items():
        model = load_config(configs_dir() / f"{name}.toml").model
        assert param_count(model)["total"] == count, name
        hf = hf_config_from_model(model)
        cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items()
                                                   if k != "architectures"})
        with torch.device("meta"):
            theirs = transformers.AutoModelForCausalLM.from_config(cfg)
        assert (type(theirs).__name__, theirs.num_parameters()) == (hf["architectures"][0],
                                                                    count), name
        assert cfg.sliding_window == (4096 if name.startswith("mistral") else None), name
    assert main(["train", "--config", str(configs_dir() / "qwen2.5-0.5b.toml"),
                 "--dry-run"]) == 0
    assert "494,032,768 parameters" in capsys.readouterr().out


def test_qwen2_moe_window_against_transformers(tmp_path: Path) -> None:
    """Qwen2-MoE's window rule: the even layers below max_window_layers (layer 0 of 2 here)."""
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=67, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rope_theta=500.0, use_sliding_window=True, sliding_window=4,
        max_window_layers=2, tie_word_embeddings=False)
    ours = hf_check(randomize(transformers.Qwen2MoeForCausalLM(cfg)), tmp_path, vocab=67)
    assert (ours.arch, ours.num_experts, ours.qkv_bias) == ("qwen2", 4, True)
    assert (ours.sliding_window, ours.sliding_window_layers) == (4, (0,))
