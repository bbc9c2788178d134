"""Context-parallel parity harness: tiny cp configs, data with masked labels and document
boundaries, the single-process float64 ``torch.optim.AdamW`` reference, and the rank body.

Reference (independent of the code under test): the single-process model of the same config
and seed (:func:`~colonnade.models.build.build_reference`), each micro-batch's summed loss
divided by N, the valid labels of the whole global batch (the token-level mean of
:mod:`colonnade.pipeline.plan`), gradients clipped by their plain L2 norm, AdamW with decay on
matrices only. Dropout masks come from the tracker set to (step, global micro-batch k).

Parallel side: every rank of a tp x cp x dp x pp layout builds its chunks, takes micro-batches
[r m, (r + 1) m) of each step (r its dp rank; the cp ranks of one dp index read the same FULL
micro-batches, the model takes its zigzag rows) and trains through DataParallel +
DistributedOptimizer; the step's loss is :func:`~colonnade.training.step.mean_loss`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from colonnade.checkpoint.export import full_state
from colonnade.config.sections import Config, OptimConfig, ParallelConfig, TrainingConfig
from colonnade.data_parallel import build_data_parallel
from colonnade.models.blocks import DocReset
from colonnade.models.build import build_chunks, build_reference
from colonnade.models.compile import compiled_layers
from colonnade.models.gpt import valid_tokens
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.dims import ParallelDims
from colonnade.pipeline.plan import Batch
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX
from colonnade.training.step import mean_loss
from tests.parity import (
    VOCAB,
    random_steps,
    rank_groups,
    reference_adamw,
    reference_update,
    rel_err,
    resolved,
    tiny_model,
    train_step,
)

EOD = 7
"""Token id that ends a document in the document-reset cases."""


def cp_config(*, arch: str = "llama", cp: int = 2, tp: int = 1, pp: int = 1, vp: int = 1,
              dp: int = 1, sp: bool = False, schedule: str = "1f1b",
              cp_attention: str = "ring", cp_overlap: bool = True, zero_stage: int = 0,
              cp_a2a_size: int | None = None, zero_shard_size: int | None = None,
              recompute: str = "none", dropout: float = 0.0,
              attention_dropout: float | None = None, kv_heads: int | None = None,
              seq: int = 16, microbatches: int = 2, steps: int = 3,
              compile: bool = False, tp_comm_chunks: int = 1) -> Config:
    """A resolved, validated config of a tiny model (h = 32, 4 heads, max(2, pp x vp)
    layers, vocab 101, micro-batch 2) for tp x cp x dp x pp ranks (``cp_a2a_size`` with
    cp_attention='hierarchical'; ZeRO-2/3: buckets of 2000 elements, so that a layer spans
    several)."""
    model = tiny_model(arch, layers=max(2, pp * vp), kv_heads=kv_heads, seq=seq,
                       dropout=dropout, attention_dropout=attention_dropout)
    parallel = ParallelConfig(tp=tp, cp=cp, pp=pp, vp=vp, dp=dp, sp=sp, schedule=schedule,
                              cp_attention=cp_attention, cp_overlap=cp_overlap,
                              cp_a2a_size=cp_a2a_size, zero_stage=zero_stage,
                              zero_shard_size=zero_shard_size,
                              bucket_size=2000 if zero_stage > 1 else 40_000_000,
                              tp_comm_chunks=tp_comm_chunks)
    training = TrainingConfig(steps=steps, seq_len=seq, micro_batch_size=2,
                              microbatches=microbatches, precision="fp64", seed=11,
                              recompute=recompute, eval_interval=0, compile=compile)
    optim = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1, clip_grad=0.05)
    config = Config(model=model, parallel=parallel, training=training, optim=optim)
    return resolved(config, tp * cp * dp * pp)


def make_batches(config: Config, *, masked: bool = False, docs: bool = False,
                 seed: int = 5) -> list[list[Batch]]:
    """Per step, the global batch's micro-batches (microbatches x dp of them).

    ``masked``: some labels are ``IGNORE_INDEX`` (a run at the start of micro-batch 0's first
    row, most of micro-batch 1 and every third label of the last one), so the micro-batches
    hold different numbers of valid tokens. ``docs``: EOD tokens at a few positions of
    every row (documents cross the cp chunk boundaries).
    """
    tr = config.training
    count = (tr.microbatches or 1) * (config.parallel.dp or 1)
    steps = random_steps(tr.steps, count, tr.micro_batch_size, tr.seq_len, VOCAB, seed=seed)
    s = tr.seq_len
    for batches in steps:
        for k, (tokens, labels) in enumerate(batches):
            tokens[tokens == EOD] = EOD + 1
            if docs:
                tokens[0, [s // 4, s // 2 + 1, s - 3]] = EOD
                tokens[1, [3, s // 2 - 1]] = EOD
            if masked and k == 0:
                labels[0, : s // 3] = IGNORE_INDEX
            if masked and k == 1:
                labels[:, 2:] = IGNORE_INDEX
            if masked and k == count - 1 and k > 1:
                labels[:, ::3] = IGNORE_INDEX
    return steps


_REFERENCE: dict[str, dict[str, Any]] = {}


def reference_run(config: Config, step_batches: list[list[Batch]],
                  doc_reset: DocReset | None = None) -> dict[str, Any]:
    """Single-process float64 AdamW: per-step global token-mean loss, final parameters
    (cached per model, training, optim, data and resets: every layout reuses it)."""
    key = repr((config.model, dataclasses.replace(config.training, compile=False),
                config.optim, doc_reset,
                [[(t.sum().item(), lab.sum().item()) for t, lab in s] for s in step_batches]))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference(config, step_batches, doc_reset)
    return _REFERENCE[key]


def _reference(config: Config, step_batches: list[list[Batch]],
               doc_reset: DocReset | None) -> dict[str, Any]:
    model = build_reference(config, torch.float64)
    model.doc_reset = doc_reset
    model.train()
    params = list(model.parameters())
    opt = reference_adamw(params, config)
    losses = []
    for step, batches in enumerate(step_batches):
        opt.zero_grad()
        n = max(int(sum(valid_tokens(lab) for _, lab in batches)), 1)
        total = 0.0
        for k, (tokens, labels) in enumerate(batches):
            model.ctx.rng.set_context(step, k)
            loss = model(tokens, labels, reduction="sum")
            (loss / n).backward()
            total += float(loss.detach())
        losses.append(total / n)
        reference_update(params, opt, config, step)
    state = {p.sharding.key: p.detach().clone() for p in params}  # type: ignore[attr-defined]
    return {"losses": losses, "params": state}


def rank_train(config: Config, step_batches: list[list[Batch]],
               doc_reset: DocReset | None = None) -> dict[str, Any]:
    """Rank body: train this rank's part of the layout; returns the step losses
    (:func:`mean_loss`, the same on every rank), this rank's gathered parameters and the
    bytes its cp group moved in the last step."""
    par = config.parallel
    dims = ParallelDims(tp=par.tp, cp=par.cp, dp=par.dp or 1, pp=par.pp, vp=par.vp)
    groups = rank_groups(dims, par.cp_a2a_size, par.zero_shard_size)
    chunks = build_chunks(config, groups, dtype=torch.float64)
    for chunk in chunks:
        chunk.doc_reset = doc_reset
        chunk.train()
    ddp = build_data_parallel(chunks, config, groups)
    opt = DistributedOptimizer(ddp, config.optim, groups, config.training.steps,
                               config.training.precision)
    m, r = config.training.microbatches or 1, groups.dp_rank
    losses = []
    for step, batches in enumerate(step_batches):
        if step == len(step_batches) - 1:
            groups.stats.reset()
        mine = batches[r * m:(r + 1) * m]
        step_losses, _ = train_step(chunks, ddp, opt, groups, config, step, mine)
        losses.append(mean_loss(step_losses, groups, torch.device("cpu"), mine))
    stats = groups.stats.snapshot()
    ddp.finish_param_gather()
    params = full_state(chunks, groups, ddp)
    return {"rank": groups.rank, "losses": losses, "stats": stats,
            "compiled": compiled_layers(chunks),
            "params": {k: v.double() for k, v in params.items()}}


def merged_params(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Parameters of every pipeline stage in one dict (replicas must agree to 1e-13:
    the cp and dp replicas of a weight are updated from the same reduced gradient)."""
    out: dict[str, torch.Tensor] = {}
    for res in results:
        for key, value in res["params"].items():
            if key in out:
                err = float((out[key] - value).norm()) / max(float(value.norm()), 1e-30)
                assert err < 1e-13, f"replicas disagree on {key}: {err:.3e}"
            out[key] = value
    return out


FLOOR = 1e-3
"""Relative-error floor for parameters (attention's k bias has an exactly zero gradient, so it
stays at its zero initial value up to rounding)."""


def param_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest relative error (floored at :data:`FLOOR`) over the same-named parameters."""
    assert sorted(got) == sorted(want), f"names differ: {sorted(set(got) ^ set(want))}"
    return max(rel_err(got[k], ref, FLOOR) for k, ref in want.items())
