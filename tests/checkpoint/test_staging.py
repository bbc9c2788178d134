"""Async checkpoint staging: the training thread only starts host copies (pinned buffers,
non-blocking copies, an event), the writer waits on the event, buffers are reused."""

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

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`


class FakeGpu:
    """Device ops that treat every tensor as device memory. A copy is asynchronous: its source
    values are fixed when it is queued (stream order) but land in the host buffer only when
    someone waits on its event, so a writer that does not wait writes garbage."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.pinned = 0
        self._queued: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _note(self, what: str) -> None:
        self.log.append((what, threading.current_thread().name))

    def on_host(self, t: torch.Tensor) -> bool:
        return False

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.pinned += 1
        return torch.full(shape, float("nan"), dtype=dtype)

    def copy_to_host_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                           device: torch.device) -> int:
        self._note("copy")
        event = len(self._queued)
        self._queued[event] = [(dst, src.clone()) for dst, src in pairs]
        return event

    def wait_event(self, event: int) -> None:
        self._note("wait")
        for dst, values in self._queued.pop(event):
            dst.copy_(values)


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {p.sharding.key: p.detach().clone() for p in trainer.chunks[0].parameters()}


def test_async_save_stages_and_writer_waits(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = make_trainer(Layout(), precision="fp32")
    train_steps(trainer, 1)
    fake = FakeGpu()
    trainer.checkpoint_stager = HostStager(fake)
    go = threading.Event()
    real_write = training_state.write_rank_shard

    def blocked_write(*args: Any) -> Any:
        assert go.wait(60)
        fake._note("write")
        return real_write(*args)

    monkeypatch.setattr(training_state, "write_rank_shard", blocked_write)
    at_save = _params(trainer)
    pending = save_training(trainer, tmp_path / "a", async_save=True)
    # the training thread is back while the writer has not written anything
    assert pending.thread is not None and pending.thread.is_alive()
    assert not (tmp_path / "a" / "latest").exists()
    assert fake.log[0] == ("copy", "MainThread") and ("write", "colonnade-ckpt") not in fake.log
    train_steps(trainer, 1)  # the weights change right after the save returned
    assert any(not torch.equal(at_save[k], v) for k, v in _params(trainer).items())
    go.set()
    pending.wait()
    assert fake.log == [("copy", "MainThread"), ("wait", "colonnade-ckpt"),
                        ("write", "colonnade-ckpt")]
    pinned = fake.pinned
    assert pinned == (len(model_entries(trainer.chunks, trainer.groups))
                      + len(optim_entries(trainer.optimizer, trainer.groups)))  # one each
    other = make_trainer(Layout(), precision="fp32")
    load_training(other, tmp_path / "a")
    for k, v in _params(other).items():
        assert torch.equal(v, at_save[k]), k  # the values at the save point
    save_training(trainer, tmp_path / "a", async_save=True).wait()
    assert fake.pinned == pinned  # the pinned buffers are reused by the next save


def test_host_tensors_are_cloned() -> None:
    """On CPU the stage is a plain clone: later in-place changes do not reach it."""
    src = torch.arange(6.0)
    stager = HostStager()
    staged = stager.stage([Entry("model/x", src, Piece((0,), (6,)), (6,))])
    src.add_(100)
    (entry,) = stager.ready(staged)
    assert torch.equal(entry.tensor, torch.arange(6.0)) and stager.allocated == 0


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
