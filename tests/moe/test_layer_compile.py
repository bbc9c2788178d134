"""training.compile with MoE layers: the compiled model (gpt2 with GELU experts, a gated shared
expert, capacity drops, an aux loss, dropout, full recompute, one process, fp64) trains 3
steps exactly as the eager one, with one compiled version of the layer for all layers; the
only graph breaks are the :func:`colonnade.eager.eager` islands (dispatch + experts, aux +
stats, dropout) - the harness of tests/models/test_compile.py."""

from __future__ import annotations

import dataclasses

from colonnade.config.validate import resolve, validate
from tests.conftest import RankPools
from tests.models.test_compile import check, launch, make_config


def test_compiled_moe_model_trains_as_eager(rank_pools: RankPools) -> None:
    base = make_config(recompute="full")
    model = dataclasses.replace(base.model, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=24,
                                moe_shared_expert_ffn_hidden_size=16,
                                moe_shared_expert_gate=True, moe_capacity_factor=1.0,
                                moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    config = validate(resolve(dataclasses.replace(base, model=model), 1), 1)
    (res,) = launch(rank_pools, config)
    check([res])
    assert set(res["breaks"]) == {"MoELayer._routed", "MoELayer._aux_and_record",
                                  "_draw_dropout", "dropout_attention"}
