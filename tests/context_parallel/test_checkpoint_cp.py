"""Checkpoints under context parallelism: cp is not part of the weights (float64).

Every tensor is replicated over cp, so of the dp x cp replicas only index 0 writes it, and
ZeRO shards (stages 1-3) over dp x cp reshard like shards over dp. Saved after 2 steps
under layout A and resumed under B for 2 more, the run must equal the one that stayed in A:
losses and final parameters within 1e-10 (the cp reference is the uninterrupted run; the
cp = 1 side of the parity is tests/context_parallel/test_parity*.py's).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint.harness import assert_same_run, make_config, train_steps

TOL = 1e-10


@dataclasses.dataclass(frozen=True)
class CpLayout:
    """A layout of this file's cases: cp x dp (tp, pp 1), attention kind (``a2a``: the
    hierarchical one's inner size), ZeRO stage."""

    cp: int = 1
    dp: int = 1
    attention: str = "ring"
    zero: int = 0
    a2a: int | None = None

    @property
    def world(self) -> int:
        """Ranks it needs."""
        return self.cp * self.dp

    def __str__(self) -> str:
        kind = "" if self.cp == 1 else {"all_to_all": "-a2a", "ring": "-ring"}.get(
            self.attention, f"-a2a{self.a2a}xring")
        return f"cp{self.cp}dp{self.dp}{kind}" + (f"-zero{self.zero}" if self.zero else "")


def make_cp_trainer(layout: CpLayout) -> Any:
    """A float64 Trainer of ``layout`` on this pool rank (batches fed by the test)."""
    from colonnade.parallel.dims import ParallelDims
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime
    from tests.checkpoint.harness import Layout
    from tests.parity import rank_groups

    base = make_config(Layout(dp=layout.dp))
    cfg = dataclasses.replace(base, parallel=dataclasses.replace(
        base.parallel, cp=layout.cp, cp_attention=layout.attention, cp_a2a_size=layout.a2a,
        zero_stage=layout.zero))
    groups = rank_groups(ParallelDims(cp=layout.cp, dp=layout.dp), layout.a2a)
    return Trainer(Runtime(cfg, torch.device("cpu"), groups), None)


def _gathered(trainer: Any) -> dict[str, torch.Tensor]:
    from colonnade.checkpoint.export import full_state

    trainer.ddp.finish_param_gather()
    state = full_state(trainer.chunks, trainer.groups, trainer.ddp)  # ZeRO-3: one at a time
    return state if trainer.groups.dp_cp.rank == 0 else {}


def cp_save(layout: CpLayout, root: str, before: int, after: int) -> dict[str, Any]:
    """Train ``before`` steps, save, train ``after`` more; losses, params, pieces written."""
    from colonnade.checkpoint.sharded import model_entries, optim_entries
    from colonnade.checkpoint.training_state import save_training

    trainer = make_cp_trainer(layout)
    losses = train_steps(trainer, before)
    written = (len(model_entries(trainer.chunks, trainer.groups, trainer.ddp)),
               len(optim_entries(trainer.optimizer, trainer.groups)))
    save_training(trainer, root, keep_last=2)
    losses += train_steps(trainer, after)
    return {"losses": losses, "params": _gathered(trainer), "written": written,
            "cp_bytes": _cp_bytes(trainer)}


def _cp_bytes(trainer: Any) -> float:
    """Bytes the cp group (hierarchical: its two sub-groups) moved."""
    stats = trainer.groups.stats
    return stats.total("cp/") + stats.total("cp_a2a/") + stats.total("cp_ring/")


def cp_load(layout: CpLayout, root: str, after: int) -> dict[str, Any]:
    """Resume from ``root`` under ``layout`` and train ``after`` steps."""
    from colonnade.checkpoint.training_state import load_training

    trainer = make_cp_trainer(layout)
    load_training(trainer, root)
    losses = train_steps(trainer, after)
    return {"losses": losses, "params": _gathered(trainer), "step": trainer.step,
            "cp_bytes": _cp_bytes(trainer)}


CASES = [
    (CpLayout(cp=2), CpLayout()),
    (CpLayout(cp=2), CpLayout(cp=4)),
    (CpLayout(cp=2, dp=2, zero=1), CpLayout(dp=2)),
    (CpLayout(cp=2, attention="all_to_all"), CpLayout(cp=4, dp=1, zero=1)),
    (CpLayout(cp=2, dp=2, zero=3), CpLayout(cp=2, attention="all_to_all", zero=2)),
    (CpLayout(cp=4, attention="hierarchical", a2a=2), CpLayout(cp=2)),
]


@pytest.mark.parametrize(("a", "b"), CASES, ids=[f"{a}->{b}" for a, b in CASES])
def test_resume_across_a_cp_change(run_ranks: Callable[..., list[Any]], tmp_path: Path,
                                   a: CpLayout, b: CpLayout) -> None:
    root = str(tmp_path / "ckpt")
    stayed = run_ranks(a.world, cp_save, a, root, 2, 2)
    moved = run_ranks(b.world, cp_load, b, root, 2)
    assert moved[0]["step"] == 4
    for layout, results in ((a, stayed), (b, moved)):  # attention did cross the cp ranks
        assert all((r["cp_bytes"] > 0) == (layout.cp > 1) for r in results), layout
    assert_same_run(stayed, moved, TOL, skip_losses=2)
    meta = json.loads(next(Path(root).glob("step_*/metadata.json")).read_text())
    assert meta["layout"]["cp"] == a.cp and meta["layout"]["dp"] == a.dp
    assert meta["layout"]["cp_attention"] == a.attention
    for rank, res in enumerate(stayed):  # rank = cp index + cp * dp index
        model, optim = res["written"]
        if a.zero == 3:  # every dp x cp rank writes its shard of weights and optimizer
            assert optim > 0 and model > 0, (rank, res["written"])
        elif a.zero:  # every dp x cp rank writes its own optimizer shard, index 0 the weights
            assert optim > 0 and (model > 0) == (rank == 0), (rank, res["written"])
        else:  # the replicas (cp index > 0 included) write nothing
            assert (model > 0) == (optim > 0) == (rank == 0), (rank, res["written"])
