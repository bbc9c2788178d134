"""LR schedules (issue 14, item 15): exact values of warmup-stable-decay (linear and 1-sqrt) and
inverse-sqrt at chosen steps, their validation, and resume under a changed schedule."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from colonnade.checkpoint.format import CheckpointError
from colonnade.checkpoint.training_state import schedule_change
from colonnade.cli import main
from colonnade.config.choices import LR_DECAYS, WSD_SHAPES
from colonnade.config.load import ConfigError
from colonnade.config.sections import Config, OptimConfig, TrainingConfig
from colonnade.config.validate import resolve, validate
from colonnade.optim.lr import lr_at, schedule_of

WSD = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, decay="wsd", decay_fraction=0.3)


def test_wsd_linear_exact_values() -> None:
    """10 steps, warmup 2, decay 0.3 x 10 = 3 steps (7, 8, 9), the last at min_lr."""
    got = [lr_at(s, 10, WSD) for s in range(10)]
    want = [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7e-4, 4e-4, 1e-4]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert WSD.wsd_decay_steps(10) == 3 and WSD.wsd_decay_steps(1) == 1


def test_wsd_one_minus_sqrt_exact_values() -> None:
    cfg = dataclasses.replace(WSD, decay_shape="1-sqrt")
    got = [lr_at(s, 10, cfg) for s in (1, 6, 7, 8, 9)]
    want = [1e-3, 1e-3, 1e-3 - 9e-4 * math.sqrt(1 / 3), 1e-3 - 9e-4 * math.sqrt(2 / 3), 1e-4]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert got[2] == pytest.approx(4.803847577293368e-4, rel=1e-12)


def test_inverse_sqrt_exact_values() -> None:
    """lr * sqrt(W / n) with n = step + 1 after a 4-step warmup, floored at min_lr."""
    cfg = OptimConfig(lr=1e-3, min_lr=1e-5, warmup_steps=4, decay="inverse_sqrt")
    steps = (0, 3, 4, 15, 99, 39_999, 1_000_000)
    got = [lr_at(s, 100, cfg) for s in steps]
    want = [2.5e-4, 1e-3, 1e-3 * math.sqrt(4 / 5), 5e-4, 2e-4, 1e-5, 1e-5]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    no_warmup = dataclasses.replace(cfg, warmup_steps=0)
    assert [lr_at(s, 100, no_warmup) for s in (0, 3)] == pytest.approx([1e-3, 5e-4], rel=1e-12)


def test_every_decay_is_implemented() -> None:
    """Each allowed value (one owner: LR_DECAYS) gives its own curve at step 30 of 40."""
    values = {d: lr_at(30, 40, dataclasses.replace(WSD, decay=d)) for d in LR_DECAYS}
    assert len(set(values.values())) == len(LR_DECAYS), values
    assert set(WSD_SHAPES) == {"linear", "1-sqrt"}


def _config(**optim: object) -> Config:
    return resolve(Config(optim=dataclasses.replace(OptimConfig(), **optim),
                          training=TrainingConfig(steps=10)), 1)


def test_validation_names_the_field_and_the_fix() -> None:
    validate(_config(decay="wsd", warmup_steps=2, decay_fraction=0.3), 1)
    validate(_config(decay="inverse_sqrt"), 1)
    cases = {"optim.decay='cosine_restarts' is unknown; use one of cosine, linear, constant, "
             "wsd, inverse_sqrt": {"decay": "cosine_restarts"},
             "optim.decay_shape='sqrt' is unknown; use one of linear, 1-sqrt":
                 {"decay": "wsd", "decay_shape": "sqrt", "warmup_steps": 0},
             "optim.decay_fraction=0.0 must be in (0, 1]": {"decay_fraction": 0.0},
             "optim.decay_fraction=1.5 must be in (0, 1]": {"decay_fraction": 1.5},
             "optim.warmup_steps=8 + decay steps 3 (optim.decay_fraction=0.3 x training.steps=10)"
             " exceed training.steps": {"decay": "wsd", "warmup_steps": 8, "decay_fraction": 0.3}}
    for message, fields in cases.items():
        with pytest.raises(ConfigError) as info:
            validate(_config(**fields), 1)
        assert message in str(info.value), str(info.value)


def test_cli_accepts_and_rejects(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--print-config", "--optim.decay=wsd", "--optim.decay_fraction=0.25",
                 "--optim.decay_shape=1-sqrt"]) == 0
    out = capsys.readouterr().out
    assert 'decay = "wsd"' in out and "decay_fraction = 0.25" in out and '"1-sqrt"' in out
    assert main(["train", "--print-config", "--optim.decay=inverse_sqrt"]) == 0
    assert main(["train", "--print-config", "--optim.decay=wsd",
                 "--optim.decay_shape=cubic"]) == 2
    assert "optim.decay_shape='cubic'" in capsys.readouterr().err
    assert main(["train", "--help-config"]) == 0
    assert "--optim.decay_fraction=0.2" in capsys.readouterr().out


def _meta(total: int, cfg: OptimConfig) -> dict[str, object]:
    return {"optimizer": {"schedule": schedule_of(total, cfg), "total_steps": total}}


def test_resume_under_a_changed_wsd_schedule_is_detected(tmp_path: Path) -> None:
    saved = _meta(100, dataclasses.replace(WSD, decay_fraction=0.2))
    now = SimpleNamespace(total_steps=100, cfg=dataclasses.replace(WSD, decay_fraction=0.4),
                          step_count=70)
    with pytest.raises(CheckpointError) as info:
        schedule_change(saved, now, tmp_path, "check")
    text = str(info.value)
    assert "optim.decay_fraction 0.2 -> 0.4" in text
    assert "from 0.001 to 0.000753" in text  # step 70: stable under 0.2; 11/40 into the decay
    assert schedule_change(saved, now, tmp_path, "checkpoint").startswith("kept")
    assert now.cfg.decay_fraction == 0.2
    shape = SimpleNamespace(total_steps=100, step_count=90,
                            cfg=dataclasses.replace(WSD, decay_fraction=0.2,
                                                    decay_shape="1-sqrt"))
    with pytest.raises(CheckpointError, match=r"optim\.decay_shape linear -> 1-sqrt"):
        schedule_change(saved, shape, tmp_path, "check")
    # a wsd-only field changed under another decay changes nothing
    cos = dataclasses.replace(WSD, decay="cosine")
    moved = SimpleNamespace(total_steps=100, step_count=70,
                            cfg=dataclasses.replace(cos, decay_fraction=0.5))
    assert schedule_change(_meta(100, cos), moved, tmp_path, "check") == ""
    # a checkpoint written before these fields existed compares what it recorded
    old = {"optimizer": {"schedule": {k: v for k, v in schedule_of(100, cos).items()
                                      if k not in ("decay_fraction", "decay_shape")},
                         "total_steps": 100}}
    assert schedule_change(old, moved, tmp_path, "check") == ""
    to_wsd = SimpleNamespace(total_steps=100, step_count=70, cfg=WSD)
    with pytest.raises(CheckpointError, match=r"optim\.decay cosine -> wsd"):
        schedule_change(old, to_wsd, tmp_path, "check")


def test_a_schedule_change_that_moves_no_lr_left_is_no_change(tmp_path: Path) -> None:
    """Raising training.steps while both totals are inside the warmup changes no LR any step
    left will use: the resume goes on (it was refused, naming 'from 0.00105 to 0.00105');
    where the LRs part, the message names the first step that differs, not the resume step."""
    cos = dataclasses.replace(WSD, decay="cosine", warmup_steps=20, lr=3e-3, min_lr=3e-4)
    inside = SimpleNamespace(total_steps=8, step_count=6, cfg=cos)
    assert schedule_change(_meta(6, cos), inside, tmp_path, "check") == ""
    past = SimpleNamespace(total_steps=40, step_count=6, cfg=cos)
    with pytest.raises(CheckpointError) as info:
        schedule_change(_meta(30, cos), past, tmp_path, "check")
    assert "at step 21 from 0.00293 to 0.00298" in str(info.value)  # the decay starts at 20


def _wsd_trainer(decay_fraction: float, lr_schedule: str) -> Any:
    """A single-process fp32 trainer of the checkpoint tests' tiny model under wsd, 6 steps."""
    import torch

    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime
    from tests.checkpoint.harness import Layout, make_config

    cfg = make_config(Layout(), precision="fp32")
    cfg = dataclasses.replace(
        cfg, optim=dataclasses.replace(cfg.optim, lr=1e-3, min_lr=1e-4, warmup_steps=1,
                                       decay="wsd", decay_fraction=decay_fraction),
        checkpoint=dataclasses.replace(cfg.checkpoint, lr_schedule=lr_schedule))
    return Trainer(Runtime(cfg, torch.device("cpu"), ProcessGroups.single()), None)


def test_trainer_runs_wsd_and_resume_keeps_or_refuses_it(tmp_path: Path) -> None:
    """The optimizer steps at the wsd LRs (3 decay steps of 6); after a save at step 3, a
    changed decay_fraction is refused, and 'checkpoint' continues the run exactly."""
    from colonnade.checkpoint.training_state import load_training, save_training, start_from
    from tests.checkpoint.harness import batches_for

    first = _wsd_trainer(0.5, "check")
    head = [first.train_step(batches_for(k, 0, 1)) for k in range(3)]
    save_training(first, tmp_path)
    rest = [first.train_step(batches_for(k, 0, 1)) for k in range(3, 6)]
    assert [r["lr"] for r in head + rest] == pytest.approx(
        [1e-3, 1e-3, 1e-3, 7e-4, 4e-4, 1e-4], rel=1e-12)
    with pytest.raises(CheckpointError, match=r"optim\.decay_fraction 0\.5 -> 0\.34"):
        load_training(_wsd_trainer(0.34, "check"), tmp_path)
    kept = _wsd_trainer(0.34, "checkpoint")
    assert "kept the checkpoint's LR schedule" in start_from(kept, tmp_path)
    again = [kept.train_step(batches_for(k, 0, 1)) for k in range(3, 6)]
    assert [r["lr"] for r in again] == [r["lr"] for r in rest]
    assert [r["loss"] for r in again] == [r["loss"] for r in rest]
