"""Async checkpoint staging: the training thread only starts host copies (two reused sets of
pinned buffers, copies on a side stream in the right order), the writer waits on the event,
saves overlap."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from colonnade.checkpoint import training_state
from colonnade.checkpoint.format import Entry
from colonnade.checkpoint.pieces import Piece
from colonnade.checkpoint.sharded import model_entries, optim_entries
from colonnade.checkpoint.staging import HostStager
from colonnade.checkpoint.training_state import load_training, save_training
from tests.checkpoint.harness import Layout, make_trainer, train_steps
from tests.checkpoint.streams import FakeGpu

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {p.sharding.key: p.detach().clone() for p in trainer.chunks[0].parameters()}


ORDER = ["stream_wait_stream", "copy", "record_event", "stream_wait_event", "wait_event"]


@pytest.mark.parametrize("prefer", ["current", "side"])
@pytest.mark.parametrize("drop", ["", "stream_wait_stream", "stream_wait_event"])
def test_stream_order(prefer: str, drop: str) -> None:
    """The copy reads the values after the last step's queued update (the side stream waits
    for the current one) and before the next step's (the current stream waits for the copy's
    event); dropping either wait gives wrong values under the stream order that exposes it."""
    gpu = FakeGpu(prefer=prefer, drop=(drop,))
    x = torch.zeros(4)
    gpu.launch(lambda: x.add_(1))  # the last step's update: queued, not yet run
    stager = HostStager(gpu)
    staged = stager.stage([Entry("model/x", x, Piece((0,), (4,)), (4,))], step=1)
    assert gpu.log == [(o, "MainThread") for o in ORDER[:4]]  # the host never waited
    gpu.launch(lambda: x.mul_(10))  # the next step's in-place update
    (entry,) = stager.ready(staged)
    exposed = {"stream_wait_stream": "side", "stream_wait_event": "current"}.get(drop)
    want = torch.full((4,), 10.0 if exposed == prefer == "current" else
                      0.0 if exposed == prefer == "side" else 1.0)
    assert torch.equal(entry.tensor, want), (entry.tensor, want)
    assert gpu.log[-1] == ("wait_event", "MainThread")


def test_async_saves_overlap_and_keep_the_values(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Three async saves, each followed by a step that changes every parameter: the first
    save's writer is held, the second stages without waiting (two buffer sets), the third
    waits for a free set and says so; a synchronous save then waits for them; each checkpoint
    holds the values at its step, commits stay in step order (latest: the sync save), and the
    buffers are allocated once per set."""
    trainer = make_trainer(Layout(), precision="fp32")
    train_steps(trainer, 1)
    gpu = FakeGpu(host_runs_current=True)
    go, notes = threading.Event(), []
    trainer.checkpoint_stager = HostStager(gpu, note=lambda line: (notes.append(line), go.set()))
    real_write = training_state.write_rank_shard

    def held_write(*args: Any) -> Any:
        assert go.wait(60)  # released when the third save says it waits
        return real_write(*args)

    monkeypatch.setattr(training_state, "write_rank_shard", held_write)
    at_save, pendings = {}, []
    for _ in range(3):
        at_save[trainer.step] = _params(trainer)
        pendings.append(save_training(trainer, tmp_path / "a", async_save=True, keep_last=5))
        if len(pendings) == 2:  # staged while the first is still being written
            assert not any(p.done() for p in pendings) and not notes
        train_steps(trainer, 1)  # the weights change right after the save returned
    assert sum("waits for the save at step" in n for n in notes) == 1, notes
    at_save[trainer.step] = _params(trainer)  # a synchronous save waits for those in flight
    save_training(trainer, tmp_path / "a", keep_last=5)
    assert all(p.done() and not p.errors for p in pendings)
    assert gpu.log.count(("wait_event", "colonnade-ckpt")) == 3  # the writers wait, not training
    entries = (len(model_entries(trainer.chunks, trainer.groups))
               + len(optim_entries(trainer.optimizer, trainer.groups)))
    assert gpu.pinned == 2 * entries  # two sets, each allocated once (none for the sync save)
    assert (tmp_path / "a" / "latest").read_text().strip().endswith(str(max(at_save)))
    for step, want in at_save.items():
        other = make_trainer(Layout(), precision="fp32")
        load_training(other, tmp_path / "a" / f"step_{step:08d}")
        assert other.step == step
        for k, v in _params(other).items():
            assert torch.equal(v, want[k]), (step, k)  # the values at the save point


def test_host_tensors_are_copied_into_reserved_buffers() -> None:
    """On CPU the stage is a copy into buffers reserved ahead (two sets): later in-place
    changes do not reach it, and no save allocates."""
    src = torch.arange(6.0)
    entry = Entry("model/x", src, Piece((0,), (6,)), (6,))
    stager = HostStager()
    stager.reserve([stager.spec(src)]).join()
    assert stager.allocated == 2
    staged = stager.stage([entry], step=1)
    src.add_(100)
    (got,) = stager.ready(staged)
    assert torch.equal(got.tensor, torch.arange(6.0)) and stager.allocated == 2
    stager.release(staged)


@pytest.mark.gpu
def test_gpu_staging_is_pinned_and_ordered() -> None:
    """Real CUDA: pinned buffers, and an in-place update queued right after staging does not
    reach the copy (the current stream waits for it)."""
    dev = torch.device("cuda")
    src = torch.randn(1 << 20, device=dev)
    want = src.cpu()
    stager = HostStager()
    staged = stager.stage([Entry("model/x", src, Piece((0,), (1 << 20,)), (1 << 20,))])
    src.mul_(0).add_(7)
    (entry,) = stager.ready(staged)
    assert entry.tensor.is_pinned() and entry.tensor.device.type == "cpu"
    assert torch.equal(entry.tensor, want)
    assert float(src[0]) == 7.0
