"""Expert gradients and the optimizer on the real MoE model (moe/layer.py through
models/spec.py), float64, against the single-process reference of tests/moe/harness.py.

Layouts where expert-dp differs from dp x cp (dp4 x ep2: edp 2, D 4; tp2+sp x dp2 x ep2:
edp 2, D 2), with pipeline parallelism (the expert norm summed over pp), ZeRO-1 on and off,
overlap on and off, clipping active. Checked: the gathered gradients of step 0 (no ZeRO), the
parameters after 3 AdamW steps, losses and MoE fields (check_parity), the grad norm of step 0
against the reference's plain L2 norm, the bytes each group reduced in the last step, the
expert optimizer state sharded over expert-dp (ZeRO-1), overlap evidence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.config.sections import Config
from colonnade.data_parallel import build_data_parallel
from colonnade.models.build import build_chunks, param_dtype
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.plan import Batch
from colonnade.training.moe import begin_moe_step, end_moe_step, install_moe_state
from colonnade.training.step import mean_loss
from tests.moe.harness import CPU, check_parity, gathered, make_batches, moe_config, reference_run
from tests.parity import train_step

CASES: dict[str, dict[str, Any]] = {
    "dp4-ep2": {"ep": 2, "dp": 4},
    "dp4-ep2-zero1": {"ep": 2, "dp": 4, "zero_stage": 1},
    "dp4-ep2-zero1-no-overlap": {"ep": 2, "dp": 4, "zero_stage": 1, "overlap": False},
    "tp2sp-dp2-ep2-zero1": {"ep": 2, "dp": 2, "tp": 2, "sp": True, "zero_stage": 1},
    "pp2-dp2-ep2-zero1": {"ep": 2, "dp": 2, "pp": 2, "zero_stage": 1},
    "dp2-ep1-gpt2-shared": {"ep": 1, "dp": 2, "arch": "gpt2", "shared": 16},
    "pp2-dense-stage0-dp2-ep2-zero1": {"ep": 2, "dp": 2, "pp": 2, "zero_stage": 1,
                                       "layers": 4, "first_dense": 2},
}


def case_config(case: dict[str, Any]) -> Config:
    """The harness config of ``case`` with small buckets and the overlap switch."""
    args = {k: v for k, v in case.items() if k not in ("overlap", "first_dense")}
    config = moe_config(**args)
    if "first_dense" in case:  # stage 0 of pp2 holds no expert (its norm sum adds 0)
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, moe_first_dense_layers=case["first_dense"]))
    overlap = case.get("overlap", True)
    parallel = dataclasses.replace(config.parallel, bucket_size=2000,
                                   overlap_grad_reduce=overlap, overlap_param_gather=overlap)
    return dataclasses.replace(config, parallel=parallel)


def rank_body(config: Config, step_batches: list[list[Batch]]) -> dict[str, Any]:
    """Train this rank's part as the Trainer does; return what check_parity reads plus the
    step infos, last step's bytes per collective and buffer facts."""
    torch.set_num_threads(1)
    par = config.parallel
    dims = ParallelDims.from_config(par, par.tp * par.cp * int(par.dp or 1) * par.pp)
    groups = ProcessGroups.build(dims, experts=True)
    chunks = build_chunks(config, groups, dtype=param_dtype(config.training.precision))
    install_moe_state(chunks, groups)
    for chunk in chunks:
        chunk.train()
    ddp = build_data_parallel(chunks, config, groups)
    opt = DistributedOptimizer(ddp, config.optim, groups, config.training.steps,
                               config.training.precision)
    m, r = config.training.microbatches or 1, groups.dp_rank
    losses, moe, grads, infos = [], [], {}, []
    for step, batches in enumerate(step_batches):
        if step == len(step_batches) - 1:
            groups.stats.reset()
        mine = batches[r * m:(r + 1) * m]
        begin_moe_step(chunks, groups, opt.loss_scale, len(mine))

        def keep(step: int = step) -> None:
            if step == 0 and par.zero == 0:
                grads.update(gathered(chunks, groups, grads=True))

        step_losses, info = train_step(chunks, ddp, opt, groups, config, step, mine,
                                       before_optim=keep)
        infos.append(info)
        losses.append(mean_loss(step_losses, groups, CPU, mine))
        moe.append(end_moe_step(chunks, config, groups, CPU))
    launched = ddp.launched_in_backward
    ops = {k: v.payload_bytes for k, v in groups.stats.ops.items()}
    ddp.finish_param_gather()
    buffers = ddp.buffers
    owned = sum(hi - lo for lo, hi in ddp.owned_ranges())
    want_owned = sum(b.numel // buffers.count_of(b) for b in ddp.buckets)
    assert groups.expert_dp is not None
    return {"losses": losses, "moe": moe, "grads": grads, "params": gathered(chunks, groups),
            "infos": infos, "ops": ops, "launched": launched, "buckets": len(ddp.buckets),
            "expert_numel": sum(b.numel for b in ddp.buckets if b.expert),
            "dense_numel": sum(b.numel for b in ddp.buckets if not b.expert),
            "owned": owned, "want_owned": want_owned, "state": opt.exp_avg_flat.numel(),
            "edp": groups.expert_dp.size, "dp_cp": groups.dp_cp.size,
            "no_grad_in_buffers": all(p.requires_grad for p in buffers.params)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_model_grads(name: str, run_ranks: Callable[..., list[Any]]) -> None:
    case = CASES[name]
    config = case_config(case)
    batches = make_batches(config)
    ref = reference_run(config, batches)
    par = config.parallel
    results = run_ranks(par.tp * par.pp * int(par.dp or 1), rank_body, config, batches)
    errs = check_parity(results, ref)
    ref_norm = float(torch.sqrt(sum(g.pow(2).sum() for g in ref["grads"].values())))
    zero = case.get("zero_stage", 0) >= 1
    kind = "reduce_scatter" if zero else "all_reduce"
    for res in results:
        norm = res["infos"][0]["grad_norm"]
        assert abs(norm - ref_norm) <= 1e-11 * ref_norm, (norm, ref_norm)
        assert norm > config.optim.clip_grad  # clipping is active
        assert res["no_grad_in_buffers"]
        assert res["expert_numel"] > 0 or "first_dense" in case
        ops, edp = res["ops"], res["edp"]
        assert ops.get(f"dp_cp/{kind}/grad_bucket") == 8 * res["dense_numel"]
        if edp > 1:
            assert ops.get(f"expert_dp/{kind}/expert_grad_bucket") == 8 * res["expert_numel"]
        else:
            assert not any("expert_grad_bucket" in k for k in ops)
        assert res["owned"] == res["want_owned"] == res["state"]
        if zero:  # expert state is 1/edp of the expert buckets, dense 1/(dp x cp)
            assert res["want_owned"] == (res["expert_numel"] // edp
                                         + res["dense_numel"] // res["dp_cp"])
        if case.get("overlap", True) and par.pp == 1:
            assert res["launched"] == res["buckets"]
    if not zero:
        assert "grads" in errs
    if "first_dense" in case:  # one stage without experts, one with
        assert sorted({res["expert_numel"] > 0 for res in results}) == [False, True]


def test_moe_model_bf16(run_ranks: Callable[..., list[Any]]) -> None:
    """bf16 weights with fp32 main gradients (the hook folds each bf16 grad into the expert or
    dense bucket) on dp4 x ep2 with ZeRO-1: losses and the step-0 norm near the float64
    reference (bf16 rounding only), every step taken."""
    config = case_config({"ep": 2, "dp": 4, "zero_stage": 1})
    batches = make_batches(config)
    ref = reference_run(config, batches)
    ref_norm = float(torch.sqrt(sum(g.pow(2).sum() for g in ref["grads"].values())))
    bf16 = dataclasses.replace(config, training=dataclasses.replace(config.training,
                                                                    precision="bf16"))
    for res in run_ranks(4, rank_body, bf16, batches):
        for got, want in zip(res["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= 2e-2 * abs(want), (got, want)
        assert abs(res["infos"][0]["grad_norm"] - ref_norm) <= 5e-2 * ref_norm
        assert [i["skipped"] for i in res["infos"]] == [0.0] * 3
        assert res["ops"]["expert_dp/reduce_scatter/expert_grad_bucket"] == 4 * res[
            "expert_numel"]  # fp32 main gradients
