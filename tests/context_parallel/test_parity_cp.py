"""Context-parallel training parity (float64, 3 AdamW steps): every cp layout's logged loss
(the global token mean, known on every rank) and final parameters equal the single-process
reference's (:mod:`tests.context_parallel.harness`) to 1e-10 relative.

Cases cover ring and all_to_all attention, cp 2 and 4, cp x tp (+ sp, + chunked sp
collectives), cp x dp with ZeRO-1 and ZeRO-3, full and selective recompute, gpt2 (learned
positions, tied embeddings, biases) and llama (RoPE, GQA), masked labels (micro-batches with
different valid-token counts), document resets (positions and attention across the zigzag
chunk boundaries) and dropout (hidden and attention dropout with both: the ring draws each
(query chunk, key chunk) block's box of the single-process keep-mask by global positions).
"""

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
    "cp2-ring-llama": dict(config=dict(arch="llama")),
    "cp2-ring-gpt2": dict(config=dict(arch="gpt2")),
    "cp2-a2a-llama-gqa": dict(config=dict(arch="llama", kv_heads=2, cp_attention="all_to_all")),
    "cp2-a2a-llama-kv1": dict(config=dict(arch="llama", kv_heads=1, cp_attention="all_to_all")),
    "cp4-ring-llama-gqa": dict(config=dict(arch="llama", cp=4, kv_heads=2, seq=32)),
    "cp4-a2a-gpt2": dict(config=dict(arch="gpt2", cp=4, cp_attention="all_to_all", seq=32)),
    "cp2-ring-no-overlap": dict(config=dict(arch="llama", cp_overlap=False)),
    "cp2xtp2-sp-ring-llama": dict(config=dict(arch="llama", tp=2, sp=True, kv_heads=2)),
    "cp2xtp2-sp-a2a-gpt2": dict(config=dict(arch="gpt2", tp=2, sp=True,
                                            cp_attention="all_to_all")),
    "cp2xtp2-ring-gpt2": dict(config=dict(arch="gpt2", tp=2)),
    "cp2xtp2-sp-chunks2-ring-llama": dict(config=dict(arch="llama", tp=2, sp=True,
                                                      tp_comm_chunks=2)),
    "cp2xdp2-zero1-ring": dict(config=dict(arch="llama", dp=2, zero_stage=1)),
    "cp2xdp2-zero1-a2a-gpt2": dict(config=dict(arch="gpt2", dp=2, zero_stage=1,
                                               cp_attention="all_to_all")),
    "cp2xdp2-zero3-a2a-gpt2": dict(config=dict(arch="gpt2", dp=2, zero_stage=3,
                                               cp_attention="all_to_all")),
    "cp2-ring-full-recompute": dict(config=dict(arch="gpt2", recompute="full")),
    "cp2-ring-selective": dict(config=dict(arch="llama", recompute="selective")),
    "cp2-a2a-selective-dropout": dict(config=dict(arch="llama", recompute="selective",
                                                  cp_attention="all_to_all", dropout=0.1)),
    "cp2-ring-docs-llama": dict(config=dict(arch="llama", seq=32), docs=True),
    "cp2-a2a-docs-gpt2": dict(config=dict(arch="gpt2", seq=32, cp_attention="all_to_all"),
                              docs=True),
    "cp2xtp2-sp-ring-docs-dropout": dict(config=dict(arch="gpt2", seq=32, tp=2, sp=True,
                                                     dropout=0.1), docs=True),
    "cp2-ring-dropout-llama-gqa": dict(config=dict(arch="llama", kv_heads=2, dropout=0.1)),
    "cp2-a2a-dropout-gpt2": dict(config=dict(arch="gpt2", dropout=0.1,
                                             cp_attention="all_to_all")),
}


def world(config: Any) -> int:
    par = config.parallel
    return par.tp * par.cp * (par.dp or 1) * par.pp


@pytest.mark.parametrize("name", list(CASES))
def test_cp_parity(run_ranks: Any, name: str) -> None:
    case = CASES[name]
    config = cp_config(**case["config"])
    batches = make_batches(config, masked=True, docs=case.get("docs", False))
    reset = DocReset(EOD) if case.get("docs") else None
    ref = reference_run(config, batches, reset)
    results = run_ranks(world(config), rank_train, config, batches, reset)
    for res in results:
        for step, (got, want) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            assert abs(got - want) <= TOL * abs(want), (
                f"rank {res['rank']} step {step}: loss {got!r} vs {want!r}")
    err = param_error(merged_params(results), ref["params"])
    assert err <= TOL, f"parameters: relative error {err:.3e}"
    cp_bytes = sum(v["wire_bytes"] for k, v in results[0]["stats"].items()
                   if k.startswith("cp/"))
    assert cp_bytes > 0, "the cp group moved nothing: attention did not span the ranks"
