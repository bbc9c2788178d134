"""Atomic commit, crash safety, exact resume, and clear errors on broken checkpoints."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from colonnade.checkpoint.commit import committed_steps, read_latest, resolve_checkpoint
from colonnade.checkpoint.format import CheckpointError
from colonnade.checkpoint.training_state import (
    load_training,
    preflight_resume,
    save_training,
    start_from,
)
from colonnade.optim.lr import lr_at
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.setup import Runtime
from tests.checkpoint.harness import (
    Layout,
    batches_for,
    make_config,
    make_trainer,
    run_load,
    run_save,
    train_steps,
)

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`

PHASES = ["shard_written", "index_written", "files_written", "renamed", "latest_tmp_written",
          "latest_written"]


def _crash_during_save(root: str, phase: str) -> None:
    """Child process: commit step 1, then die (SIGKILL-like) at ``phase`` of saving step 2."""
    torch.set_num_threads(1)
    trainer = make_trainer(Layout(), precision="fp32")
    train_steps(trainer, 1)
    save_training(trainer, root)
    train_steps(trainer, 1)

    def hook(name: str) -> None:
        if name == phase:
            os._exit(9)

    save_training(trainer, root, on_phase=hook)
    os._exit(0)


@pytest.mark.parametrize("phase", PHASES)
def test_killed_writer_leaves_latest_loadable(tmp_path: Path, phase: str) -> None:
    root = tmp_path / "ck"
    proc = multiprocessing.get_context("fork").Process(target=_crash_during_save,
                                                       args=(str(root), phase))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 9
    expected = 2 if phase == "latest_written" else 1
    assert read_latest(root) == root / f"step_{expected:08d}"
    trainer = make_trainer(Layout(), precision="fp32")
    meta = load_training(trainer, root)
    assert meta["step"] == trainer.step == expected
    # the next save cleans up what the crash left and commits normally
    train_steps(trainer, 1)
    save_training(trainer, root, keep_last=2)
    assert committed_steps(root)[-1] == expected + 1
    assert not list(root.glob("*.tmp"))
    assert len(committed_steps(root)) <= 2


def test_resume_is_bit_exact_fp32(tmp_path: Path) -> None:
    """One layout, fp32: the resumed run's losses and weights equal the uninterrupted run's."""
    stayed = run_save(Layout(), str(tmp_path), 2, 3, precision="fp32")
    moved = run_load(Layout(), str(tmp_path), 3, precision="fp32")
    assert stayed["losses"][2:] == moved["losses"]
    for k, v in stayed["params"].items():
        assert torch.equal(v, moved["params"][k]), k


def test_async_save_matches_sync(tmp_path: Path) -> None:
    """A background save while training continues writes the state at the save point."""
    trainer = make_trainer(Layout(), precision="fp32")
    train_steps(trainer, 2)
    pending = save_training(trainer, tmp_path / "a", async_save=True)
    train_steps(trainer, 1)  # changes the weights while the thread may still write
    pending.wait()
    other = make_trainer(Layout(), precision="fp32")
    train_steps(other, 2)
    save_training(other, tmp_path / "s")
    a, s = make_trainer(Layout(), precision="fp32"), make_trainer(Layout(), precision="fp32")
    load_training(a, tmp_path / "a")
    load_training(s, tmp_path / "s")
    for pa, ps in zip(a.chunks[0].parameters(), s.chunks[0].parameters(), strict=True):
        assert torch.equal(pa, ps)
    assert train_steps(a, 1) == train_steps(s, 1)


def _saved(tmp_path: Path) -> Path:
    trainer = make_trainer(Layout(), precision="fp32")
    train_steps(trainer, 1)
    save_training(trainer, tmp_path)
    return resolve_checkpoint(tmp_path)


def test_truncated_shard_is_named(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    shard = ckpt / "rank-00000.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors.*(truncated|corrupt)"):
        load_training(make_trainer(Layout(), precision="fp32"), tmp_path)


def test_corrupted_bytes_name_file_and_tensor(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    shard = ckpt / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors: tensor '.+' .*crc32"):
        load_training(make_trainer(Layout(), precision="fp32"), tmp_path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    (ckpt / "rank-00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors missing"):
        load_training(make_trainer(Layout(), precision="fp32"), tmp_path)


def test_incompatible_model_shape_is_named(tmp_path: Path) -> None:
    import dataclasses

    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime
    from tests.checkpoint.harness import make_config

    _saved(tmp_path)
    cfg = make_config(Layout(), "fp32")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, ffn_hidden_size=96))
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), ProcessGroups.single()), None)
    with pytest.raises(CheckpointError, match=r"holds another model than this run's: "
                       r"model\.ffn_hidden_size=96 \(checkpoint: 64\); set those model fields"):
        load_training(trainer, tmp_path)  # every differing field named, before any tensor
    gpt2 = make_trainer(Layout(), precision="fp32", arch="gpt2")  # tensors llama lacks
    with pytest.raises(CheckpointError, match=r"model\.arch=gpt2 \(checkpoint: llama\), "
                       r"model\.num_kv_heads=8 \(checkpoint: 4\), model\.bias=True"):
        load_training(gpt2, tmp_path)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nothing to load"):
        resolve_checkpoint(tmp_path)


def _trainer_under(steps: int, lr_schedule: str) -> Any:
    """A single-process fp32 trainer like make_trainer's, with its own steps / lr_schedule."""
    from colonnade.training.loop import Trainer

    cfg = make_config(Layout(), precision="fp32")
    cfg = dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, steps=steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, lr_schedule=lr_schedule))
    return Trainer(Runtime(cfg, torch.device("cpu"), ProcessGroups.single()), None)


def test_resume_under_another_lr_schedule_is_refused_or_reconciled(tmp_path: Path) -> None:
    """training.steps 6 -> 10 on resume: 'check' refuses (CLI preflight and ranks alike) and
    names both fixes; 'checkpoint' continues the saved run exactly; 'config' follows the new
    curve from the resumed step."""
    first = _trainer_under(6, "check")
    train_steps(first, 2)
    save_training(first, tmp_path)
    rest = [first.train_step(batches_for(k, 0, 1)) for k in range(2, 6)]
    strict = _trainer_under(10, "check")
    with pytest.raises(CheckpointError, match=r"training\.steps 6 -> 10") as info:
        load_training(strict, tmp_path)
    assert "--checkpoint.lr_schedule=checkpoint" in str(info.value)
    assert "--checkpoint.lr_schedule=config" in str(info.value)
    def loading(cfg: Any) -> Any:
        return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                       load=str(tmp_path)))

    with pytest.raises(CheckpointError, match=r"training\.steps 6 -> 10"):
        preflight_resume(loading(strict.config))
    preflight_resume(loading(first.config))  # the same schedule: nothing to say

    kept = _trainer_under(10, "checkpoint")
    assert "kept the checkpoint's LR schedule" in start_from(kept, tmp_path)
    again = [kept.train_step(batches_for(k, 0, 1)) for k in range(2, 7)]
    assert [r["loss"] for r in again[:4]] == [r["loss"] for r in rest]
    assert [r["lr"] for r in again[:4]] == [r["lr"] for r in rest]
    assert again[4]["lr"] == pytest.approx(kept.config.optim.min_lr)  # past the saved horizon

    moved = _trainer_under(10, "config")
    assert "switched to this run's LR schedule" in start_from(moved, tmp_path)
    got = [moved.train_step(batches_for(k, 0, 1))["lr"] for k in (2, 3)]
    assert got == pytest.approx([lr_at(k, 10, moved.config.optim) for k in (2, 3)])
    assert got[1] > rest[1]["lr"]  # the longer cosine has decayed less by step 3


def test_only_owners_write_files(run_ranks: Any, tmp_path: Path) -> None:
    """tp2 x dp2: the dp replicas write nothing (2 shards + 2 fragments + index, metadata,
    config); with ZeRO-1 each of the 4 ranks owns an optimizer range and writes."""
    for zero, writers in ((False, 2), (True, 4)):
        root = tmp_path / f"z{zero}"
        run_ranks(4, run_save, Layout(tp=2, dp=2, zero=zero), str(root), 1, 0)
        names = sorted(p.name for p in resolve_checkpoint(root).iterdir())
        shards = [n for n in names if n.endswith(".safetensors")]
        assert len(shards) == writers, names
        assert len(names) == 2 * writers + 3, names


class _FakeTime:
    """``time`` for :mod:`colonnade.checkpoint.commit`: ``sleep`` moves a virtual clock (and
    calls ``at`` once when it passes ``at_s``) instead of waiting, so the polls of a wait are
    fixed by the code, not by how the machine schedules a sleeping thread."""

    def __init__(self, at_s: float, at: Callable[[], None]) -> None:
        self.now, self.at_s, self.at = 1000.0, at_s, at
        self.start = self.now
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        before, self.now = self.now, self.now + seconds
        if before - self.start < self.at_s <= self.now - self.start:
            self.at()


def test_commit_wait_polls_with_backoff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 waiting 0.4 s for the last of 8 writers probes the file system a few times (one
    listing per poll, backing off), not once per rank every 10 ms.

    On a virtual clock (:class:`_FakeTime`): the last fragment appears when 0.4 s have passed,
    during the sleep that crosses it, so the polls are exactly the backoff's: sleeps doubling
    from 5 ms, 8 listings, 0.635 s waited (0.4 s, rounded up to the poll that saw it).
    """
    from colonnade.checkpoint import commit as commit_mod
    from colonnade.checkpoint.format import write_json

    writers = list(range(8))
    for r in writers[:-1]:
        write_json(tmp_path / f"rank-{r:05d}.json", {})
    probes = [0]
    writing = [False]

    def counted(fn: Any) -> Any:
        def inner(*args: Any, **kwargs: Any) -> Any:
            if not writing[0]:
                probes[0] += 1
            return fn(*args, **kwargs)
        return inner

    def late_writer() -> None:
        writing[0] = True
        write_json(tmp_path / "rank-00007.json", {})
        writing[0] = False

    for name in ("stat", "lstat", "listdir", "scandir"):
        monkeypatch.setattr(os, name, counted(getattr(os, name)))
    clock = _FakeTime(0.4, late_writer)
    monkeypatch.setattr(commit_mod, "time", clock)
    polls = commit_mod.wait_for_fragments(tmp_path, writers, 10.0)
    monkeypatch.undo()
    assert clock.sleeps == pytest.approx([0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32])
    assert 0.4 <= clock.now - clock.start == pytest.approx(0.635)
    assert polls == probes[0] == 8
