"""The Trainer wired for ZeRO-2/3 (colonnade/training/loop.py): dp2 float64 gpt2 (tied
embedding), 2 micro-batches, 2 steps. Every stage gives the same losses and grad norms as
stage 0 (1e-12 relative), stage 2/3 reduce-scatter every bucket once per micro-batch from a
backward hook, keep no full gradient buffer, and stage 3 gathers parameters."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from colonnade.config.sections import Config, ParallelConfig, TrainingConfig
from colonnade.parallel.dims import ParallelDims
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime
from tests.parity import random_steps, rank_groups, resolved, tiny_model

M = 2
"""Micro-batches per step."""


def _config(stage: int) -> Config:
    par = ParallelConfig(dp=2, zero_stage=stage, bucket_size=2000)
    tr = TrainingConfig(steps=2, seq_len=16, micro_batch_size=2, microbatches=M,
                        precision="fp64", seed=3, eval_interval=0)
    cfg = Config(model=tiny_model("gpt2", layers=2, hidden=32, heads=4, seq=16), parallel=par,
                 training=tr)
    return resolved(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                       clip_grad=0.05)))


def _steps(stage: int) -> dict[str, Any]:
    """Rank side: two Trainer steps; losses, norms and what the last step communicated."""
    groups = rank_groups(ParallelDims(dp=2))
    trainer = Trainer(Runtime(_config(stage), torch.device("cpu"), groups))
    batches = random_steps(2, 2 * M, 2, 16, seed=1)
    out: dict[str, Any] = {"losses": [], "norms": []}
    for step in range(2):
        groups.stats.reset()
        mine = batches[step][M * groups.dp_rank:M * (groups.dp_rank + 1)]
        info = trainer.train_step(mine)
        out["losses"].append(info["loss"])
        out["norms"].append(info["grad_norm"])
    ddp = trainer.ddp
    out.update(calls={k: v["calls"] for k, v in groups.stats.snapshot().items()},
               buckets=len(ddp.buckets), launched=ddp.launched_in_backward,
               grad_data=ddp.buffers.grad_data is not None, memory=ddp.memory_bytes(),
               numel=ddp.buffers.numel)
    return out


def test_trainer_zero_stages_agree(run_ranks: Callable[..., list[Any]]) -> None:
    runs = {stage: run_ranks(2, _steps, stage) for stage in (0, 2, 3)}
    want = runs[0][0]
    for stage in (2, 3):
        for res in runs[stage]:
            for got, ref in zip(res["losses"] + res["norms"], want["losses"] + want["norms"],
                                strict=True):
                assert abs(got - ref) <= 1e-12 * abs(ref), (stage, got, ref)
            assert not res["grad_data"]
            assert res["launched"] == M * res["buckets"] > M
            assert res["calls"]["dp_cp/reduce_scatter/grad_shard"] == M * res["buckets"]
            assert res["memory"]["grads"] * 2 == res["numel"] * 8
            gathers = res["calls"].get("dp_cp/all_gather/param_shard", 0)
            if stage == 3:  # reshard_after_forward (pp = 1): forward and backward gathers
                assert gathers >= M * res["buckets"], gathers
                assert res["memory"]["params"] * 2 == res["numel"] * 8
            else:
                assert gathers == 0
                assert res["calls"]["dp_cp/all_gather/param_bucket"] == res["buckets"]
