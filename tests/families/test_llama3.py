"""Llama 3.x (``LlamaForCausalLM``) through the family harness: RoPE scaling (llama3, yarn,
linear, dynamic) against transformers' own rope init and its model, a head width other than
hidden / heads (``model.head_dim``), and a llama3-rope model under every parallel layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from colonnade.checkpoint.hf import model_config_from_hf
from colonnade.config.sections import ModelConfig
from colonnade.models.counts import param_count
from colonnade.models.rope import inv_freq, rope_cos_sin
from tests.families.harness import Layout, check_layouts, hf_check, randomize, tiny
from tests.parity import rel_err

ROPES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
    "yarn_gpt_oss": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    "yarn_deepseek": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                      "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 8.0},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.9,
                              "original_max_position_embeddings": 64},
}
"""HF rope settings of the tests (max_position_embeddings 128: twice the original context)."""


def _llama(rope: dict[str, Any], **changes: Any) -> transformers.LlamaConfig:
    """A tiny LlamaConfig (h 32, 4 heads of 8, theta 500: rope wavelengths 6.3, 30, 140, 660
    against an original context of 64) with ``rope`` as its rope_parameters."""
    fields = {"vocab_size": 67, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": False,
              "rope_parameters": {"rope_theta": 500.0, **rope}} | changes
    return transformers.LlamaConfig(**fields)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_init_matches_transformers(name: str) -> None:
    """Inverse frequencies and attention factor from config.json (our reader, our maths)
    against transformers' ROPE_INIT_FUNCTIONS, and the cos / sin tables against its rotary
    module's (float32: transformers computes them so)."""
    hf = _llama(ROPES[name])
    cfg = model_config_from_hf({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    theirs, factor = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    ours, our_factor = inv_freq(cfg, cfg.head_size)
    assert rel_err(ours, theirs.double()) < 1e-6, (ours, theirs)
    assert abs(our_factor - factor) < 1e-12
    default = 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    moved = (ours - default).abs() > 1e-3 * default  # [d/2]: which frequencies are scaled
    assert bool(moved.any()) != (name == "dynamic")
    positions = torch.arange(hf.max_position_embeddings)[None]  # [1, S]
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
    our_cos, our_sin = rope_cos_sin(cfg, cfg.head_size, None, torch.float64)  # [S, d/2]
    assert (our_cos - cos[0, :, :4].double()).abs().max() < 2e-5
    assert (our_sin - sin[0, :, :4].double()).abs().max() < 2e-5
    assert torch.equal(cos[0, :, :4], cos[0, :, 4:])


@pytest.mark.parametrize("name", ["llama3", "yarn", "linear", "dynamic"])
def test_scaled_rope_against_transformers(tmp_path: Path, name: str) -> None:
    model = randomize(transformers.LlamaForCausalLM(_llama(ROPES[name])))
    ours = hf_check(model, tmp_path, vocab=67)
    assert (ours.rope_scaling, ours.rope_factor) == (name, ROPES[name]["factor"])


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


def test_llama3_rope_layouts(run_ranks: Callable[..., list[Any]]) -> None:
    """llama3 rope scaling (original context 8 of the 16 trained) and head_dim 12 != 32 / 4:
    the single-process run's losses and parameters under every layout."""
    model = tiny(ModelConfig(arch="llama", num_layers=4, hidden_size=32, num_heads=4,
                             num_kv_heads=2, head_dim=12, ffn_hidden_size=48,
                             rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=8,
                             rope_theta=500.0))
    check_layouts(run_ranks, model, [
        Layout(tp=2, sp=True), Layout(pp=2), Layout(pp=2, vp=2, schedule="interleaved_1f1b"),
        Layout(dp=2, zero=1), Layout(dp=2, zero=3), Layout(cp=2),
        Layout(cp=2, cp_attention="all_to_all")])


PRESETS = {"llama3.1-8b": (8_030_261_248, 8.0), "llama3.1-70b": (70_553_706_496, 8.0),
           "llama3.2-1b": (1_235_814_400, 32.0), "llama3.2-3b": (3_212_749_824, 32.0)}
"""Llama 3.x presets: parameters of the published model (transformers' count) and its rope
factor."""


def test_llama3x_presets_count_as_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    """Each preset's count equals transformers' LlamaForCausalLM on the meta device, built from
    the preset's own HF export config (rope settings as published); `train --dry-run` prints
    it."""
    from colonnade.analysis.cli import configs_dir
    from colonnade.checkpoint.hf import hf_config_from_model
    from colonnade.cli import main
    from colonnade.config.load import load_config

    for name, (count, factor) in PRESETS.items():
        model = load_config(configs_dir() / f"{name}.toml").model
        assert param_count(model)["total"] == count, name
        hf = hf_config_from_model(model)
        assert hf["rope_parameters"] == {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}, name
        assert hf["max_position_embeddings"] == 131072
        with torch.device("meta"):
            theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
        assert theirs.num_parameters() == count, name
    assert main(["train", "--config", str(configs_dir() / "llama3.1-8b.toml"), "--dry-run"]) == 0
    assert ("32 heads, rope llama3 x8 (original context 8192), vocab 128256: 8,030,261,248 "
            "parameters") in capsys.readouterr().out


def test_head_dim_in_the_activation_model() -> None:
    """The planner's activation bytes of a layer whose heads are wider than h / a (a d = 64,
    h = 32) equal the bytes the layer saves for backward (no recompute: 330,752 per layer;
    selective), and the h / a shape's (281,600) would not."""
    import dataclasses

    from colonnade.analysis.activations import ActivationShape, chunk_layer_bytes
    from colonnade.analysis.measure import relative_error
    from colonnade.models.recompute import RecomputePlan
    from tests.recompute.harness import measured_layer_bytes, tiny_config

    config = tiny_config("llama", layers=2, dropout=0.0, seq=32)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, head_dim=16))
    tr, m = config.training, config.model
    shape = ActivationShape.from_model(m, tr.seq_len, tr.micro_batch_size, dtype=torch.float64)
    narrow = dataclasses.replace(shape, head_dim=None)
    plans = (RecomputePlan(), RecomputePlan("selective"))
    for plan, got in measured_layer_bytes(config, torch.float64, plans):
        assert got == chunk_layer_bytes(shape, plan, 2) / 2, plan  # to the byte
        assert relative_error(got, chunk_layer_bytes(narrow, plan, 2) / 2) > 0.05, plan
