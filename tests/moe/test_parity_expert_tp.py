"""Float64 parity of expert tensor parallelism (``parallel.expert_tp``, Megatron's MoE
parallel folding: each expert's gate/up split column-wise and down row-wise over the expert tp
group, chosen independently of attention's tp) against the single-process run
(tests/moe/harness.py): losses, expert loads and aux losses every step, step 0's gathered
gradients (assembled from the shards under ZeRO) and the parameters after 3 AdamW steps.

Layouts: expert_tp2 alone (ep1), expert_tp2 x ep2, tp2+sp with expert_tp = tp (x ep2) and
tp1 with expert_tp2 under cp2, pp2 (1F1B and interleaved) and dp (expert-dp 2, ZeRO-1,
ZeRO-2 with gpt2's partial down bias, ZeRO-3 x ep2 on 8 ranks); families with expert biases
(gpt-oss: clamped SwiGLU, biases on every expert matrix; gpt2: GELU experts with biases and a
shared expert) and DeepSeek-V3's sigmoid router with shared experts. tp2+sp with expert_tp1 x
ep2 is tests/moe/test_parity_moe_layouts.py's ep2-tp2-sp-dp2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.moe.harness import (
    check_parity,
    make_batches,
    moe_config,
    rank_train,
    reference_run,
    world_size,
)

CASES: dict[str, dict[str, Any]] = {
    "etp2-ep1": {"etp": 2, "ep": 1},
    "etp2-ep2-capacity": {"etp": 2, "ep": 2, "capacity": 1.0},
    "tp2-sp-etp2-ep2-allgather": {"tp": 2, "sp": True, "etp": 2, "ep": 2,
                                  "dispatcher": "all_gather", "aux_type": "seq"},
    "etp2-cp2-gpt2-shared": {"arch": "gpt2", "etp": 2, "ep": 1, "cp": 2, "shared": 16},
    "etp2-pp2-sigmoid": {"etp": 2, "ep": 1, "pp": 2, "dp": 2, "router": "sigmoid",
                         "microbatches": 4},
    "etp2-pp2-interleaved": {"etp": 2, "ep": 1, "pp": 2, "vp": 2, "dp": 2, "layers": 4,
                                "schedule": "interleaved_1f1b", "microbatches": 4},
    "etp2-edp2-zero1": {"etp": 2, "ep": 1, "dp": 4, "zero_stage": 1},
    "etp2-edp2-zero2-gpt2": {"arch": "gpt2", "etp": 2, "ep": 1, "dp": 4, "zero_stage": 2},
    "etp2-ep2-edp2-zero3-sigmoid": {"etp": 2, "ep": 2, "dp": 8, "zero_stage": 3,
                                    "router": "sigmoid"},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_expert_tp_parity(name: str, run_ranks: Callable[..., list[Any]]) -> None:
    case = CASES[name]
    config = moe_config(**case)
    assert config.parallel.expert_tp == 2
    batches = make_batches(config)
    ref = reference_run(config, batches)
    results = run_ranks(world_size(config), rank_train, config, batches)
    errs = check_parity(results, ref)
    assert "grads" in errs, errs  # step 0's gradients, assembled from the shards under ZeRO
    if case.get("capacity"):
        assert any(rec["moe_dropped_frac"] > 0 for rec in ref["moe"]), "nothing was dropped"
