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


def test_window_flops_count_the_band() -> None:
    """Model FLOPs per token count min(s, W) keys per query in a windowed layer: Mistral 7B's
    window 4096 at s = 8192 saves 3 l 4 (s - W) h_q = 3 x 32 x 4 x 4096 x 4096; at s <= W
    nothing; a window on half the layers saves half of it. The planner's core-attention time
    takes the same count (half the FLOPs at s = 2 W)."""
    from colonnade.analysis.cli import configs_dir
    from colonnade.analysis.efficiency import layer_gemms
    from colonnade.analysis.layout import Layout as PlanLayout
    from colonnade.analysis.layout import Workload
    from colonnade.config.load import load_config
    from colonnade.models.counts import flops_per_token

    config = load_config(configs_dir() / "mistral-7b-v0.1.toml")
    model = config.model
    cores = [layer_gemms(Workload.from_config(dataclasses.replace(config, model=m),
                                              seq_len=8192), PlanLayout())[1][0]
             for m in (model, dataclasses.replace(model, sliding_window=None))]
    assert cores[0] * 2 == cores[1]
    full = dataclasses.replace(model, sliding_window=None)
    half = dataclasses.replace(model, sliding_window_layers=tuple(range(16)))
    assert flops_per_token(full, 8192) - flops_per_token(model, 8192) == 3 * 32 * 4 * 4096 ** 2
    assert flops_per_token(full, 8192) - flops_per_token(half, 8192) == 3 * 16 * 4 * 4096 ** 2
    assert flops_per_token(full, 4096) == flops_per_token(model, 4096) == 49_104_814_080


def test_window_refusals() -> None:
    """The validator names each bad window field; a class without the window (Llama) or with
    another layer rule (Mistral: every layer) refuses on export rather than drop it; a
    config.json whose layer_types the class would ignore, or names another kind, is refused."""
    import pytest

    from colonnade.checkpoint.hf import hf_config_from_model, model_config_from_hf
    from colonnade.config.sections import Config
    from colonnade.config.validate import problems

    def found(**changes: Any) -> list[str]:
        return problems(Config(model=ModelConfig(num_layers=4, **changes)))

    assert found(sliding_window=0) == [
        "model.sliding_window=0 must be >= 1 (the keys each query attends, itself included); "
        "unset it for full attention."]
    assert "needs model.sliding_window" in found(sliding_window_layers=(1,))[0]
    assert "outside 0 .. model.num_layers - 1 = 3" in found(sliding_window=4,
                                                           sliding_window_layers=(2, 4))[0]
    assert "strictly ascending" in found(sliding_window=4, sliding_window_layers=(2, 1))[0]
    assert found(sliding_window=4, sliding_window_layers=(1, 3)) == []
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: model\.sliding_window=4"):
        hf_config_from_model(ModelConfig(arch="llama", sliding_window=4))
    with pytest.raises(ValueError, match=r"MistralForCausalLM: model\.sliding_window_layers"):
        hf_config_from_model(ModelConfig(arch="mistral", num_layers=4, sliding_window=4,
                                         sliding_window_layers=(1, 3)))
    qwen2 = hf_config_from_model(ModelConfig(arch="qwen2", num_layers=4, qkv_bias=True,
                                             sliding_window=4, sliding_window_layers=(1, 3)))
    assert (qwen2["use_sliding_window"], qwen2["layer_types"]) == (True, [
        "full_attention", "sliding_attention", "full_attention", "sliding_attention"])
    assert model_config_from_hf(qwen2).sliding_window_layers == (1, 3)  # layer_types rule
    hub = {k: v for k, v in qwen2.items() if k != "layer_types"}  # older Hub configs
    assert model_config_from_hf(hub | {"max_window_layers": 2}).sliding_window_layers == (2, 3)
    assert model_config_from_hf(hub | {"use_sliding_window": False}).sliding_window is None
    mistral = hf_config_from_model(ModelConfig(arch="mistral", num_layers=2, sliding_window=4))
    with pytest.raises(ValueError, match="ignores layer_types"):
        model_config_from_hf(mistral | {"layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="other attention kinds"):
        model_config_from_hf(qwen2 | {"layer_types": ["chunked_attention"] * 4})
