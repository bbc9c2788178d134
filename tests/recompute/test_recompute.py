"""Recomputation changes no number: float64 gradients with each mode equal those without.

Dropout (hidden and attention) is on in every run and the backwards run while the tracker
points at another micro-batch (GPipe order at pp = 1, the executor's schedules at pp > 1), so
only a recomputation that restores each micro-batch's dropout context passes; the negative
control (checkpointing without that restoration) shows the test can fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.config.choices import schedule_placement
from colonnade.config.sections import TrainingConfig
from colonnade.models.build import build_chunks
from colonnade.models.checkpointing import checkpoint
from colonnade.models.recompute import FullRecompute, RecomputePlan
from colonnade.models.stages import locate
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from tests.recompute.harness import MODES, compare_modes, tiny_config, with_recompute

EXACT = 1e-12


def _check(errors: dict[str, float], who: str, control: bool = False) -> None:
    assert errors["loss_spread"] > 1e-3, f"{who}: micro-batches give equal losses (vacuous)"
    for name, err in errors.items():
        if name in ("loss_spread", "control"):
            continue
        assert err <= EXACT, f"{who} {name}: gradient relative error {err:.3e} > {EXACT:g}"
    if control:
        assert errors["control"] > 1e-3, (
            f"{who}: recomputing without the dropout context matched too "
            f"({errors['control']:.3e}); the test would not catch a lost RNG context")


# ----------------------------------------------------------------------------- plans


def test_blocks_uniform_and_block() -> None:
    assert RecomputePlan("full", "uniform", 2).blocks(5) == [
        (0, 2, True), (2, 4, True), (4, 5, True)]
    assert RecomputePlan("full", "block", 2).blocks(5) == [
        (0, 1, True), (1, 2, True), (2, 5, False)]
    assert RecomputePlan("full", "block", 7).blocks(3) == [(0, 1, True), (1, 2, True),
                                                           (2, 3, True)]
    assert RecomputePlan("selective").blocks(3) == [(0, 3, False)]
    assert RecomputePlan("full", "uniform", 2).checkpointed_blocks(5) == 3
    assert RecomputePlan("full", "block", 2).checkpointed_blocks(5) == 2
    assert RecomputePlan("none").checkpointed_blocks(5) == 0


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"mode": "partial"}, "training.recompute"),
    ({"mode": "full", "method": "every"}, "training.recompute_method"),
    ({"mode": "full", "num_layers": 0}, "training.recompute_num_layers"),
])
def test_bad_plan_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RecomputePlan(**kwargs)


def test_build_chunks_installs_the_configured_plan() -> None:
    base = tiny_config(pp=1, layers=3, dropout=0.0)
    (chunk,) = build_chunks(with_recompute(base, "full", "block", 2), ProcessGroups.single(),
                            dtype=torch.float64)
    assert isinstance(chunk.layer_runner, FullRecompute)
    assert chunk.layer_runner.plan == RecomputePlan("full", "block", 2)
    assert not any(layer.attn.recompute_core for layer in chunk.layers.values())
    (chunk,) = build_chunks(with_recompute(base, "selective"), ProcessGroups.single(),
                            dtype=torch.float64)
    assert chunk.layer_runner is None
    assert all(layer.attn.recompute_core for layer in chunk.layers.values())
    assert RecomputePlan.from_config(TrainingConfig()) == RecomputePlan("none", "uniform", 1)


def test_checkpoint_restores_the_dropout_context() -> None:
    """The recomputation sees the forward's (step, micro-batch); the current one is kept."""
    rng = RNGTracker(seed=3)
    seen: list[tuple[int, int]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append((rng.step, rng.microbatch))
        return rng.dropout(x, 0.5, "site", tuple(x.shape), (slice(None),)) * x

    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    rng.set_context(4, 1)
    y = checkpoint(fn, rng, x)
    rng.set_context(4, 2)
    y.sum().backward()
    assert seen == [(4, 1), (4, 1)], seen
    assert (rng.step, rng.microbatch) == (4, 2)
    rng.set_context(4, 1)
    x2 = x.detach().requires_grad_(True)
    fn(x2).sum().backward()
    assert x.grad is not None and x2.grad is not None
    assert torch.equal(x.grad, x2.grad)
    assert 0 < int((x.grad == 0).sum()) < 64, "dropout dropped nothing or everything"


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tp1_gradients_equal(arch: str) -> None:
    errors = compare_modes(tiny_config(arch), MODES, control=True)
    _check(errors, f"{arch} tp1", control=True)


def test_tp2_sp_gradients_equal(run_ranks: Callable[..., list[Any]]) -> None:
    config = tiny_config("llama", tp=2, sp=True)
    for rank, errors in enumerate(run_ranks(2, compare_modes, config, MODES, True)):
        _check(errors, f"llama tp2+sp rank {rank}", control=True)


PP_CASES = [
    pytest.param(1, "1f1b", id="pp2"),
    pytest.param(2, "interleaved_1f1b", id="pp2-vp2"),
    pytest.param(1, "zb_h1", id="pp2-zb_h1"),
    pytest.param(2, "zbv", id="pp2-vp2-zbv"),
]


@pytest.mark.parametrize(("vp", "schedule"), PP_CASES)
def test_pipeline_gradients_equal(run_ranks: Callable[..., list[Any]], vp: int,
                                  schedule: str) -> None:
    config = tiny_config("llama", pp=2, vp=vp, schedule=schedule)
    modes = [("selective", "uniform", 1), ("full", "uniform", 1), ("full", "block", 1)]
    results = run_ranks(2, compare_modes, config, modes)
    holder, _ = locate(2 * vp - 1, 2, schedule_placement(schedule))  # the head's stage
    for rank, errors in enumerate(results):
        if rank == holder:  # it holds the losses (zbv: stage 0)
            _check(errors, f"pp2 vp{vp} rank {rank}")
        else:
            for name, err in errors.items():
                if name != "loss_spread":
                    assert err <= EXACT, f"pp2 vp{vp} rank {rank} {name}: {err:.3e}"
