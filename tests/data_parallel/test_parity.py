"""Float64 parity of data parallelism with single-process AdamW.

For every switch (ZeRO-1 on/off, overlap on/off, one bucket per parameter / one bucket for
everything, average_in_collective, dp 2 and 4, tp x dp with sp and tied embeddings, pp x dp
when the pipeline executor exists) the per-step loss, the global gradient norm (clipping is
active: clip 0.05 < the norm) and the parameters after 3 steps match the single-process
reference within 1e-10 relative error. The same runs check the overlap evidence: every bucket
launched from a backward hook when overlap is on, none when off; ZeRO-1 gathers left in flight
after the step with overlap_param_gather and all waited by the next forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from colonnade.config.sections import Config
from tests.data_parallel.common import (
    make_batches,
    mean_losses,
    merged_params,
    rank_train,
    reference_run,
    tiny_config,
    with_parallel,
)
from tests.parity import rel_err

TOL = 1e-10
FLOOR = 1e-3
"""Norm below which errors count as absolute: the key bias has an exactly-zero gradient
(softmax is invariant to adding q.b_k to every score of a query), so it holds only round-off
(~1e-14) that Adam turns into noise-sized steps; any other parameter is far above 1e-3."""



def check_parity(config: Config, results: list[dict[str, Any]],
                 ref: dict[str, Any]) -> None:
    """Loss, grad norm and final parameters within TOL of the reference."""
    for step, (got, want) in enumerate(zip(mean_losses(results), ref["losses"], strict=True)):
        assert abs(got - want) <= TOL * abs(want), f"step {step} loss {got!r} vs {want!r}"
    for res in results:
        for step, (info, want) in enumerate(zip(res["infos"], ref["norms"], strict=True)):
            assert abs(info["grad_norm"] - want) <= TOL * want, (
                f"rank {res['rank']} step {step} grad norm {info['grad_norm']!r} vs {want!r}")
            assert info["skipped"] == 0.0
    assert min(ref["norms"]) > config.optim.clip_grad, "clipping must be active in this test"
    params = merged_params(results)
    # a tied head on the last stage is a copy under the embedding's key: merged_params has
    # asserted it bit-equal to the first stage's embedding
    assert sorted(params) == sorted(ref["params"])
    for key, want in ref["params"].items():
        err = rel_err(params[key], want, floor=FLOOR)
        assert err <= TOL, f"{key}: relative error {err:.3e} > {TOL:g}"
        if not key.endswith("attn.k.bias"):
            assert rel_err(params[key], _initial(config)[key], FLOOR) > 1e-4, f"{key} still"


_INIT: dict[str, Any] = {}


def _initial(config: Config) -> dict[str, Any]:
    key = (config.model.arch, config.model.num_layers)
    if key not in _INIT:
        from colonnade.models.build import build_reference

        model = build_reference(config)
        _INIT[key] = {p.sharding.key: p.detach().double().clone()  # type: ignore[attr-defined]
                      for p in model.parameters()}
    return _INIT[key]


def check_overlap(config: Config, results: list[dict[str, Any]]) -> None:
    """Overlap switches really change when communication happens."""
    par = config.parallel
    for res in results:
        expected = res["buckets"] if par.overlap_grad_reduce else 0
        assert res["launched"] == [expected] * len(res["launched"]), (
            f"rank {res['rank']}: buckets launched from backward hooks {res['launched']}, "
            f"expected {expected} per step")
        gathers = res["buckets"] if par.use_distributed_optimizer and par.overlap_param_gather \
            else 0
        assert res["pending_after_step"] == [gathers] * len(res["pending_after_step"])
        assert res["pending_after_fb"] == [0] * len(res["pending_after_fb"])


DP2_CASES = [
    dict(zero=zero, overlap=overlap, bucket=bucket)
    for zero in (False, True) for overlap in (False, True) for bucket in (1, 10**9)
]


@pytest.mark.parametrize("case", DP2_CASES, ids=lambda c: "-".join(
    [("zero1" if c["zero"] else "ddp"), ("overlap" if c["overlap"] else "no_overlap"),
     ("bucket_per_param" if c["bucket"] == 1 else "one_bucket")]))
def test_dp2_parity(run_ranks: Callable[..., list[Any]], case: dict[str, Any]) -> None:
    """dp=2, 4 micro-batches of accumulation, every switch combination."""
    config = tiny_config(dp=2, microbatches=4, **case)
    batches = make_batches(config)
    results = run_ranks(2, rank_train, config, batches)
    check_parity(config, results, reference_run(config, batches))
    check_overlap(config, results)
    buckets = results[0]["buckets"]
    if case["bucket"] == 1:
        assert buckets == results[0]["num_tensors"], "every parameter must be its own bucket"
    else:
        assert buckets == 1


@pytest.mark.parametrize("zero", [False, True], ids=["ddp", "zero1"])
def test_dp4_parity(run_ranks: Callable[..., list[Any]], zero: bool) -> None:
    """dp=4, mid-size buckets, average inside the collective (ReduceOp.AVG)."""
    config = tiny_config(dp=4, microbatches=2, zero=zero, bucket=3000,
                         average_in_collective=True)
    batches = make_batches(config)
    results = run_ranks(4, rank_train, config, batches)
    check_parity(config, results, reference_run(config, batches))
    check_overlap(config, results)
    assert 1 < results[0]["buckets"] < 20


@pytest.mark.parametrize(("arch", "chunks"), [("gpt2", 1), ("gpt2", 2), ("llama", 2)])
def test_tp2_dp2_sp_tied_parity(run_ranks: Callable[..., list[Any]], arch: str,
                                chunks: int) -> None:
    """tp=2 x dp=2 with sequence parallelism and (gpt2) a tied embedding, ZeRO-1 + overlap:
    tp-replicated (sp-partial) gradients and the tied weight are counted once in the norm.
    With tp_comm_chunks=2 sibling linears share one chunked gather that reads their weights
    directly: ZeRO-1's lazily waited parameter all-gather must still complete before it."""
    config = with_parallel(tiny_config(arch=arch, dp=2, tp=2, sp=True, zero=True, bucket=2000,
                                       microbatches=2), tp_comm_chunks=chunks)
    batches = make_batches(config)
    results = run_ranks(4, rank_train, config, batches)
    check_parity(config, results, reference_run(config, batches))
    check_overlap(config, results)


@pytest.mark.parametrize("layout", [
    dict(pp=2, dp=2), dict(pp=2, dp=2, schedule="zb_h1"),
    dict(pp=2, vp=2, dp=2, schedule="interleaved_1f1b"), dict(tp=2, pp=2, dp=2),
    dict(pp=2, vp=2, dp=2, schedule="zbv")],
    ids=["pp2_dp2", "pp2_dp2_zb_h1", "pp2_vp2_dp2_interleaved", "tp2_pp2_dp2", "pp2_vp2_dp2_zbv"])
def test_pipeline_dp_parity(run_ranks: Callable[..., list[Any]], layout: dict[str, Any]) -> None:
    """pp x dp (1F1B, zero-bubble H1 with split weight gradients, interleaved with 2 chunks per
    stage, ZB-V) and tp x pp x dp on 8 ranks; tied gpt2 embedding across the pipeline ends, ZeRO-1
    with overlap: the tied weight's own bucket keeps the two ends' shards aligned. Under ZB-V
    the embedding and head are one Parameter on stage 0 whose gradient arrives once per chunk
    in the last micro-batch: its bucket launches after both (from a hook, check_overlap)."""
    config = tiny_config(arch="gpt2", zero=True, bucket=2000, microbatches=4,
                         sp=layout.get("tp", 1) > 1, **layout)
    batches = make_batches(config)
    world = layout["dp"] * layout["pp"] * layout.get("tp", 1)
    results = run_ranks(world, rank_train, config, batches)
    check_parity(config, results, reference_run(config, batches))
    check_overlap(config, results)
