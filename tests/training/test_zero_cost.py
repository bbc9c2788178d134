"""A parallel feature that is off costs nothing: at tp = dp = pp = 1 a Trainer step registers
no gradient hook, enters no collective of :class:`CommGroup` (spied on the class, so even a
size-1 early return would be seen) and reads the device from the host a fixed, small number of
times per step (no per-parameter or per-micro-batch reads); at dp = 2 the hooks and the bucketed
reductions are there. The float64 numbers of such a step are the parity tests' business
(tests/reference, tests/data_parallel); here the loss is checked finite and equal across
repeats."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from colonnade.config.sections import Config, ParallelConfig, TrainingConfig
from colonnade.parallel.comm import CommGroup
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime
from tests.parity import random_steps, rank_groups, resolved, tiny_model

COLLECTIVES = ("all_reduce", "all_gather_into", "reduce_scatter_into", "all_to_all",
               "broadcast", "all_gather_object", "barrier", "p2p")
"""Every communicating method of CommGroup."""
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")
"""Tensor methods that copy a value to the host (a device sync on a GPU)."""
MAX_HOST_READS = 1
"""Per step at dp = 1 with clipping off: the gradient norm (NaN check), with the step's loss
riding on it (tests/training/test_sync_points.py counts every kind of sync exactly).
Independent of the number of parameters and of micro-batches."""


def _config(dp: int, microbatches: int, zero: bool = False) -> Config:
    par = ParallelConfig(dp=dp, use_distributed_optimizer=zero)
    tr = TrainingConfig(steps=4, seq_len=16, micro_batch_size=2, microbatches=microbatches,
                        precision="fp32", seed=3, eval_interval=0)
    cfg = Config(model=tiny_model("gpt2", layers=2, hidden=32, heads=4, seq=16), parallel=par,
                 training=tr)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, clip_grad=0.0))
    return resolved(cfg)


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts of CommGroup collectives, gradient-hook registrations and host reads."""
    counts: dict[str, int] = {}

    def spy(owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[key] = counts.get(key, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in COLLECTIVES:
        spy(CommGroup, name, f"comm.{name}")
    spy(torch.Tensor, "register_post_accumulate_grad_hook", "hook")
    for name in HOST_READS:
        spy(torch.Tensor, name, f"host.{name}")
    yield counts


def _total(counts: dict[str, int], prefix: str) -> int:
    return sum(v for k, v in counts.items() if k.startswith(prefix))


@pytest.mark.parametrize("microbatches", [1, 3])
def test_single_process_step_has_no_hooks_no_collectives(spies: dict[str, int],
                                                        microbatches: int) -> None:
    """tp = dp = pp = 1, fp32: building and stepping a Trainer registers no hook and calls no
    collective; host reads per step stay at MAX_HOST_READS whatever the micro-batch count."""
    cfg = _config(1, microbatches)
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), ProcessGroups.single()))
    assert not trainer.ddp.hooked and spies.get("hook", 0) == 0
    params = [p for c in trainer.chunks for p in c.parameters()]
    assert params and all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in params)
    batches = random_steps(2, microbatches, 2, 16, seed=1)
    losses = []
    for step in range(2):
        before = _total(spies, "host.")
        losses.append(trainer.train_step(batches[step])["loss"])
        reads = _total(spies, "host.") - before
        assert 0 < reads <= MAX_HOST_READS, (step, dict(spies))
    assert _total(spies, "comm.") == 0, dict(spies)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[0] != losses[1]  # the update changed the model
    # no flat gradient buffer: the optimizer read autograd's own gradients, nothing copied
    assert trainer.ddp.direct_grads and trainer.ddp.buffers.grad_data is None
    assert all(p.grad is not None and not hasattr(p, "main_grad") for p in params)


def _dp2_step(zero: bool) -> dict[str, Any]:
    """Rank side: one Trainer step at dp = 2; hooks, buckets and the comm stats it left."""
    cfg = _config(2, 2, zero)
    groups = rank_groups(ParallelDims(dp=2))
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    hooks = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                for c in trainer.chunks for p in c.parameters())
    batches = random_steps(1, 4, 2, 16, seed=1)[0][2 * groups.dp_rank:2 * groups.dp_rank + 2]
    groups.stats.reset()
    loss = trainer.train_step(batches)["loss"]
    return {"hooked": trainer.ddp.hooked, "hooks": hooks, "params": len(trainer.ddp.buffers.params),
            "buckets": len(trainer.ddp.buckets), "loss": loss,
            "launched": trainer.ddp.launched_in_backward,
            "calls": {k: v["calls"] for k, v in groups.stats.snapshot().items()}}


@pytest.mark.parametrize("zero", [False, True], ids=["ddp", "zero1"])
def test_dp2_step_has_hooks_and_bucket_reductions(run_ranks: Callable[..., list[Any]],
                                                  zero: bool) -> None:
    """dp = 2: one hook per parameter, every bucket reduced from a hook during backward, the
    loss divisor and the logged loss all-reduced; ZeRO-1 also gathers every bucket."""
    results = run_ranks(2, _dp2_step, zero)
    assert results[0]["loss"] == results[1]["loss"]
    for res in results:
        assert res["hooked"] and res["hooks"] == res["params"] > 0
        assert res["launched"] == res["buckets"] >= 1
        calls = res["calls"]
        op = "reduce_scatter" if zero else "all_reduce"
        assert calls[f"dp_cp/{op}/grad_bucket"] == res["buckets"]
        assert calls["dp_cp/all_reduce/loss_tokens"] == 1
        assert calls["world/all_reduce/log_loss"] == 1
        assert calls.get("dp_cp/all_gather/param_bucket", 0) == (res["buckets"] if zero else 0)
