"""``training.compile`` with context parallelism: the cp attention call is an
:func:`colonnade.eager.eager` function (a graph break inside each compiled layer; its
collectives go through CommGroup), so compiled cp2 training (ring and all_to_all, with hidden
dropout) equals the float64 single-process AdamW reference (loss and parameters to 1e-10)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.context_parallel.harness import (
    cp_config,
    make_batches,
    merged_params,
    param_error,
    rank_train,
    reference_run,
)

TOL = 1e-10


@pytest.mark.parametrize("attention", ["ring", "all_to_all"])
def test_compiled_cp_parity(run_ranks: Any, attention: str) -> None:
    config = cp_config(arch="llama", compile=True, cp_attention=attention, dropout=0.1,
                       attention_dropout=0.0)
    batches = make_batches(config, masked=True)
    ref = reference_run(config, batches)
    results = run_ranks(2, rank_train, config, batches)
    for res in results:
        assert res["compiled"] == config.model.num_layers
        for got, want in zip(res["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= TOL * abs(want), (got, want)
    err = param_error(merged_params(results), ref["params"])
    assert err <= TOL, f"parameters: relative error {err:.3e}"
