"""Parameter and FLOP counts of MoE models (models/counts.py): the total equals the built
model's parameters, the active count skips E - k routed experts per MoE layer, and both (and
the MoE FLOPs) agree with the planner's independent MoE terms (analysis/moe.py)."""

from __future__ import annotations

import dataclasses

import pytest

from colonnade.analysis.moe import active_flops_per_token, moe_param_counts
from colonnade.config.sections import Config, ModelConfig, TrainingConfig
from colonnade.config.validate import resolve, validate
from colonnade.models.build import build_reference
from colonnade.models.counts import (
    active_param_count,
    flops_per_token,
    moe_layer_count,
    param_count,
)
from tests.parity import tiny_model


def _model(arch: str, **moe: object) -> ModelConfig:
    base = tiny_model(arch, layers=4, bias=arch == "gpt2")
    fields = {"num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 24, **moe}
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


MODELS = [
    ("llama", {}),
    ("gpt2", {"moe_shared_expert_ffn_hidden_size": 16, "moe_shared_expert_gate": True}),
    ("llama", {"moe_router": "sigmoid", "moe_first_dense_layers": 1, "moe_layer_freq": 2,
               "moe_shared_expert_ffn_hidden_size": 32}),
]


@pytest.mark.parametrize(("arch", "moe"), MODELS)
def test_moe_counts_match_built_model_and_planner(arch: str, moe: dict[str, object]) -> None:
    model = _model(arch, **moe)
    config = validate(resolve(Config(model=model, training=TrainingConfig(
        seq_len=16, micro_batch_size=2, precision="fp64", eval_interval=0)), 1), 1)
    chunk = build_reference(config)
    params = {id(p): p for p in chunk.parameters()}  # the tied head counted once
    built = sum(p.numel() for p in params.values())
    assert param_count(model)["total"] == built
    routed = sum(p.numel() for n, p in chunk.named_parameters() if ".experts." in n)
    n_moe = moe_layer_count(model)
    assert n_moe == sum(1 for i in range(4) if model.is_moe_layer(i))
    assert active_param_count(model) == built - routed * (4 - 2) // 4
    planner = moe_param_counts(model)
    assert planner["total"] == built and planner["active"] == active_param_count(model)
    assert flops_per_token(model, 16) == pytest.approx(active_flops_per_token(model, 16),
                                                       rel=1e-12)
    dense = dataclasses.replace(model, num_experts=0)
    assert active_param_count(dense) == param_count(dense)["total"]
    names = {n for n, _ in chunk.named_parameters()}
    for i in range(4):  # arch_spec puts an MoE MLP exactly at the MoE layers
        assert any(n.startswith(f"layers.{i}.mlp.router.") for n in names) == (
            model.is_moe_layer(i))
