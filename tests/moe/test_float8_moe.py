"""Float8 routed experts (``training.fp8``): float64 parity of the float8 run under ep2 and
expert tp2 (each with tp2+sp, so the dense layers' activations are whole too) against the
single-process float8 run (tests/moe/harness.py): losses, expert loads and aux losses every
step, step 0's gathered gradients and the parameters after 3 AdamW steps, 1e-10. Expert tp
splits f, so the per-expert amaxes of gate / up (output split) and down (input split) are
all-reduced over the expert tp group; under ep each expert's rows are all on its rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from tests.moe.harness import check_parity, make_batches, moe_config, rank_train, reference_run


@pytest.mark.parametrize(("recipe", "ep", "etp"), [
    ("tensorwise", 2, 1), ("tensorwise", 1, 2), ("rowwise", 1, 2)],
    ids=["tensorwise-tp2-sp-ep2", "tensorwise-tp2-sp-etp2", "rowwise-tp2-sp-etp2"])
def test_fp8_expert_parity(run_ranks: Callable[..., list[Any]], recipe: str, ep: int,
                           etp: int) -> None:
    base = moe_config(tp=2, sp=True, ep=ep, etp=etp)
    config = dataclasses.replace(base, training=dataclasses.replace(base.training, fp8=recipe))
    batches = make_batches(config)
    ref = reference_run(config, batches)
    plain = reference_run(base, batches)
    assert abs(ref["losses"][-1] - plain["losses"][-1]) > 1e-6 * abs(plain["losses"][-1])
    results = run_ranks(2, rank_train, config, batches)
    errs = check_parity(results, ref)
    assert "grads" in errs, errs
