"""ZeRO-3 with pipeline parallelism: the two gather policies, measured.

pp2 x dp2, 1F1B, 4 micro-batches, stage 3 with small buckets. ``reshard_after_forward`` True
re-gathers a bucket for every micro-batch's forward and again for its backward (freed after
each); False (the pp > 1 default, the micro-batch-window policy) gathers each bucket of a
chunk at its first use in the step and keeps it until the step's gradient sync. Both give the
float64 single-process reference's losses and parameters; the test counts the parameter
all-gathers of a step (the comm counters) and their bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from colonnade.config.sections import Config
from tests.data_parallel.common import make_batches, rank_train, reference_run, tiny_config
from tests.data_parallel.test_parity import check_parity
from tests.parity import resolved

M = 4
"""Micro-batches per step."""


def _config(reshard: bool) -> Config:
    base = tiny_config(arch="llama", dp=2, pp=2, microbatches=M, steps=2, zero_stage=3,
                       bucket=2000)
    return resolved(dataclasses.replace(
        base, parallel=dataclasses.replace(base.parallel, reshard_after_forward=reshard)))


def _train(config: Config, step_batches: list[Any]) -> dict[str, Any]:
    return rank_train(config, step_batches)


def _gathers(res: dict[str, Any]) -> tuple[int, float, float]:
    """Parameter all-gathers of the last step on one rank: (calls, wire bytes, exposed s)."""
    ops = [v for k, v in res["stats"].items() if "all_gather/param_shard" in k]
    return (sum(int(v["calls"]) for v in ops), sum(float(v["wire_bytes"]) for v in ops),
            sum(float(v["waited_s"]) for v in ops))


def test_zero3_pp2_gather_policies(run_ranks: Callable[..., list[Any]]) -> None:
    counts: dict[bool, list[tuple[int, float, float]]] = {}
    for reshard in (True, False):
        config = _config(reshard)
        batches = make_batches(config)
        results = run_ranks(4, _train, config, batches)
        check_parity(config, results, reference_run(config, batches))
        counts[reshard] = [_gathers(res) for res in results]
        for res, (per_step, _, _) in zip(results, counts[reshard], strict=True):
            if reshard:  # a forward and a backward gather per bucket and micro-batch
                assert per_step == 2 * M * res["buckets"], (per_step, res["buckets"])
            else:  # one gather per bucket and step
                assert per_step == res["buckets"], (per_step, res["buckets"])
    for rank in range(4):  # the window policy: 2 M times fewer gathers and bytes
        assert counts[True][rank][0] == 2 * M * counts[False][rank][0]
        assert counts[True][rank][1] == 2 * M * counts[False][rank][1]
    print("param gathers per rank and step (calls, wire bytes, exposed s): reshard",
          counts[True], "window", counts[False])


@pytest.mark.parametrize(("schedule", "vp", "recompute"),
                         [("zb_h1", 1, "full"), ("interleaved_1f1b", 2, "none"),
                          ("zbv", 2, "full")])
def test_zero3_pp2_reshard_schedules(run_ranks: Callable[..., list[Any]], schedule: str,
                                     vp: int, recompute: str) -> None:
    """reshard_after_forward under the other schedules. zb_h1: the input-gradient pass (B)
    accumulates no weight gradient, so its buckets complete (and are freed) in the weight pass
    (W), which with full recompute re-gathers them for the recomputation. Interleaved: two
    chunks per rank, prefetch never crosses a chunk. zbv: two chunks per rank in a V, the tied
    gpt2 embedding / head bucket read by both chunks of stage 0. Results equal the
    reference."""
    base = tiny_config(arch="gpt2" if vp > 1 else "llama", dp=2, pp=2, vp=vp,
                       schedule=schedule, microbatches=M, steps=2, zero_stage=3, bucket=2000,
                       recompute=recompute)
    config = resolved(dataclasses.replace(
        base, parallel=dataclasses.replace(base.parallel, reshard_after_forward=True)))
    batches = make_batches(config)
    results = run_ranks(4, _train, config, batches)
    check_parity(config, results, reference_run(config, batches))
