"""The tensor-parallel building blocks on their own, in float64 against plain torch.

* vocab-parallel cross entropy (with and without label smoothing) vs ``F.cross_entropy``: loss
  and gradient, vocabulary 101 padded to a multiple of tp, padded logits filled with large
  garbage to prove they are masked (zero probability, exactly zero gradient);
* ColumnParallelLinear(gather_output=True) and RowParallelLinear(input_is_parallel=False)
  vs the single-process layers, with the collectives they use named;
* the vocabulary padding is logged; GQA with kv heads not divisible by tp is rejected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from colonnade.checkpoint.export import gather_full
from colonnade.config.load import ConfigError
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from colonnade.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab,
)
from colonnade.tensor_parallel.mappings import last_all_gather
from tests.tensor_parallel.harness import TOL, rank_groups, rel_err, tiny_config

V, S, B = 101, 8, 3
SMOOTHING = (0.0, 0.1)


def _logits_and_targets() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [S, B, V], targets [S, B] (the last id included), loss weights [S, B]."""
    gen = torch.Generator().manual_seed(11)
    logits = 3.0 * torch.randn(S, B, V, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, V, (S, B), generator=gen)
    targets[0, 0] = V - 1
    weights = torch.rand(S, B, dtype=torch.float64, generator=gen)
    return logits, targets, weights


def _cross_entropy_rank(tp: int) -> list[dict[str, torch.Tensor]]:
    groups = rank_groups(tp)
    logits, targets, weights = _logits_and_targets()
    pad = padded_vocab(V, tp) - V
    padded = torch.cat([logits, logits.new_full((S, B, pad), 50.0)], dim=-1)  # [S, B, V']
    out = []
    for eps in SMOOTHING:
        local = padded.chunk(tp, dim=-1)[groups.tp_rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, targets, groups.tp, V, eps)  # [S, B]
        (loss * weights).sum().backward()
        assert local.grad is not None
        grad = last_all_gather(local.grad, groups.tp, "test_gather")  # [S, B, V']
        out.append({"loss": loss.detach(), "grad": grad})
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(run_ranks: Callable[..., list[Any]],
                                                    tp: int) -> None:
    logits, targets, weights = _logits_and_targets()
    results = run_ranks(tp, _cross_entropy_rank, tp)
    for i, eps in enumerate(SMOOTHING):
        full = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(full.reshape(-1, V), targets.reshape(-1), reduction="none",
                              label_smoothing=eps).view(S, B)
        (ref * weights).sum().backward()
        assert full.grad is not None
        for rank, res in enumerate(results):
            got = res[i]
            assert rel_err(got["loss"], ref.detach()) <= TOL, f"rank {rank} eps={eps}: loss"
            assert rel_err(got["grad"][..., :V], full.grad) <= TOL, f"rank {rank} eps={eps}: grad"
            assert torch.count_nonzero(got["grad"][..., V:]) == 0, "padded logits got gradient"
    smooth = results[0][1]["loss"]
    assert rel_err(smooth, results[0][0]["loss"]) > 1e-3, "smoothing changed nothing"


def _context(group: CommGroup) -> ParallelContext:
    return ParallelContext(group=group, sp=False, seed=5, rng=RNGTracker(5), dtype=torch.float64)


def _linear_run(group: CommGroup) -> dict[str, torch.Tensor]:
    """gather_output column layer then a row layer fed the full (not parallel) input."""
    ctx = _context(group)
    col = ColumnParallelLinear(12, 8, ctx, "col", bias=True, std=0.3, gather_output=True)
    row = RowParallelLinear(8, 6, ctx, "row", bias=True, std=0.3, input_is_parallel=False)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2, 12, dtype=torch.float64, generator=gen).requires_grad_(True)
    z = torch.randn(5, 2, 8, dtype=torch.float64, generator=gen).requires_grad_(True)
    y, u = col(x), row(z)  # [5, 2, 8], [5, 2, 6]
    assert y.shape == (5, 2, 8) and u.shape == (5, 2, 6)
    (y.pow(2).sum() + (u * torch.linspace(-1, 1, 6, dtype=torch.float64)).sum()).backward()
    out = {"y": y.detach(), "u": u.detach(), "x.grad": x.grad, "z.grad": z.grad}
    for name, layer in (("col", col), ("row", row)):
        for pname, p in layer.named_parameters():
            out[f"{name}.{pname}.grad"] = gather_full(p.grad, p.sharding, group)
    return out


def _linear_rank(tp: int) -> dict[str, Any]:
    groups = rank_groups(tp)
    out = _linear_run(groups.tp)
    return {"values": out, "ops": sorted(groups.stats.ops)}


@pytest.mark.parametrize("tp", [2, 4])
def test_gather_output_and_non_parallel_input(run_ranks: Callable[..., list[Any]],
                                              tp: int) -> None:
    ref = _linear_run(ProcessGroups.single().tp)
    for rank, res in enumerate(run_ranks(tp, _linear_rank, tp)):
        for key, want in ref.items():
            err = rel_err(res["values"][key], want)
            assert err <= TOL, f"rank {rank} {key}: relative error {err:.3e}"
        assert [k for k in res["ops"] if not k.endswith("gather_full")] == [
            "tp/all_gather/gather_last", "tp/all_gather/split_last_bwd",
            "tp/all_reduce/f_bwd", "tp/all_reduce/g_fwd"]


def test_vocab_padding_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    group = CommGroup("tp", [0, 1, 2, 3], None, CommStats(), 0)  # rank 0 of 4; no comm needed
    with caplog.at_level(logging.INFO, logger="colonnade.tensor_parallel.layers"):
        emb = VocabParallelEmbedding(V, 16, _context(group), "embedding.word", std=0.1)
    assert emb.weight.shape == (104 // 4, 16)
    assert "vocab 101 padded to 104 (+3 zero rows) for tp=4" in caplog.text


def test_kv_heads_not_divisible_by_tp_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"num_kv_heads=4 is not divisible by parallel.tp=8"):
        tiny_config("llama", 8, False)
