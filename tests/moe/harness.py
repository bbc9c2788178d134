"""Mixture-of-experts parity harness: tiny MoE configs, the single-process float64 reference
and the rank body, both through the training step's MoE hooks (:mod:`colonnade.training.moe`).

Reference (the single-process model of the same config and seed,
:func:`~colonnade.models.build.build_reference`): micro-step j of a step is the dp
micro-batches that the dp ranks run as their j-th, CONCATENATED into one micro-batch of
b x dp samples (the contract: a 'global' aux loss counts every dp rank's tokens of the
micro-step; for 'seq' and for the cross entropy the concatenation changes nothing). Each
micro-step's summed loss is divided by N (the global batch's valid labels), the aux losses
reach the gradients with scale 1 / m (m micro-steps), gradients are clipped by their plain L2
norm, ``torch.optim.AdamW`` (decay on matrices only) updates, then the sigmoid routers' bias
moves by the step's loads.

Parallel side: every rank of a tp x cp x dp x pp layout with ep folded inside builds its
chunks, takes micro-batches [r m, (r + 1) m) of each step (r its dp rank), and trains through
DataParallel + DistributedOptimizer with :func:`begin_moe_step` / :func:`end_moe_step` around
the step, as the Trainer does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from colonnade.checkpoint.export import full_state, gather_full
from colonnade.config.sections import Config, OptimConfig, ParallelConfig, TrainingConfig
from colonnade.data_parallel import build_data_parallel
from colonnade.data_parallel.ddp import DataParallel
from colonnade.models.build import build_chunks, build_reference, param_dtype
from colonnade.models.gpt import ModelChunk, valid_tokens
from colonnade.models.params import unique_params
from colonnade.moe.router import Router
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.plan import Batch
from colonnade.tensor_parallel.sharding import Sharding
from colonnade.training.moe import begin_moe_step, end_moe_step, install_moe_state
from colonnade.training.step import mean_loss
from tests.parity import (
    VOCAB,
    random_steps,
    reference_adamw,
    reference_update,
    rel_err,
    resolved,
    tiny_model,
    train_step,
)

EXPERTS = 4
"""Routed experts per MoE layer in every parity case."""
CPU = torch.device("cpu")


def moe_config(*, arch: str = "llama", ep: int = 2, etp: int = 1, tp: int = 1, cp: int = 1,
               pp: int = 1, vp: int = 1,
               dp: int | None = None, sp: bool = False, schedule: str = "1f1b",
               dispatcher: str = "all_to_all", capacity: float | None = None,
               router: str = "softmax", top_k: int = 2, aux: float = 0.01,
               aux_type: str = "global", z_loss: float = 1e-3, bias_rate: float = 1e-3,
               shared: int = 0, zero_stage: int = 0, zero_shard_size: int | None = None,
               microbatches: int = 2,
               steps: int = 3, layers: int | None = None, precision: str = "fp64",
               recompute: str = "none") -> Config:
    """A resolved, validated config of a tiny MoE model (h = 32, 4 heads, 4 experts of width
    32, every layer MoE, vocab 101, seq 16, micro-batch 2) on tp x cp x dp x pp ranks (dp
    default: max(ep etp / (tp cp), 1)); ep x etp (expert tp) folds inside tp x cp x dp."""
    dp = dp if dp is not None else max(ep * etp // (tp * cp), 1)
    model = dataclasses.replace(
        tiny_model(arch, layers=layers or max(2, pp * vp)), num_experts=EXPERTS,
        moe_top_k=top_k, moe_ffn_hidden_size=32, moe_router=router,
        moe_router_bias_update_rate=bias_rate, moe_aux_loss_coeff=aux,
        moe_aux_loss_type=aux_type, moe_z_loss_coeff=z_loss, moe_capacity_factor=capacity,
        moe_shared_expert_ffn_hidden_size=shared)
    parallel = ParallelConfig(tp=tp, cp=cp, pp=pp, vp=vp, dp=dp, sp=sp, schedule=schedule, ep=ep,
                              expert_tp=etp, moe_dispatcher=dispatcher, zero_stage=zero_stage,
                              zero_shard_size=zero_shard_size,
                              use_distributed_optimizer=zero_stage >= 1)
    training = TrainingConfig(steps=steps, seq_len=16, micro_batch_size=2,
                              microbatches=microbatches, precision=precision, seed=11,
                              recompute=recompute, eval_interval=0)
    optim = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1, clip_grad=0.05)
    config = Config(model=model, parallel=parallel, training=training, optim=optim)
    return resolved(config, tp * cp * dp * pp)


def world_size(config: Config) -> int:
    """Ranks of the config's layout: tp x cp x dp x pp (ep folds inside)."""
    par = config.parallel
    return par.tp * par.cp * int(par.dp or 1) * par.pp


def make_batches(config: Config, seed: int = 5) -> list[list[Batch]]:
    """Per step, the global batch's micro-batches (microbatches x dp of them)."""
    tr = config.training
    count = (tr.microbatches or 1) * int(config.parallel.dp or 1)
    return random_steps(tr.steps, count, tr.micro_batch_size, tr.seq_len, VOCAB, seed=seed)


def starve_last_expert(chunks: list[ModelChunk], count: int = 1) -> None:
    """Make the last ``count`` experts receive no token at initialisation under top-1
    routing: their router rows become the mean of the others' (their logits are then the mean
    of theirs, below their largest). Run before the data-parallel buffers are built."""
    with torch.no_grad():
        for module in _routers(chunks):
            module.weight[-count:].copy_(module.weight[:-count].mean(0))


def starve_built(chunks: list[ModelChunk], ddp: DataParallel, count: int) -> None:
    """:func:`starve_last_expert` on a model already in its data-parallel buffers: in place,
    or under ZeRO-3 (parameters built from their recipes, only shards kept) into the owned
    pieces of the persistent shard, computed from the gathered router weights."""
    shards = ddp.param_shards
    if shards is None:
        starve_last_expert(chunks, count)
        return
    shards.gather_all()
    wanted: dict[int, torch.Tensor] = {}
    for module in _routers(chunks):
        weight = module.weight.detach().clone()  # [E, h], replicated over tp
        weight[-count:] = weight[:-count].mean(0)
        wanted[id(module.weight)] = weight.reshape(-1)
    shards.free_all()
    with torch.no_grad():
        for p, lo, hi, values in ddp.owned_param_segments():
            if id(p) in wanted:
                values.copy_(wanted[id(p)][lo:hi])


def _routers(chunks: list[ModelChunk]) -> list[Router]:
    return [m for c in chunks for m in c.modules() if isinstance(m, Router)]


# ----------------------------------------------------------------------------- reference


_REFERENCE: dict[str, dict[str, Any]] = {}


def reference_run(config: Config, step_batches: list[list[Batch]],
                  starve: int = 0) -> dict[str, Any]:
    """Single-process float64 AdamW (cached per model, training, optim, data): per-step
    token-mean loss and MoE log fields, step 0's gradients before clipping, final parameters
    (expert_bias included)."""
    key = repr((config.model, config.training, config.optim, config.parallel.dp, starve,
                [[(t.sum().item(), lab.sum().item()) for t, lab in s] for s in step_batches]))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference(config, step_batches, starve)
    return _REFERENCE[key]


def _micro_steps(batches: list[Batch], dp: int) -> list[Batch]:
    """The dp ranks' j-th micro-batches concatenated, for each j (rank r runs [r m, (r+1) m))."""
    m = len(batches) // dp
    return [(torch.cat([batches[r * m + j][0] for r in range(dp)]),
             torch.cat([batches[r * m + j][1] for r in range(dp)])) for j in range(m)]


def _reference(config: Config, step_batches: list[list[Batch]], starve: int
               ) -> dict[str, Any]:
    model = build_reference(config, torch.float64)
    if starve:
        starve_last_expert([model], starve)
    single = ProcessGroups.single()
    install_moe_state([model], single)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = reference_adamw(params, config)
    losses, moe, grads = [], [], {}
    for step, batches in enumerate(step_batches):
        micro = _micro_steps(batches, int(config.parallel.dp or 1))
        opt.zero_grad()
        begin_moe_step([model], single, 1.0, len(micro))
        n = max(int(sum(valid_tokens(lab) for _, lab in micro)), 1)
        total = 0.0
        for tokens, labels in micro:
            loss = model(tokens, labels, reduction="sum")
            (loss / n).backward()
            total += float(loss.detach())
        losses.append(total / n)
        if step == 0:
            grads = {p.sharding.key: p.grad.detach().clone()  # type: ignore[attr-defined]
                     for p in params}
        reference_update(params, opt, config, step)
        moe.append(end_moe_step([model], config, single, CPU))
    state = {p.sharding.key: p.detach().clone()  # type: ignore[attr-defined]
             for p in model.parameters()}
    return {"losses": losses, "moe": moe, "grads": grads, "params": state}


# ----------------------------------------------------------------------------- ranks


def gather_tensor(t: torch.Tensor, sharding: Sharding, groups: ProcessGroups) -> torch.Tensor:
    """The full tensor of a parameter (or gradient) shard: over expert tp and ep for an expert
    weight, else over tp (:func:`~colonnade.checkpoint.export.gather_full`)."""
    return gather_full(t, sharding, groups.tp, groups.ep, groups.expert_tp).double()


def gathered(chunks: list[nn.Module], groups: ProcessGroups,
             grads: bool = False) -> dict[str, torch.Tensor]:
    """Full parameters (or gradients of the trained ones) of this rank's chunks, by name."""
    out: dict[str, torch.Tensor] = {}
    for p in unique_params(chunks):
        if grads and not p.requires_grad:
            continue
        t = p.grad if grads else p
        key = p.sharding.key  # type: ignore[attr-defined]
        if t is None:
            raise AssertionError(f"{key} has no gradient")
        out[key] = gather_tensor(t, p.sharding, groups)  # type: ignore[attr-defined]
    return out


def rank_train(config: Config, step_batches: list[list[Batch]],
               starve: int = 0) -> dict[str, Any]:
    """Rank body: train this rank's part; returns per-step losses (:func:`mean_loss`) and
    MoE log fields (the same on every rank), step 0's gathered gradients (float64; with ZeRO
    assembled from the shards: :func:`sharded_grads`), the gathered parameters after the last
    step and the step's comm stats (the last step's)."""
    torch.set_num_threads(1)
    par = config.parallel
    dims = ParallelDims.from_config(par, world_size(config))
    groups = ProcessGroups.build(dims, experts=True, zero_shard_size=par.zero_shard_size)
    chunks = build_chunks(config, groups, dtype=param_dtype(config.training.precision))
    install_moe_state(chunks, groups)
    for chunk in chunks:
        chunk.train()
    ddp = build_data_parallel(chunks, config, groups)
    if starve:
        starve_built(chunks, ddp, starve)
    opt = DistributedOptimizer(ddp, config.optim, groups, config.training.steps,
                               config.training.precision)
    m, r = config.training.microbatches or 1, groups.dp_rank
    losses, moe, grads = [], [], {}
    for step, batches in enumerate(step_batches):
        mine = batches[r * m:(r + 1) * m]
        begin_moe_step(chunks, groups, opt.loss_scale, len(mine))

        def keep_grads(step: int = step) -> None:
            if step == 0 and config.training.precision == "fp64":
                grads.update(sharded_grads(ddp, groups) if ddp.sharded
                             else gathered(chunks, groups, grads=True))

        if step == len(step_batches) - 1:
            groups.stats.reset()

        step_losses, _ = train_step(chunks, ddp, opt, groups, config, step, mine,
                                    before_optim=keep_grads)
        losses.append(mean_loss(step_losses, groups, CPU, mine))
        moe.append(end_moe_step(chunks, config, groups, CPU))
    stats = groups.stats.snapshot()
    ddp.finish_param_gather()
    params = full_state(chunks, groups, ddp)  # ZeRO-3: one tensor at a time from the shards
    return {"rank": groups.rank, "losses": losses, "moe": moe, "grads": grads,
            "params": {k: v.double() for k, v in params.items()}, "stats": stats,
            "expert_buckets": sum(b.expert for b in ddp.buckets)}


def sharded_grads(ddp: DataParallel, groups: ProcessGroups) -> dict[str, torch.Tensor]:
    """ZeRO: every trained parameter's full reduced gradient, by name: this rank's owned
    pieces placed into zeros, summed over each bucket's shard group (the pieces are disjoint
    there; hybrid replicas hold copies and are not summed), then gathered over tp / ep."""
    buffers = ddp.buffers
    local = {id(p): torch.zeros(p.numel(), dtype=torch.float64) for p in buffers.params}
    for (lo, hi), grad in zip(ddp.owned_ranges(), ddp.owned_grads(), strict=True):
        for p, a, b in buffers.segments(lo, hi):
            start = buffers.slot(p).start
            local[id(p)][a - start:b - start] = grad[a - lo:b - lo]
    for bucket in ddp.buckets:  # bucket order: the same on every rank of the group
        flat = torch.cat([local[id(p)] for p in bucket.params])  # [bucket params]
        ddp.shard_groups.shard(bucket).all_reduce(flat, name="test_grads")
        for p, part in zip(bucket.params, flat.split([p.numel() for p in bucket.params]),
                           strict=True):
            local[id(p)] = part
    return {p.sharding.key: gather_tensor(local[id(p)].view(p.shape), p.sharding, groups)  # type: ignore[attr-defined]
            for p in buffers.params}


# ----------------------------------------------------------------------------- checks


FLOOR = 1e-3
"""Relative-error floor for parameters and gradients (a tensor that is exactly zero in the
reference holds rounding noise on both sides)."""


def merged(results: list[dict[str, Any]], what: str) -> dict[str, torch.Tensor]:
    """Every rank's ``what`` ('params' or 'grads') in one dict (replicas agree to 1e-13)."""
    out: dict[str, torch.Tensor] = {}
    for res in results:
        for key, value in res[what].items():
            if key in out:
                err = rel_err(value, out[key], 1e-30)
                assert err < 1e-13, f"replicas disagree on {what} {key}: {err:.3e}"
            out[key] = value
    return out


def worst_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest relative error (floored at :data:`FLOOR` x the largest reference norm)."""
    assert sorted(got) == sorted(want), f"names differ: {sorted(set(got) ^ set(want))}"
    floor = FLOOR * max(float(t.double().norm()) for t in want.values())
    return max(rel_err(got[k], ref, floor) for k, ref in want.items())


def check_parity(results: list[dict[str, Any]], ref: dict[str, Any],
                 tol: float = 1e-10) -> dict[str, float]:
    """Assert every rank's losses and MoE fields equal the reference's (loads and drops
    exactly, aux losses to ``tol``), and the gathered gradients (step 0) and final parameters
    to ``tol``; returns the worst errors."""
    errs = {"loss": 0.0, "aux": 0.0}
    for res in results:
        for got, want in zip(res["losses"], ref["losses"], strict=True):
            errs["loss"] = max(errs["loss"], abs(got - want) / abs(want))
        for got, want in zip(res["moe"], ref["moe"], strict=True):
            assert got["moe_load"] == want["moe_load"], (got["moe_load"], want["moe_load"])
            for key, value in want.items():
                if key.endswith(("load_balance", "z_loss", "dropped_frac", "load_max_mean")):
                    err = abs(got[key] - value) / max(abs(value), 1e-30)
                    errs["aux"] = max(errs["aux"], err if value else abs(got[key]))
    if ref["grads"] and all(res["grads"] for res in results):
        errs["grads"] = worst_error(merged(results, "grads"), ref["grads"])
    errs["params"] = worst_error(merged(results, "params"), ref["params"])
    for what, err in errs.items():
        assert err <= tol, f"{what}: relative error {err:.3e} > {tol:g} ({errs})"
    return errs
