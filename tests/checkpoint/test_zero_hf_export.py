"""HF export from shards (issue 15): never more than one full tensor at a time.

* From a checkpoint on disk (``convert --to-hf``): a ZeRO-3 dp4 checkpoint (parameters stored
  as flat ranges of four shards) is exported; a spy on the checkpoint reader tracks the bytes of
  every tensor it returns that are still alive, and their peak is one Colonnade tensor, far
  below the model. The file equals ``to_hf_state`` of the full model, bit for bit.
* From a live ZeRO-3 run (``write_hf_from_run``): each tensor is rebuilt from the shard
  group's ranges when written; the file equals the export of the same weights gathered whole.
* ``full_state`` of a ZeRO-3 model without its DataParallel is refused, naming the fix.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from colonnade.checkpoint.convert import read_full_model
from colonnade.checkpoint.format import CheckpointReader
from colonnade.checkpoint.hf import to_hf_state
from colonnade.hf_export import to_hf
from tests.checkpoint.harness import Layout
from tests.checkpoint.test_zero_reshard import Zero, make_trainer, save_run


class LiveBytes:
    """Spy on ``CheckpointReader.read``: bytes of returned tensors still alive, and peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.reads = 0

    def wrap(self, read: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def spied(*args: Any, **kwargs: Any) -> torch.Tensor:
            t = read(*args, **kwargs)
            n = t.numel() * t.element_size()
            self.live += n
            self.reads += 1
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._drop, n)
            return t

        return spied

    def _drop(self, n: int) -> None:
        self.live -= n


def test_to_hf_from_zero3_checkpoint_reads_one_tensor_at_a_time(
        run_ranks: Callable[..., list[Any]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    run_ranks(4, save_run, Zero(Layout(dp=4), 3), str(root), 1, 0)
    _, full = read_full_model(root)
    expected = to_hf_state(_model_cfg(root), full)
    model_bytes = sum(t.numel() * t.element_size() for t in full.values())
    largest = max(t.numel() * t.element_size() for t in full.values())
    del full
    spy = LiveBytes()
    monkeypatch.setattr(CheckpointReader, "read", spy.wrap(CheckpointReader.read))
    out = to_hf(root, tmp_path / "hf")
    assert spy.reads == len(expected)  # llama: one Colonnade tensor per HF tensor
    assert spy.peak <= largest < model_bytes / 4, (spy.peak, largest, model_bytes)
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def _model_cfg(root: Path) -> Any:
    from colonnade.checkpoint.commit import resolve_checkpoint
    from colonnade.config.load import load_config

    return load_config(resolve_checkpoint(root) / "config.toml").model


def export_live(out: str) -> dict[str, Any]:
    """Train a ZeRO-3 dp2 x tp2 run one step, export it live, and gather it whole."""
    from colonnade.checkpoint.export import full_state
    from colonnade.hf_export import write_hf_from_run
    from tests.checkpoint.harness import batches_for

    trainer = make_trainer(Zero(Layout(tp=2, dp=2), 3))
    g = trainer.groups
    trainer.train_step(batches_for(0, g.dp.rank, g.dp.size))
    write_hf_from_run(out, trainer.config.model, trainer.chunks, g, trainer.ddp, dtype="fp32")
    refused = ""
    try:
        full_state(trainer.chunks, g)
    except ValueError as err:
        refused = str(err)
    gathered = trainer.ddp.param_shards.gathered_bytes
    full = full_state(trainer.chunks, g, trainer.ddp)
    return {"rank": g.world.rank, "full": full if g.world.rank == 0 else {},
            "refused": refused, "gathered": gathered, "model": trainer.config.model}


def test_live_zero3_export_equals_gathered_weights(run_ranks: Callable[..., list[Any]],
                                                   tmp_path: Path) -> None:
    out = tmp_path / "live"
    results = run_ranks(4, export_live, str(out))
    first = results[0]
    for r in results:
        assert "freed ZeRO-3 shard" in r["refused"] and "full_state(chunks, groups, ddp)" in \
            r["refused"], r["refused"]
        assert r["gathered"] == 0  # nothing gathered after the step: the export gathered none
    expected = {k: v.float() for k, v in to_hf_state(first["model"], first["full"]).items()}
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == expected.keys() and len(got) > 10
    for k, v in expected.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
    assert (out / "config.json").exists()
