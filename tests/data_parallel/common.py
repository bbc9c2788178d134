"""Shared pieces of the data-parallel tests: tiny configs, data, the single-process AdamW
reference, and the rank-side training loop through DataParallel + DistributedOptimizer.

The reference is independent of the code under test: the single-process model of the same
config and seed, ``torch.optim.AdamW`` (decay on matrices only), the global batch as
micro-batches accumulated with loss / (microbatches x dp), clipping by the plain L2 norm of all
its gradients. Rank r of dp takes micro-batches [r m, (r + 1) m) of each step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from colonnade.checkpoint.export import full_state
from colonnade.config.sections import Config, OptimConfig, ParallelConfig, TrainingConfig
from colonnade.data_parallel import build_data_parallel
from colonnade.models.build import build_chunks, build_reference, param_dtype
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.plan import Batch
from tests.parity import (
    VOCAB,
    random_steps,
    reference_adamw,
    reference_update,
    resolved,
    tiny_model,
    train_step,
)
from tests.parity import rank_groups as shared_rank_groups


def tiny_config(*, arch: str = "llama", dp: int = 2, tp: int = 1, pp: int = 1, vp: int = 1,
                schedule: str = "1f1b", sp: bool = False,
                zero: bool = False, overlap: bool = True, bucket: int = 10**9,
                zero_stage: int = 0, zero_shard_size: int | None = None,
                grad_reduce_dtype: str = "fp32", recompute: str = "none",
                average_in_collective: bool = False, microbatches: int = 4, steps: int = 3,
                precision: str = "fp64", clip: float = 0.05, lr: float = 1e-2,
                loss_scale: float = 2.0**10, scale_window: int = 1000) -> Config:
    """A resolved, validated config of a tiny model (h=32, max(2, pp x vp) layers, vocab 101,
    seq 16).

    gpt2 ties embeddings and has biases (tied + sp-partial paths); llama has neither.
    """
    model = tiny_model(arch, layers=max(2, pp * vp), hidden=32, heads=4, vocab=VOCAB, seq=16)
    parallel = ParallelConfig(tp=tp, pp=pp, vp=vp, schedule=schedule, dp=dp, sp=sp,
                              use_distributed_optimizer=zero, overlap_grad_reduce=overlap,
                              overlap_param_gather=overlap, bucket_size=bucket,
                              average_in_collective=average_in_collective,
                              zero_stage=zero_stage, zero_shard_size=zero_shard_size,
                              grad_reduce_dtype=grad_reduce_dtype)
    config = Config(
        model=model, parallel=parallel,
        training=TrainingConfig(steps=steps, seq_len=16, micro_batch_size=2,
                                microbatches=microbatches, precision=precision, seed=11,
                                recompute=recompute,
                                eval_interval=0),
        optim=OptimConfig(lr=lr, min_lr=lr / 10, warmup_steps=1, weight_decay=0.1,
                          clip_grad=clip, initial_loss_scale=loss_scale,
                          loss_scale_window=scale_window),
    )
    return resolved(config)


def make_batches(config: Config, seed: int = 5) -> list[list[Batch]]:
    """Per step, every micro-batch of the global batch (microbatches x dp of them)."""
    tr = config.training
    count = (tr.microbatches or 1) * (config.parallel.dp or 1)
    return random_steps(tr.steps, count, tr.micro_batch_size, tr.seq_len, VOCAB, seed=seed)


_REFERENCE: dict[str, dict[str, Any]] = {}


def reference_run(config: Config, step_batches: list[list[Batch]]) -> dict[str, Any]:
    """Single-process float64 AdamW: per-step mean loss and grad norm, final parameters.

    Independent of the parallel layout, so it is computed once per (model, training, optim,
    data) and reused by every layout of the same problem.
    """
    key = repr((config.model, config.training, config.optim,
                [[(t.sum().item(), t.shape) for t, _ in s] for s in step_batches]))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference(config, step_batches)
    return _REFERENCE[key]


def _reference(config: Config, step_batches: list[list[Batch]]) -> dict[str, Any]:
    model = build_reference(config, torch.float64)
    params = list(model.parameters())
    opt = reference_adamw(params, config)
    losses, norms = [], []
    for step, batches in enumerate(step_batches):
        opt.zero_grad()
        total = 0.0
        for tokens, labels in batches:
            loss = model(tokens, labels)
            (loss / len(batches)).backward()
            total += float(loss.detach())
        losses.append(total / len(batches))
        norms.append(float(reference_update(params, opt, config, step)))
    state = {p.sharding.key: p.detach().clone() for p in params}  # type: ignore[attr-defined]
    return {"losses": losses, "norms": norms, "params": state}


def rank_groups(config: Config) -> ProcessGroups:
    """This pool rank's groups for the config's layout (one thread per rank)."""
    par = config.parallel
    return shared_rank_groups(ParallelDims(tp=par.tp, pp=par.pp, dp=par.dp or 1),
                              zero_shard_size=par.zero_shard_size)


def rank_train(config: Config, step_batches: list[list[Batch]],
               inject: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank body: train this rank's shard through DataParallel + DistributedOptimizer.

    ``inject`` = {"step": k, "rank": r, "value": float}: after step k's gradient sync, rank r
    writes ``value`` into the first element of its owned main gradient (a local overflow).
    Returns losses (this rank's micro-batches), step infos, the gathered parameters, the comm
    stats of the last step, buffer facts and overlap evidence.
    """
    groups = rank_groups(config)
    dtype = param_dtype(config.training.precision)
    chunks = build_chunks(config, groups, dtype=dtype)
    ddp = build_data_parallel(chunks, config, groups)
    opt = DistributedOptimizer(ddp, config.optim, groups, config.training.steps,
                               config.training.precision)
    m = config.training.microbatches or 1
    r = groups.dp_rank
    losses: list[list[float]] = []
    infos: list[dict[str, float]] = []
    launched, pending_after_step, pending_after_fb = [], [], []
    for step, batches in enumerate(step_batches):
        if step == len(step_batches) - 1:
            groups.stats.reset()
        mine = batches[r * m:(r + 1) * m]

        def inject_overflow(step: int = step) -> None:
            if inject is not None and inject["step"] == step and inject["rank"] == groups.rank:
                opt.grads[0][0] = inject["value"]

        def overlap_evidence() -> None:
            pending_after_fb.append(ddp.pending_gathers)
            launched.append(ddp.launched_in_backward)

        step_losses, info = train_step(chunks, ddp, opt, groups, config, step, mine,
                                       after_backward=overlap_evidence,
                                       before_optim=inject_overflow)
        losses.append(step_losses)
        infos.append(info)
        pending_after_step.append(ddp.pending_gathers)
    stats = groups.stats.snapshot()
    ddp.finish_param_gather()
    memory = ddp.memory_bytes()  # before the gather below (ZeRO-3's gathered peak)
    if ddp.param_shards is not None:  # ZeRO-3: full weights exist only while gathered
        ddp.param_shards.gather_all()
    return {
        "rank": groups.rank, "dp_rank": r, "losses": losses, "infos": infos,
        "params": {k: v.double() for k, v in full_state(chunks, groups).items()},
        "stats": stats, "numel": ddp.buffers.numel, "num_params": ddp.buffers.num_params,
        "buckets": len(ddp.buckets), "num_tensors": len(ddp.buffers.params),
        "grad_bytes": ddp.buffers.grad_dtype.itemsize,
        "param_bytes": ddp.buffers.param_dtype.itemsize, "launched": launched,
        "pending_after_step": pending_after_step, "pending_after_fb": pending_after_fb,
        "adam_steps": opt.step_count, "state_bytes": opt.state_bytes(),
        "final_scale": opt.loss_scale, "memory": memory,
        "has_grad_data": ddp.buffers.grad_data is not None,
        "bucket_numels": [b.numel for b in ddp.buckets],
    }


def mean_losses(results: list[dict[str, Any]]) -> list[float]:
    """Per-step mean loss over every micro-batch any rank reported (last pp stage only)."""
    steps = len(results[0]["losses"])
    out = []
    for s in range(steps):
        values = [v for res in results for v in res["losses"][s]]
        out.append(sum(values) / len(values))
    return out


def merged_params(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Parameters of every pipeline stage in one dict (dp/tp replicas must agree)."""
    out: dict[str, torch.Tensor] = {}
    for res in results:
        for key, value in res["params"].items():
            if key in out:
                assert torch.equal(out[key], value), f"replicas disagree on {key}"
            out[key] = value
    return out


def with_parallel(config: Config, **changes: Any) -> Config:
    """The config with parallel fields replaced (re-validated)."""
    par = dataclasses.replace(config.parallel, **changes)
    new = dataclasses.replace(config, parallel=par)
    return resolved(new)
