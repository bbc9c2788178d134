"""Hierarchical context parallelism (cp_attention='hierarchical': all-to-all inside groups of
cp_a2a_size ranks, ring across them) against the single-process reference (float64, 3 AdamW
steps, 1e-10): cp 4 = 2 x 2 with GQA (kv heads split and replicated over the inner group),
document resets, hidden and attention dropout; the degenerate 2 x 1 (plain all_to_all) and
1 x 2 (plain ring); 2 x 2 with tp2 + sp, with pp2 and with dp2 + ZeRO-1 (8 ranks each).
Each case also checks which groups moved bytes: the inner group only with a > 1, the ring
only with cp / a > 1, the plain cp group never (its attention runs on the two sub-groups), and
that the bytes of the last step are the planner's (colonnade.analysis.cp_comm) exactly.
"""

from __future__ import annotations

from typing import Any

import pytest

from colonnade.analysis.cp_comm import step_cp_bytes
from colonnade.analysis.hardware import get_cluster
from colonnade.analysis.layout import Layout, Workload
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
H = dict(cp_attention="hierarchical")

CASES: dict[str, dict[str, Any]] = {
    "cp4-2x2-llama-gqa-docs-dropout": dict(config=dict(arch="llama", cp=4, cp_a2a_size=2,
                                                       kv_heads=2, seq=32, dropout=0.1),
                                           docs=True),
    "cp4-2x2-llama-kv1": dict(config=dict(arch="llama", cp=4, cp_a2a_size=2, kv_heads=1,
                                          seq=32)),
    "cp2-2x1-gpt2": dict(config=dict(arch="gpt2", cp=2, cp_a2a_size=2)),
    "cp2-1x2-llama": dict(config=dict(arch="llama", cp=2, cp_a2a_size=1, kv_heads=2)),
    "cp4-2x2xtp2-sp-llama": dict(config=dict(arch="llama", cp=4, cp_a2a_size=2, tp=2, sp=True,
                                             seq=32)),
    "cp4-2x2xpp2-gpt2-dropout": dict(config=dict(arch="gpt2", cp=4, cp_a2a_size=2, pp=2,
                                                 seq=32, microbatches=2, dropout=0.1)),
    "cp4-2x2xdp2-zero1-llama": dict(config=dict(arch="llama", cp=4, cp_a2a_size=2, dp=2,
                                                zero_stage=1, seq=32, microbatches=1)),
}


def _sent(stats: dict[str, Any], group: str) -> float:
    return sum(v["wire_bytes"] for k, v in stats.items() if k.startswith(f"{group}/"))


@pytest.mark.parametrize("name", list(CASES))
def test_hierarchical_cp_parity(run_ranks: Any, name: str) -> None:
    case = CASES[name]
    config = cp_config(**H, **case["config"])
    par = config.parallel
    batches = make_batches(config, masked=True, docs=case.get("docs", False))
    reset = DocReset(EOD) if case.get("docs") else None
    ref = reference_run(config, batches, reset)
    results = run_ranks(par.tp * par.cp * (par.dp or 1) * par.pp, rank_train, config, batches,
                        reset)
    for res in results:
        for step, (got, want) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            assert abs(got - want) <= TOL * abs(want), (
                f"rank {res['rank']} step {step}: loss {got!r} vs {want!r}")
    err = param_error(merged_params(results), ref["params"])
    assert err <= TOL, f"parameters: relative error {err:.3e}"
    a, ring = par.cp_a2a_size, par.cp // (par.cp_a2a_size or 1)
    model = step_cp_bytes(Workload.from_config(config), Layout.from_config(config, len(results)),
                          get_cluster("cpu-local"))
    for res in results:
        stats = res["stats"]
        sent = _sent(stats, "cp_a2a") + _sent(stats, "cp_ring")
        assert sent == pytest.approx(model, rel=1e-12), (name, sent, model)
        assert (_sent(stats, "cp_a2a") > 0) == (a > 1), (name, sorted(stats))
        assert (_sent(stats, "cp_ring") > 0) == (ring > 1), (name, sorted(stats))
        assert _sent(stats, "cp") == 0, sorted(stats)
