"""Float64 parity of hybrid sharding (``parallel.zero_shard_size``) with tp, pp and cp.

ZeRO-2 and ZeRO-3 shard over groups of ``zero_shard_size`` consecutive ranks of each dp x cp
group and replicate across them (gradient shards all-reduced over the replicas once per
step). Each layout trains 3 AdamW steps (clipping active, masked labels) through
DataParallel + DistributedOptimizer and must match the single-process reference
(:mod:`tests.context_parallel.harness`): the step losses and the parameters after 3 steps to
1e-10 relative. Layouts: tp2 + sp x dp4, pp2 (1F1B and interleaved) x dp4, cp2 x dp2 (the
shard group is a cp pair, the replicas the dp ranks), each with shards of 2 ranks.
"""

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

HYBRID = [  # (tp, cp, pp, vp, dp, ZeRO stage, arch)
    (2, 1, 1, 1, 4, 2, "gpt2"),
    (2, 1, 1, 1, 4, 3, "llama"),
    (1, 1, 2, 1, 4, 2, "llama"),
    (1, 1, 2, 2, 4, 3, "gpt2"),
    (1, 2, 1, 1, 2, 2, "gpt2"),
    (1, 2, 1, 1, 2, 3, "llama"),
]


@pytest.mark.parametrize(("tp", "cp", "pp", "vp", "dp", "zero", "arch"), HYBRID,
                         ids=[f"tp{c[0]}-cp{c[1]}-pp{c[2]}-vp{c[3]}-dp{c[4]}-zero{c[5]}-{c[6]}"
                              for c in HYBRID])
def test_hybrid_sharding_parity(run_ranks: Any, tp: int, cp: int, pp: int, vp: int, dp: int,
                                zero: int, arch: str) -> None:
    """Shards of 2 ranks inside dp x cp, replicated over the rest: the single-process run."""
    config = cp_config(arch=arch, tp=tp, cp=cp, pp=pp, vp=vp, dp=dp, sp=tp > 1,
                       schedule="interleaved_1f1b" if vp > 1 else "1f1b",
                       zero_stage=zero, zero_shard_size=2, microbatches=2)
    batches = make_batches(config, masked=True)
    ref = reference_run(config, batches)
    results = run_ranks(tp * cp * pp * dp, rank_train, config, batches)
    for res in results:
        for step, (got, want) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            assert abs(got - want) <= TOL * abs(want), (res["rank"], step, got, want)
        ops = res["stats"]  # the last step's: one all-reduce of the shard over the replicas
        replicas = [int(v["calls"]) for k, v in ops.items()
                    if k.endswith("all_reduce/grad_shard_replicas")]
        shard = [k for k in ops if "reduce_scatter/grad_shard" in k]
        assert replicas == [1] and shard, sorted(ops)
    err = param_error(merged_params(results), ref["params"])
    assert err <= TOL, f"parameters: relative error {err:.3e}"
