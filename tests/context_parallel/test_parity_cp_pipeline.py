"""Context parallelism with pipeline parallelism (float64 parity, 3 AdamW steps): cp2 x pp2
under 1f1b, interleaved 1f1b (vp 2), the zero-bubble zb_h1 and ZB-V (vp 2, tied gpt2 head on
stage 0, document reset) schedules, and cp2 x tp2 x pp2
(8 ranks, sp, hidden and attention dropout: 1F1B runs a micro-batch's backward after the
next one's forward, and the ring redraws the masks of the forward's own micro-batch): p2p
activations between stages are [s/cp(/tp), b, h], every stage's chunks
take the micro-batch's full tokens for their positions / document boundaries, and the
logged loss and the final parameters equal the single-process reference's to 1e-10."""

from __future__ import annotations

from typing import Any

import pytest

from colonnade.models.blocks import DocReset
from tests.context_parallel.harness import (
    EOD,
    cp_config,
    make_batches,
    merged_params,
    param_error,
    rank_train,
    reference_run,
)

TOL = 1e-10

CASES: dict[str, dict[str, Any]] = {
    "cp2xpp2-1f1b-ring-gpt2": dict(config=dict(arch="gpt2", pp=2, microbatches=3)),
    "cp2xpp2-vp2-a2a-llama": dict(config=dict(arch="llama", pp=2, vp=2,
                                              schedule="interleaved_1f1b", microbatches=4,
                                              cp_attention="all_to_all")),
    "cp2xpp2-zb-ring-llama-docs": dict(config=dict(arch="llama", pp=2, schedule="zb_h1",
                                                   microbatches=3, seq=32), docs=True),
    "cp2xtp2xpp2-sp-ring-gpt2": dict(config=dict(arch="gpt2", pp=2, tp=2, sp=True,
                                                 microbatches=2, dropout=0.1)),
    "cp2xtp2xpp2-sp-a2a-llama": dict(config=dict(arch="llama", pp=2, tp=2, sp=True,
                                                 microbatches=2, cp_attention="all_to_all")),
    "cp2xpp2-1f1b-a2a-full-recompute": dict(config=dict(arch="gpt2", pp=2, microbatches=3,
                                                        cp_attention="all_to_all",
                                                        recompute="full")),
    "cp2xpp2-zbv-ring-gpt2-docs": dict(config=dict(arch="gpt2", pp=2, vp=2, schedule="zbv",
                                                   microbatches=3, seq=32), docs=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cp_pipeline_parity(run_ranks: Any, name: str) -> None:
    case = CASES[name]
    config = cp_config(**case["config"])
    par = config.parallel
    batches = make_batches(config, masked=True, docs=case.get("docs", False))
    reset = DocReset(EOD) if case.get("docs") else None
    ref = reference_run(config, batches, reset)
    results = run_ranks(par.tp * par.cp * par.pp, rank_train, config, batches, reset)
    for res in results:
        for step, (got, want) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            assert abs(got - want) <= TOL * abs(want), (
                f"rank {res['rank']} step {step}: loss {got!r} vs {want!r}")
    err = param_error(merged_params(results), ref["params"])
    assert err <= TOL, f"parameters: relative error {err:.3e}"
