"""Measured bytes per rank against the planner's ZeRO formulas (colonnade/analysis/memory.py).

A bf16 llama (hidden 64, 4 layers, vocab 512: 279,104 parameters) trains one step at dp 2 and
dp 4 under each ZeRO stage. Each rank then counts the bytes of the unique storages it holds:
parameters (their storages, and the persistent shard at stage 3), gradients (main gradients,
the gradient shard, any ``.grad``), and the optimizer's tensors (fp32 master, m, v); at stages
2 and 3 also DataParallel.memory_bytes()'s peaks of gradient bucket buffers and gathered
parameter buckets. Each must be within 10% of the formula of the same config
(:func:`~colonnade.analysis.memory.memory_per_device`: P (W + G + O) with the stage's sharding,
the bucket and gathered terms). Padding of the shard ranges (< buckets x dp x 64 elements) is
well below 10% here; so is the overshoot of a bucket past ``bucket_size`` (a bucket closes at
the first parameter that reaches it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import stage_memory
from colonnade.config.sections import Config, OptimConfig, ParallelConfig, TrainingConfig
from colonnade.data_parallel import build_data_parallel
from colonnade.models.build import build_chunks, param_dtype
from colonnade.optim.distributed import DistributedOptimizer
from tests.data_parallel.common import rank_groups
from tests.parity import random_steps, resolved, tiny_model, train_step

VOCAB = 512
BUCKET = 53_376
"""Elements per bucket: one layer's parameters (five buckets: the head's, then one layer each,
the last with the embedding)."""


def measured_config(dp: int, stage: int, **parallel_fields: Any) -> Config:
    """The bf16 model at ``dp`` ranks (x pp when given) and ZeRO ``stage``, two
    micro-batches per rank."""
    model = tiny_model("llama", layers=4, hidden=64, heads=4, vocab=VOCAB, seq=16)
    parallel = ParallelConfig(dp=dp, zero_stage=stage, bucket_size=BUCKET, **parallel_fields)
    config = Config(model=model, parallel=parallel,
                    training=TrainingConfig(steps=1, seq_len=16, micro_batch_size=2,
                                            microbatches=2, precision="bf16", seed=3,
                                            eval_interval=0),
                    optim=OptimConfig(lr=1e-3, warmup_steps=1))
    return resolved(config)


def _storages(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (which they are added to)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    """Tensors held by ``obj``'s attributes, directly or in lists / tuples."""
    out: list[torch.Tensor] = []
    for value in vars(obj).values():
        items = value if isinstance(value, list | tuple) else [value]
        out += [v for v in items if isinstance(v, torch.Tensor)]
    return out


def _measure(config: Config) -> dict[str, Any]:
    """Rank body: one training step, then the bytes this rank holds, by kind."""
    groups = rank_groups(config)
    chunks = build_chunks(config, groups, dtype=param_dtype(config.training.precision))
    ddp = build_data_parallel(chunks, config, groups)
    opt = DistributedOptimizer(ddp, config.optim, groups, 1, config.training.precision)
    m, r = config.training.microbatches or 1, groups.dp_rank
    dp = config.parallel.dp or 1
    batches = random_steps(1, m * dp, 2, 16, VOCAB, seed=7)[0][r * m:(r + 1) * m]
    train_step(chunks, ddp, opt, groups, config, 0, batches)
    params = [p for c in chunks for p in c.parameters()]
    seen: set[int] = set()
    stage = config.parallel.zero
    owned_params = ddp.owned_params() if stage >= 2 else []
    out: dict[str, Any] = {"params": _storages([p.data for p in params] + owned_params, seen)}
    grads: list[torch.Tensor | None] = [getattr(p, "main_grad", None) for p in params]
    grads += [p.grad for p in params] + (ddp.owned_grads() if stage >= 2 else [])
    out["grads"] = _storages(grads, seen)
    out["optimizer"] = _storages(_tensors_of(opt), seen)
    if stage >= 2:
        out.update(ddp.memory_bytes())
    pp = config.parallel.pp
    out["stage"] = ("only" if pp == 1 else "first" if groups.is_first_stage
                    else "last" if groups.is_last_stage else "middle")
    return out


def _check(results: list[dict[str, Any]], config: Config) -> None:
    layout = Layout.from_config(config, len(results))
    # With pp 2 a stage holds < 3 buckets: its gradient buffers are all alive at once, and one
    # may be alive twice (in flight for one micro-batch, filling for the next) depending on
    # the schedule's order; the formula's cap (P + B) R + P R / S is then an upper bound (up
    # to the shard padding, < 1%).
    bound_only = {"transient_peak"} if config.parallel.pp > 1 else set()
    for res in results:
        want = stage_memory(Workload.from_config(config), layout, res["stage"])
        pairs = {"params": want.params, "grads": want.grads, "optimizer": want.optimizer}
        if layout.zero >= 2:
            pairs["transient_peak"] = want.grad_buckets
        if layout.zero == 3:
            pairs["gathered_peak"] = want.gathered
        for kind, formula in pairs.items():
            assert formula > 0, kind
            if kind in bound_only:
                assert res[kind] <= 1.01 * formula, (kind, res[kind], formula)
                continue
            assert res[kind] == pytest.approx(formula, rel=0.10), (kind, res[kind], formula)


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage", [0, 1])
def test_stage0_1_bytes_match_the_formula(run_ranks: Callable[..., list[Any]], dp: int,
                                          stage: int) -> None:
    config = measured_config(dp, stage)
    results = run_ranks(dp, _measure, config)
    _check(results, config)
    # the numbers themselves: 279,104 parameters, bf16 weights, fp32 grads, 12 B optimizer
    n, shard = 279_104, dp if stage else 1
    pad = 5 * shard * 64  # < 64 x shard elements per bucket, 5 buckets
    for res in results:
        assert 2 * n <= res["params"] < 2 * (n + pad) and 4 * n <= res["grads"] < 4 * (n + pad)
        assert 12 * n / shard <= res["optimizer"] < 12 * (n + pad) / shard


CASES = [
    (2, 2, {}), (4, 2, {}), (2, 3, {}), (4, 3, {}),
    (2, 2, {"grad_reduce_dtype": "bf16"}),
    (2, 3, {"reshard_after_forward": False}),
    (4, 3, {"zero_prefetch": 2}),
    (4, 3, {"zero_shard_size": 2}),
    (2, 3, {"pp": 2}),
    (2, 2, {"pp": 2}),
]


@pytest.mark.parametrize(("dp", "stage", "fields"), CASES,
                         ids=[f"dp{d}-zero{s}-" + "-".join(f"{k}={v}" for k, v in f.items())
                              for d, s, f in CASES])
def test_stage2_3_bytes_match_the_formula(run_ranks: Callable[..., list[Any]], dp: int,
                                          stage: int, fields: dict[str, Any]) -> None:
    """Measured / formula within 10% (1.00-1.06 for every kind here): the peaks of gradient
    bucket buffers and gathered buckets included."""
    config = measured_config(dp, stage, **fields)
    results = run_ranks(dp * config.parallel.pp, _measure, config)
    _check(results, config)
    if config.parallel.pp == 1 and not config.parallel.reshard:  # the whole model gathered
        n = 279_104  # from the first forward to the gradient sync
        assert all(2 * n <= r["gathered_peak"] < 2 * (n + 5 * dp * 64) for r in results)


