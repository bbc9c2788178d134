"""Mixture-of-experts configuration: every MoE rule of the validator rejects its case with a
message naming the field and the fix; valid MoE layouts (expert tp included) pass; resolve()
fills expert_tp = 1 when unset."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from colonnade.config.load import ConfigError, config_from_dict
from colonnade.config.validate import resolve, validate

BASE: dict[str, dict[str, Any]] = {
    "model": {"num_layers": 4, "hidden_size": 64, "num_heads": 8, "vocab_size": 256,
              "max_seq_len": 64, "num_experts": 4, "moe_top_k": 2},
    "training": {"seq_len": 32, "micro_batch_size": 2, "steps": 10, "device": "cpu"},
}


def _config(overrides: dict[str, dict[str, Any]]) -> Any:
    raw = copy.deepcopy(BASE)
    for section, fields in overrides.items():
        raw.setdefault(section, {}).update(fields)
    return config_from_dict(raw)


BAD: list[tuple[str, int, dict[str, dict[str, Any]], list[str]]] = [
    ("experts_vs_ep", 4, {"model": {"num_experts": 6}, "parallel": {"ep": 4}},
     ["model.num_experts=6 is not divisible by parallel.ep=4", "pick ep dividing"]),
    ("top_k_over_experts", 1, {"model": {"moe_top_k": 5}},
     ["model.moe_top_k=5 must be in [1, model.num_experts=4]"]),
    ("top_k_zero", 1, {"model": {"moe_top_k": 0}}, ["model.moe_top_k=0 must be in [1"]),
    ("expert_tp_vs_width", 4, {"model": {"moe_ffn_hidden_size": 6},
                                "parallel": {"expert_tp": 4}},
     ["model.moe_ffn_hidden_size=6 is not divisible by parallel.expert_tp=4",
      "pick expert_tp dividing it"]),
    ("expert_tp_dense", 2, {"model": {"num_experts": 0}, "parallel": {"expert_tp": 2}},
     ["parallel.expert_tp=2 needs a mixture-of-experts model", "set expert_tp=1"]),
    ("tp_without_sp", 2, {"parallel": {"tp": 2}},
     ["parallel.tp=2 with a mixture-of-experts model needs parallel.sp=true"]),
    ("expert_hybrid_shard", 6, {"parallel": {"zero_stage": 3, "ep": 2, "zero_shard_size": 2}},
     ["parallel.zero_shard_size=2 does not divide the expert data-parallel degree", "= 3",
      "pick a divisor or a multiple of 3"]),
    ("capacity", 1, {"model": {"moe_capacity_factor": 0.0}},
     ["model.moe_capacity_factor=0.0 must be > 0", "unset it for dropless"]),
    ("aux_coeff", 1, {"model": {"moe_aux_loss_coeff": -0.1}},
     ["model.moe_aux_loss_coeff=-0.1 must be >= 0"]),
    ("z_coeff", 1, {"model": {"moe_z_loss_coeff": -1.0}},
     ["model.moe_z_loss_coeff=-1.0 must be >= 0"]),
    ("bias_rate", 1, {"model": {"moe_router_bias_update_rate": -1.0}},
     ["model.moe_router_bias_update_rate=-1.0 must be >= 0"]),
    ("freq", 1, {"model": {"moe_layer_freq": 0}}, ["model.moe_layer_freq=0 must be >= 1"]),
    ("swiglu_clamp_not_gpt_oss", 1, {"model": {"moe_swiglu_limit": 5.0}},
     ["model.moe_swiglu_limit=5.0: model.arch='llama' has no clamped SwiGLU experts"]),
    ("swiglu_limit", 1, {"model": {"arch": "gpt_oss", "moe_swiglu_limit": 0.0}},
     ["model.moe_swiglu_limit=0.0 must be > 0"]),
    ("first_dense_negative", 1, {"model": {"moe_first_dense_layers": -1}},
     ["model.moe_first_dense_layers=-1 must be >= 0"]),
    ("no_moe_layer_left", 1, {"model": {"moe_first_dense_layers": 4}},
     ["model.moe_first_dense_layers=4 leaves no MoE layer", "model.num_experts=0"]),
    ("expert_width", 1, {"model": {"moe_ffn_hidden_size": 0}},
     ["model.moe_ffn_hidden_size=0 must be >= 1"]),
    ("shared_width", 1, {"model": {"moe_shared_expert_ffn_hidden_size": -8}},
     ["model.moe_shared_expert_ffn_hidden_size=-8 must be >= 0"]),
    ("gate_without_shared", 1, {"model": {"moe_shared_expert_gate": True}},
     ["model.moe_shared_expert_gate=true needs a shared expert"]),
    ("shared_vs_tp", 2, {"model": {"moe_shared_expert_ffn_hidden_size": 33},
                         "parallel": {"tp": 2, "sp": True}},
     ["model.moe_shared_expert_ffn_hidden_size=33 is not divisible by parallel.tp=2"]),
    ("router", 1, {"model": {"moe_router": "relu"}},
     ["model.moe_router='relu' is unknown; use one of softmax, sigmoid"]),
    ("aux_type", 1, {"model": {"moe_aux_loss_type": "batch"}},
     ["model.moe_aux_loss_type='batch' is unknown; use one of seq, global"]),
    ("dispatcher", 2, {"parallel": {"ep": 2, "moe_dispatcher": "p2p"}},
     ["parallel.moe_dispatcher='p2p' is unknown; use one of all_to_all, all_gather"]),
    ("negative_experts", 1, {"model": {"num_experts": -1}},
     ["model.num_experts=-1 must be >= 0"]),
    ("ep_dense", 2, {"model": {"num_experts": 0}, "parallel": {"ep": 2, "expert_tp": 1}},
     ["parallel.ep=2 needs a mixture-of-experts model", "set ep=1"]),
]


@pytest.mark.parametrize(("name", "world", "overrides", "expected"), BAD,
                         ids=[row[0] for row in BAD])
def test_moe_rule_rejects(name: str, world: int, overrides: dict[str, dict[str, Any]],
                          expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        validate(resolve(_config(overrides), world), world)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{name}: {part!r} not in:\n{message}"


GOOD: list[tuple[int, dict[str, dict[str, Any]]]] = [
    (1, {}),
    (2, {"parallel": {"ep": 2}}),
    (4, {"parallel": {"ep": 4, "moe_dispatcher": "all_gather"}}),
    (4, {"parallel": {"tp": 2, "sp": True, "ep": 2}}),
    (8, {"parallel": {"tp": 2, "sp": True, "pp": 2, "ep": 2, "zero_stage": 1}}),
    (4, {"parallel": {"tp": 2, "sp": True, "ep": 2, "expert_tp": 2}}),  # folding: etp x ep = 4
    (4, {"parallel": {"ep": 2, "expert_tp": 2}}),  # expert tp without attention tp
    (4, {"parallel": {"cp": 2, "ep": 4}}),
    (4, {"parallel": {"ep": 2, "zero_stage": 2}}),
    (8, {"parallel": {"ep": 2, "zero_stage": 3, "zero_shard_size": 4}}),
    (1, {"model": {"moe_router": "sigmoid", "moe_capacity_factor": 1.25,
                   "moe_shared_expert_ffn_hidden_size": 64, "moe_shared_expert_gate": True,
                   "moe_aux_loss_type": "seq", "moe_aux_loss_coeff": 0.01,
                   "moe_first_dense_layers": 1, "moe_layer_freq": 2}}),
]


@pytest.mark.parametrize(("world", "overrides"), GOOD)
def test_valid_moe_layouts_pass_and_expert_tp_resolves_to_one(
        world: int, overrides: dict[str, dict[str, Any]]) -> None:
    config = validate(resolve(_config(overrides), world), world)
    assert config.parallel.expert_tp == overrides.get("parallel", {}).get("expert_tp", 1)
    assert config.model.moe


def test_dense_model_keeps_expert_tp_unset() -> None:
    config = resolve(_config({"model": {"num_experts": 0}}), 1)
    assert config.parallel.expert_tp is None
    validate(config, 1)


def test_moe_layer_placement() -> None:
    model = _config({"model": {"num_layers": 6, "moe_first_dense_layers": 1,
                               "moe_layer_freq": 2}}).model
    assert [i for i in range(6) if model.is_moe_layer(i)] == [1, 3, 5]
