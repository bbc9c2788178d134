"""Bytes per step on the gradient-reduction group equal the ring-algorithm theory.

With N elements in the flat buffers (padding included), grad bytes G = N x 4 (fp32 main grads)
and param bytes W = N x (2 for bf16, 4 for fp32), per rank and step on n dp ranks:
  DDP     all-reduce      2 (n - 1) / n x G, one call per bucket;
  ZeRO-1  reduce-scatter  (n - 1) / n x G   and  all-gather (n - 1) / n x W, one call each per
          bucket, plus the 8-byte all-reduce of the global norm's squared sum.
For fp32 models W = G, so reduce-scatter + all-gather move exactly what the all-reduce moves.
Counted by the comm module (``groups.stats``), over the last step of a 2-step run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from colonnade.config.sections import Config
from tests.data_parallel.common import make_batches, rank_train, tiny_config


def _train_stats(config: Config, step_batches: list[Any]) -> dict[str, Any]:
    out = rank_train(config, step_batches)
    out.pop("params")
    return out


CASES = [(2, False, "fp32"), (2, True, "fp32"), (4, True, "fp32"), (4, False, "fp32"),
         (2, True, "bf16")]


@pytest.mark.parametrize("dp,zero,precision", CASES,
                         ids=[f"dp{d}-{'zero1' if z else 'ddp'}-{p}" for d, z, p in CASES])
def test_dp_bytes_match_theory(run_ranks: Callable[..., list[Any]], dp: int, zero: bool,
                               precision: str) -> None:
    config = tiny_config(dp=dp, zero=zero, precision=precision, steps=2, microbatches=1,
                         bucket=4000)
    results = run_ranks(dp, _train_stats, config, make_batches(config))
    n = dp
    for res in results:
        stats = {k: v for k, v in res["stats"].items() if k.startswith("dp_cp/")}
        tokens = stats.pop("dp_cp/all_reduce/loss_tokens")  # the step's loss divisor N
        assert tokens["calls"] == 1 and tokens["payload_bytes"] == 8  # one int64
        numel, buckets = res["numel"], res["buckets"]
        grad_bytes = numel * res["grad_bytes"]
        param_bytes = numel * res["param_bytes"]
        assert res["grad_bytes"] == 4 and res["param_bytes"] == (2 if precision == "bf16" else 4)
        assert buckets > 1
        if not zero:
            assert numel == res["num_params"], "DDP buffers carry no padding"
            assert sorted(stats) == ["dp_cp/all_reduce/grad_bucket"]
            ar = stats["dp_cp/all_reduce/grad_bucket"]
            assert ar["calls"] == buckets
            assert ar["payload_bytes"] == grad_bytes
            assert ar["wire_bytes"] == pytest.approx(2 * (n - 1) / n * grad_bytes, rel=1e-12)
            continue
        assert sorted(stats) == ["dp_cp/all_gather/param_bucket", "dp_cp/all_reduce/grad_norm",
                                 "dp_cp/reduce_scatter/grad_bucket"]
        rs = stats["dp_cp/reduce_scatter/grad_bucket"]
        ag = stats["dp_cp/all_gather/param_bucket"]
        assert rs["calls"] == ag["calls"] == buckets
        assert rs["wire_bytes"] == pytest.approx((n - 1) / n * grad_bytes, rel=1e-12)
        assert ag["wire_bytes"] == pytest.approx((n - 1) / n * param_bytes, rel=1e-12)
        assert ag["payload_bytes"] == param_bytes // n  # this rank's shard goes out
        norm = stats["dp_cp/all_reduce/grad_norm"]
        assert norm["calls"] == 1 and norm["payload_bytes"] == 8
        if precision == "fp32":
            total = rs["wire_bytes"] + ag["wire_bytes"]
            assert total == pytest.approx(2 * (n - 1) / n * grad_bytes, rel=1e-12)
