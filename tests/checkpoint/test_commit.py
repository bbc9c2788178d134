"""Atomic commit, crash safety, exact resume, and clear errors on broken checkpoints."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from colonnade.checkpoint.commit import committed_steps, read_latest, resolve_checkpoint
from colonnade.checkpoint.format import CheckpointError
from colonnade.checkpoint.training_state import load_training, save_training
from tests.checkpoint.harness import Layout, make_trainer, run_load, run_save, train_steps

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
    with pytest.raises(CheckpointError, match=r"tensor 'model/layers\.0\.mlp\.up\.weight' has "
                       r"shape \(64, 32\) in the checkpoint but \(96, 32\)"):
        load_training(trainer, tmp_path)
    gpt2 = make_trainer(Layout(), precision="fp32", arch="gpt2")  # tensors llama lacks
    with pytest.raises(CheckpointError, match=r"tensor 'model/.+' missing"):
        load_training(gpt2, tmp_path)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nothing to load"):
        resolve_checkpoint(tmp_path)
