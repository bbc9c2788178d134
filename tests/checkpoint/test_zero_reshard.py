"""Checkpoints reshard between ZeRO stages and layouts (issue 15), float64.

A run saves after 2 steps under layout A and continues 2 more (the uninterrupted reference);
resumed under layout B it must continue with the same losses (rel. 1e-12) and end with the same
full parameters. ZeRO-3 parameters are written as the flat ranges of each rank's shard, ZeRO
optimizer state as flat ranges of every shard-group rank (hybrid sharding: replicate index 0
only), and every loader reads just the pieces its rank keeps, whatever stage wrote them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint.harness import Layout, batches_for, make_config, merge, rel_err
from tests.parity import rank_groups

TOL = 1e-12


@dataclasses.dataclass(frozen=True)
class Zero:
    """A layout with a ZeRO stage and optional hybrid sharding."""

    layout: Layout
    stage: int
    shard_size: int | None = None
    precision: str = "fp64"
    optim: str = "adamw"
    """optim.name."""

    @property
    def world(self) -> int:
        """Ranks it needs."""
        return self.layout.world

    def __str__(self) -> str:
        hybrid = f"h{self.shard_size}" if self.shard_size else ""
        name = "" if self.optim == "adamw" else self.optim
        return f"{self.layout}z{self.stage}{hybrid}{self.precision}{name}"


def make_trainer(z: Zero) -> Any:
    """A Trainer of ``z`` on this pool rank (the checkpoint harness's tiny llama, fp64)."""
    from colonnade.parallel.dims import ParallelDims
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    cfg = make_config(z.layout, z.precision)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, zero_stage=z.stage, zero_shard_size=z.shard_size),
        optim=dataclasses.replace(cfg.optim, name=z.optim))
    lay = z.layout
    dims = ParallelDims(tp=lay.tp, pp=lay.pp, dp=lay.dp, vp=lay.vp)
    groups = rank_groups(dims, zero_shard_size=z.shard_size)
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups), None)
    assert trainer.ddp.zero == z.stage
    assert (trainer.ddp.param_shards is not None) == (z.stage == 3)
    return trainer


def _steps(trainer: Any, count: int) -> list[float]:
    g = trainer.groups
    return [trainer.train_step(batches_for(trainer.step, g.dp.rank, g.dp.size))["loss"]
            for _ in range(count)]


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    """Full parameters (ZeRO-3: rebuilt one tensor at a time); dp 0 / tp 0 returns them."""
    from colonnade.checkpoint.export import full_state

    trainer.ddp.finish_param_gather()  # ZeRO-1/2 gather lazily (no-op at stage 3)
    state = full_state(trainer.chunks, trainer.groups, trainer.ddp)
    g = trainer.groups
    return state if g.dp.rank == 0 and g.tp.rank == 0 else {}


def save_run(z: Zero, root: str, before: int, after: int) -> dict[str, Any]:
    """Train ``before`` steps, save, train ``after`` more."""
    from colonnade.checkpoint.training_state import save_training

    trainer = make_trainer(z)
    losses = _steps(trainer, before)
    save_training(trainer, root, keep_last=1)
    losses += _steps(trainer, after)
    return {"losses": losses, "params": _params(trainer)}


def load_run(z: Zero, root: str, after: int) -> dict[str, Any]:
    """Resume from ``root`` under ``z`` and train ``after`` steps."""
    from colonnade.checkpoint.training_state import load_training

    trainer = make_trainer(z)
    load_training(trainer, root)
    losses = _steps(trainer, after)
    return {"losses": losses, "params": _params(trainer), "step": trainer.step}


def _same(stayed: list[dict[str, Any]], moved: list[dict[str, Any]]) -> None:
    ref, got = stayed[0]["losses"][2:], moved[0]["losses"]
    assert len(ref) == len(got) == 2
    for x, y in zip(ref, got, strict=True):
        assert abs(x - y) <= TOL * abs(x), f"losses differ: {ref} vs {got}"
    pa, pb = merge(stayed), merge(moved)
    assert pa.keys() == pb.keys() and len(pa) > 10, sorted(set(pa) ^ set(pb))
    worst = max(rel_err(pa[k], pb[k]) for k in pa)
    assert worst <= TOL, f"params rel err {worst:.3e}"


def _pieces(root: Path) -> dict[str, list[dict[str, Any]]]:
    step = sorted(root.glob("step_*"))[-1]
    index = json.loads((step / "index.json").read_text())
    return {name: info["pieces"] for name, info in index["tensors"].items()}


ZERO3_DP4 = Zero(Layout(dp=4), 3)
TARGETS = [Zero(Layout(dp=2), 1), Zero(Layout(tp=2, dp=2), 2), Zero(Layout(), 0)]


def test_zero3_dp4_resumes_in_other_stages(run_ranks: Callable[..., list[Any]],
                                           tmp_path: Path) -> None:
    """Stage 3 dp4 -> stage 1 dp2, stage 2 dp2 tp2, no sharding dp1: the same run."""
    root = tmp_path / "z3"
    stayed = run_ranks(ZERO3_DP4.world, save_run, ZERO3_DP4, str(root), 2, 2)
    pieces = _pieces(root)
    # every dp rank wrote its flat ranges of the parameters and of the optimizer state
    writers = {p["file"] for ps in pieces.values() for p in ps}
    assert writers == {f"rank-{r:05d}.safetensors" for r in range(4)}
    flat = [p for name, ps in pieces.items() if name.startswith("model/") for p in ps
            if p["flat"] is not None]
    assert flat, "ZeRO-3 parameters were not written as flat ranges"
    _stored_once(root)
    for z in TARGETS:
        moved = run_ranks(z.world, load_run, z, str(root), 2)
        assert moved[0]["step"] == 4
        _same(stayed, moved)


REVERSE = [
    (Zero(Layout(dp=2), 0), Zero(Layout(dp=4), 3)),
    (Zero(Layout(tp=2, dp=2, sp=True), 1), Zero(Layout(tp=2, dp=2), 3)),
    (Zero(Layout(dp=4), 2, shard_size=2), Zero(Layout(dp=4), 3, shard_size=2)),
    (Zero(Layout(dp=4), 3, shard_size=2), Zero(Layout(dp=2), 2)),
    (Zero(Layout(pp=2, dp=2), 3), Zero(Layout(tp=2), 0)),
    # hybrid ZeRO-3 over pairs with uneven stages -> even stages at ZeRO-2 without hybrid
    (Zero(Layout(pp=2, dp=4, layers=(3, 1)), 3, shard_size=2), Zero(Layout(pp=2, dp=2), 2)),
]


@pytest.mark.parametrize(("a", "b"), REVERSE, ids=[f"{a}->{b}" for a, b in REVERSE])
def test_resume_into_zero3_and_hybrid(run_ranks: Callable[..., list[Any]], tmp_path: Path,
                                      a: Zero, b: Zero) -> None:
    """Stage 0 / 1 / hybrid stage 2 -> stage 3 (and hybrid stage 3 -> stage 2): the same run."""
    root = tmp_path / "ck"
    stayed = run_ranks(a.world, save_run, a, str(root), 2, 2)
    _stored_once(root)
    moved = run_ranks(b.world, load_run, b, str(root), 2)
    assert moved[0]["step"] == 4
    _same(stayed, moved)


def _stored_once(root: Path) -> None:
    """Every element of every tensor is stored exactly once: replicas (dp replicas of a whole
    parameter, hybrid replicas of a shard, a tied head's copy) write nothing."""
    step = sorted(root.glob("step_*"))[-1]
    tensors = json.loads((step / "index.json").read_text())["tensors"]
    for name, info in tensors.items():
        stored = sum((p["flat"][1] - p["flat"][0]) if p["flat"] else math.prod(p["shape"])
                     for p in info["pieces"])
        assert stored == math.prod(info["full_shape"]), name


def init_from(z: Zero, root: str) -> dict[str, Any]:
    """``--init-from`` a checkpoint: weights into the (ZeRO-3) shard, fresh optimizer whose
    fp32 masters are re-copied from the model; returns the max |master - weight|."""
    from colonnade.checkpoint.finetune import init_weights

    trainer = make_trainer(z)
    init_weights(trainer, root)
    opt, ddp = trainer.optimizer, trainer.ddp
    assert opt.master_flat is not None  # bf16: separate fp32 masters
    worst = max(float((m - v.float()).abs().max()) for m, v in
                zip(opt.masters, ddp.owned_params(), strict=True))
    moments = float(opt.exp_avg_flat.abs().max())
    return {"worst": worst, "moments": moments, "losses": _steps(trainer, 1),
            "nonzero": float(opt.masters[0].abs().max())}


def test_bf16_zero3_resume_and_init_from(run_ranks: Callable[..., list[Any]],
                                         tmp_path: Path) -> None:
    """bf16 with fp32 masters at stage 3: the exact resume in the same layout, and
    ``--init-from`` (weights only) fills the fp32 masters from the shard's weights."""
    z = Zero(Layout(dp=2), 3, precision="bf16")
    root = tmp_path / "bf16"
    stayed = run_ranks(z.world, save_run, z, str(root), 2, 2)
    moved = run_ranks(z.world, load_run, z, str(root), 2)
    assert moved[0]["losses"] == stayed[0]["losses"][2:]  # bit-exact
    for r in run_ranks(z.world, init_from, z, str(root)):
        assert r["worst"] == 0.0 and r["moments"] == 0.0 and r["nonzero"] > 0
