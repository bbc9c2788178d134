"""Float64 parity of the MoE model under expert parallelism against the single-process run
(tests/moe/harness.py): losses, per-layer expert loads, drops and aux losses every step, the
gathered gradients of step 0 and the parameters after 3 AdamW steps, for ep2 / ep4, both
dispatchers, dropless and capacity modes, the sigmoid router with its bias update, 'seq' and
'global' aux losses with z-loss, gradient accumulation and an expert that gets no token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.moe.harness import check_parity, make_batches, moe_config, rank_train, reference_run

CASES: dict[str, dict[str, Any]] = {
    "ep2-a2a-global": {"ep": 2},
    "ep2-allgather-seq": {"ep": 2, "dispatcher": "all_gather", "aux_type": "seq"},
    "ep4-a2a-seq-accum4": {"ep": 4, "aux_type": "seq", "microbatches": 4},
    "ep4-allgather-global": {"ep": 4, "dispatcher": "all_gather"},
    "ep2-capacity-a2a": {"ep": 2, "capacity": 1.0},
    "ep4-capacity-allgather-seq": {"ep": 4, "capacity": 0.5, "aux_type": "seq",
                                   "dispatcher": "all_gather"},
    "ep2-sigmoid-bias": {"ep": 2, "router": "sigmoid", "bias_rate": 1e-2},
    "ep2-gpt2-shared": {"ep": 2, "arch": "gpt2", "shared": 16},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_parity(name: str, run_ranks: Callable[..., list[Any]]) -> None:
    config = moe_config(**CASES[name])
    batches = make_batches(config)
    ref = reference_run(config, batches)
    results = run_ranks(int(config.parallel.dp or 1), rank_train, config, batches)
    errs = check_parity(results, ref)
    assert set(errs) == {"loss", "aux", "grads", "params"}
    if CASES[name].get("capacity"):
        assert any(rec["moe_dropped_frac"] > 0 for rec in ref["moe"]), "nothing was dropped"
    if CASES[name].get("router") == "sigmoid":
        bias = [v for k, v in ref["params"].items() if k.endswith("expert_bias")]
        assert bias and all(float(b.abs().sum()) > 0 for b in bias), "bias never moved"


def test_expert_with_zero_tokens(run_ranks: Callable[..., list[Any]]) -> None:
    """Top-1 routing with expert 3's router row the mean of the others': at initialisation no
    token reaches it (ep4: its rank computes on zero rows), forward and backward agree."""
    config = moe_config(ep=4, top_k=1)
    batches = make_batches(config)
    ref = reference_run(config, batches, starve=1)
    assert all(load[-1] == 0 for load in ref["moe"][0]["moe_load"].values()), ref["moe"][0]
    results = run_ranks(4, rank_train, config, batches, starve=1)
    check_parity(results, ref)
