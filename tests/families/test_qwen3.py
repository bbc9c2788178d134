"""Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``) through the family
harness: transformers' logits, loss, gradients, greedy text and a bit-for-bit round trip; the
single-process run's losses and parameters under every layout (the q/k norm weights [d] are
tp-replicated over tp-split heads: the tp2 runs hold them equal to the reference only because
their gradients are summed over tp); the presets' parameter counts against transformers' own
count on the meta device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from colonnade.checkpoint.hf import hf_config_from_model
from colonnade.config.load import load_config
from colonnade.config.sections import ModelConfig
from colonnade.models.counts import active_param_count, param_count
from tests.families.harness import Layout, check_layouts, hf_check, randomize, tiny

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=48, max_position_embeddings=64, rope_theta=500.0)
"""A tiny Qwen3 shape; head_dim 16 != hidden / heads = 8, as in the released models."""


def test_qwen3_against_transformers(tmp_path: Path) -> None:
    """Tied, with a sliding window of 5 keys from layer max_window_layers = 1 on (layer 0
    attends in full), over 12 tokens and 32 generated."""
    cfg = transformers.Qwen3Config(vocab_size=67, num_hidden_layers=2, tie_word_embeddings=True,
                                   use_sliding_window=True, sliding_window=5,
                                   max_window_layers=1, **SHAPE)
    ours = hf_check(randomize(transformers.Qwen3ForCausalLM(cfg)), tmp_path, vocab=67)
    assert (ours.arch, ours.head_size, ours.kv_heads, ours.tie_embeddings) == (
        "qwen3", 16, 2, True)
    assert (ours.window(0), ours.window(1)) == (None, 5)


def test_qwen3_moe_against_transformers(tmp_path: Path) -> None:
    """Layer 0 dense (mlp_only_layers), layers 1-2 MoE with 4 experts, top 2 renormalised;
    the router's float32 softmax island removed (float64_softmax), so 1e-10 holds. Every
    layer windowed (use_sliding_window, 6 keys)."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=67, num_hidden_layers=3, mlp_only_layers=[0], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
        tie_word_embeddings=False, use_sliding_window=True, sliding_window=6, **SHAPE)
    ours = hf_check(randomize(transformers.Qwen3MoeForCausalLM(cfg)), tmp_path, vocab=67)
    assert (ours.arch, ours.num_experts, ours.moe_top_k, ours.moe_first_dense_layers) == (
        "qwen3", 4, 2, 1)
    assert (ours.expert_ffn_size, ours.ffn_size, ours.moe_shared_expert_ffn_hidden_size) == (
        24, 48, 0)
    assert (ours.sliding_window, ours.sliding_window_layers) == (6, None)


QWEN3 = tiny(ModelConfig(arch="qwen3", num_layers=4, hidden_size=32, num_heads=4,
                         num_kv_heads=2, head_dim=16, ffn_hidden_size=48, norm_eps=1e-6,
                         tie_embeddings=True, sliding_window=6, sliding_window_layers=(2, 3)))
"""The dense layout model: 4 layers (pp2 x vp2), head_dim 16, tied (as Qwen3-0.6B), a window
of 6 keys in layers 2-3 (use_sliding_window with max_window_layers 2) over 16 tokens."""


def test_qwen3_layouts(run_ranks: Callable[..., list[Any]]) -> None:
    """tp2 with and without sp, and tp2 x dp2 ZeRO-3 (the q/k norm gradients summed on the
    owned shard pieces) fail at step 1 without the tp reduction of the q/k norm gradients;
    cp (ring, all-to-all) and pp (1F1B, interleaved) need nothing beyond the per-token norm."""
    check_layouts(run_ranks, QWEN3, [
        Layout(tp=2, sp=True), Layout(tp=2), Layout(pp=2),
        Layout(pp=2, vp=2, schedule="interleaved_1f1b"), Layout(dp=2, zero=1),
        Layout(tp=2, dp=2, zero=3), Layout(cp=2), Layout(cp=2, cp_attention="all_to_all")])


def test_qwen3_moe_layouts(run_ranks: Callable[..., list[Any]]) -> None:
    model = dataclasses.replace(QWEN3, num_layers=2, num_experts=4, moe_top_k=2,
                                moe_ffn_hidden_size=24, moe_first_dense_layers=1,
                                tie_embeddings=False, sliding_window=None,
                                sliding_window_layers=None)
    check_layouts(run_ranks, model, [
        Layout(dp=2, ep=2), Layout(dp=2, ep=2, dispatcher="all_gather"),
        Layout(tp=2, sp=True, dp=2, ep=2)])


PRESETS = {  # name: (transformers' count on the meta device, active parameters)
    "qwen3-0.6b": (596_049_920, 596_049_920),
    "qwen3-8b": (8_190_735_360, 8_190_735_360),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_qwen3_preset_counts(name: str) -> None:
    total, active = PRESETS[name]
    model = load_config(CONFIGS / f"{name}.toml").model
    assert (param_count(model)["total"], active_param_count(model)) == (total, active)
    hf = hf_config_from_model(model)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items()
                                               if k != "architectures"})
    with torch.device("meta"):
        assert transformers.AutoModelForCausalLM.from_config(cfg).num_parameters() == total


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_qwen3_activation_bytes_match_the_planner(dtype: torch.dtype) -> None:
    """The bytes a Qwen3 layer keeps for backward, measured, equal the planner's model to the
    byte (the q/k norms keep their input, 1/rms and normalised copy: 101,376 B per layer at
    fp64 here), without recompute and with selective and full recompute."""
    from colonnade.analysis.activations import ActivationShape, chunk_layer_bytes
    from tests.recompute.harness import measured_layer_bytes, tiny_config

    base = tiny_config("llama", layers=2, dropout=0.0, seq=32)
    config = dataclasses.replace(base, model=dataclasses.replace(base.model, arch="qwen3",
                                                                 head_dim=16))
    m, tr = config.model, config.training
    shape = ActivationShape.from_model(m, tr.seq_len, tr.micro_batch_size, dtype=dtype)
    for plan, got in measured_layer_bytes(config, dtype):
        assert got == chunk_layer_bytes(shape, plan, m.num_layers) / m.num_layers, plan


def test_qwen3_export_refuses_what_its_class_cannot_express(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``convert --to-hf`` of a qwen3 model with biases, or a Qwen3-MoE with a shared expert:
    exit 2 with one line naming the field, nothing written (was a traceback, exit 1)."""
    from colonnade.checkpoint.convert import write_model_checkpoint
    from colonnade.checkpoint.export import full_state
    from colonnade.cli import main
    from colonnade.config.sections import Config
    from colonnade.models.build import build_reference
    from colonnade.parallel.groups import ProcessGroups

    for name, changes, field in (
            ("bias", {"bias": True}, "model.bias"),
            ("shared", {"num_experts": 4, "moe_shared_expert_ffn_hidden_size": 16},
             "moe_shared_expert_ffn_hidden_size")):
        config = Config(model=dataclasses.replace(QWEN3, num_layers=2, sliding_window=None,
                                                  sliding_window_layers=None, **changes))
        full = full_state([build_reference(config)], ProcessGroups.single())
        ckpt = write_model_checkpoint(tmp_path / name, config, full)
        out = tmp_path / f"hf_{name}"
        assert main(["convert", "--to-hf", str(ckpt), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "cannot express as Qwen3" in err and field in err and "Traceback" not in err
        assert not out.exists()
