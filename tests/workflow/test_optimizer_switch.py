"""Switching optimizer on resume (issue 38, part D): a checkpoint records which optimizer wrote
it; resuming under another ``optim.name`` is refused before launch (no file changed) unless
``--checkpoint.optimizer_switch=reset``, which loads the weights, step and data position and
starts the new optimizer's state fresh; a later resume of the switched run keeps its state.
Checkpoints older than the record count as AdamW's."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from colonnade.checkpoint.commit import resolve_checkpoint
from colonnade.checkpoint.format import CheckpointError
from colonnade.checkpoint.optim_state import logical_state
from colonnade.checkpoint.training_state import load_training, preflight_resume, save_training
from colonnade.cli import main
from colonnade.config.load import load_config
from colonnade.optim.lr import lr_at
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.setup import Runtime
from tests.checkpoint.harness import Layout, batches_for, make_config
from tests.reliability.jobs import tiny_args
from tests.workflow.cli import hashes

MATRIX = "layers.0.mlp.down.weight"
"""A hidden matrix of the tiny llama (Muon's)."""
NORM = "final_norm.weight"
"""A vector (AdamW's in every run)."""


def _meta(ckpt: Path) -> dict[str, Any]:
    return json.loads((resolve_checkpoint(ckpt) / "metadata.json").read_text())


def test_switch_is_refused_unless_reset_and_then_resumes(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"

    def argv(steps: int, **extra: object) -> list[str]:
        return ["train", *tiny_args(*corpus, run, checkpoint__save=ckpt,
                                    training__steps=steps, **extra)]

    assert main(argv(2)) == 0, capsys.readouterr().err
    adamw = _meta(ckpt)["optimizer"]
    assert adamw["name"] == "adamw" and adamw["state_start"] == 0
    assert adamw["states"][MATRIX] == adamw["states"][NORM] == ["exp_avg", "exp_avg_sq"]
    before = {"ckpt": hashes(ckpt), "run": hashes(run)}
    assert main(argv(4, optim__name="muon")) == 2
    err = capsys.readouterr().err
    assert "was written by the adamw optimizer but this run sets optim.name=muon" in err, err
    assert "--checkpoint.optimizer_switch=reset" in err and "--optim.name=adamw" in err, err
    assert {"ckpt": hashes(ckpt), "run": hashes(run)} == before  # refused before any write

    switched = argv(4, optim__name="muon", checkpoint__optimizer_switch="reset")
    assert main(switched) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert ("optimizer switched from adamw (the checkpoint's) to muon: weights, step and data "
            "position loaded, muon's state starts fresh") in out, out
    muon = _meta(ckpt)["optimizer"]
    assert (muon["name"], muon["step_count"], muon["state_start"]) == ("muon", 4, 2)
    assert muon["states"][MATRIX] == ["momentum"]
    assert muon["states"][NORM] == ["exp_avg", "exp_avg_sq"]
    assert main(argv(5, optim__name="muon", checkpoint__optimizer_switch="reset")) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "optimizer switched" not in out, out
    assert _meta(ckpt)["optimizer"]["state_start"] == 2  # the state went on from the switch


def test_checkpoint_without_the_record_counts_as_adamw(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    args = tiny_args(*corpus, tmp_path / "run", checkpoint__save=ckpt, training__steps=1)
    assert main(["train", *args]) == 0, capsys.readouterr().err
    meta_path = resolve_checkpoint(ckpt) / "metadata.json"
    meta = json.loads(meta_path.read_text())
    for key in ("name", "state_dtype", "master_dtype", "state_start", "states"):
        meta["optimizer"].pop(key, None)
    meta_path.write_text(json.dumps(meta))
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    config = load_config(None, [*tiny_args(*corpus, tmp_path / "r2", checkpoint__load=old)])
    preflight_resume(config)  # adamw: resumes
    muon = dataclasses.replace(config, optim=dataclasses.replace(config.optim, name="muon"))
    with pytest.raises(CheckpointError, match="written by the adamw optimizer"):
        preflight_resume(muon)


def _trainer(name: str, switch: str = "check") -> Any:
    from colonnade.training.loop import Trainer

    cfg = make_config(Layout(), "fp64")
    cfg = dataclasses.replace(
        cfg, optim=dataclasses.replace(cfg.optim, name=name),
        checkpoint=dataclasses.replace(cfg.checkpoint, optimizer_switch=switch))
    return Trainer(Runtime(cfg, torch.device("cpu"), ProcessGroups.single()), None)


def test_reset_loads_weights_and_starts_the_state_fresh(tmp_path: Path) -> None:
    """fp64, one process: after the switch every parameter equals the saved one, step and
    step count are the checkpoint's, every state but the masters is zero, and AdamW's bias
    correction restarts: the first update of a vector is lr x g / (|g| + eps) (t = 1)."""
    first = _trainer("adamw")
    for k in range(2):
        first.train_step(batches_for(k, 0, 1))
    save_training(first, tmp_path)
    saved = {p.sharding.key: p.detach().clone() for p in first.chunks[0].parameters()}
    with pytest.raises(CheckpointError, match=r"optim\.name=muon"):
        load_training(_trainer("muon"), tmp_path)
    second = _trainer("muon", "reset")
    load_training(second, tmp_path)
    opt = second.optimizer
    assert (second.step, opt.step_count, opt.state_start) == (2, 2, 2)
    params = {p.sharding.key: p for p in second.chunks[0].parameters()}
    assert all(torch.equal(params[k], v) for k, v in saved.items())
    states = logical_state(opt)
    assert "momentum" in states[MATRIX]
    assert all(not sl.tensor.any() for s in states.values() for n, sl in s.items()
               if n != "master")
    before = params[NORM].detach().clone()
    second.train_step(batches_for(2, 0, 1))
    moved = (params[NORM].detach() - before).abs()  # [h]
    lr = lr_at(2, opt.total_steps, second.config.optim)
    # t = 1: |update| = lr |g| / (|g| + eps) = lr (|g| >> eps); with t = 3 it would be 0.62 lr
    assert torch.allclose(moved, torch.full_like(moved, lr), rtol=1e-3, atol=0), (moved, lr)
