"""Host copies of an asynchronous save, taken without blocking the training thread.

An async save must write the values at the save point while training goes on. The training
thread only *stages*: a tensor on an accelerator is copied into a page-locked (pinned) host
buffer with a non-blocking copy on a side stream, and an event marks the end of the copies
(:func:`colonnade.device.copy_to_host_async`); the writer thread waits on that event
(:meth:`HostStager.ready`) before it writes. The pinned buffers are allocated at the first save
and reused by every later one (pinning is slow; the shapes a rank saves do not change). A
tensor already in host memory (CPU training) is cloned, which is the snapshot.

The device operations are passed in (:class:`DeviceOps`) so the choice of path is tested on a
machine without a GPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from colonnade import device as dev
from colonnade.checkpoint.format import Entry


class DeviceOps(Protocol):
    """What staging needs from the device layer."""

    def on_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in host memory (then it is cloned, not staged)."""
        ...

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host buffer."""
        ...

    def copy_to_host_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                           device: torch.device) -> Any:
        """Start the (dst, src) copies without blocking; returns what :meth:`wait_event` takes."""
        ...

    def wait_event(self, event: Any) -> None:
        """Block until the copies behind ``event`` are done."""
        ...


class _Device:
    """The real device layer (:mod:`colonnade.device`)."""

    def on_host(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return dev.pinned_empty(shape, dtype)

    def copy_to_host_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                           device: torch.device) -> Any:
        return dev.copy_to_host_async(pairs, device)

    def wait_event(self, event: Any) -> None:
        dev.wait_event(event)


@dataclass
class Staged:
    """A save's entries with host tensors, valid once :meth:`HostStager.ready` returned."""

    entries: list[Entry]
    event: Any = None


class HostStager:
    """Stages a rank's checkpoint entries into reused pinned host buffers (see module doc)."""

    def __init__(self, ops: DeviceOps | None = None) -> None:
        self.ops: DeviceOps = ops or _Device()
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self.allocated = 0
        """Pinned buffers allocated so far (reuse keeps this at one save's count)."""
        self._writer: threading.Thread | None = None

    def _buffer(self, k: int, e: Entry) -> torch.Tensor:
        key = (k, e.name)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != e.tensor.shape or buf.dtype != e.tensor.dtype:
            buf = self.ops.pinned_empty(tuple(e.tensor.shape), e.tensor.dtype)
            self._buffers[key] = buf
            self.allocated += 1
        return buf

    def stage(self, entries: list[Entry]) -> Staged:
        """Start the host copies of ``entries`` and return at once (training thread)."""
        if self._writer is not None:  # the buffers are reused: the last write must be done
            self._writer.join()
            self._writer = None
        out: list[Entry] = []
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        device: torch.device | None = None
        for k, e in enumerate(entries):
            src = e.tensor.detach()
            if self.ops.on_host(src):
                out.append(replace(e, tensor=src.clone()))
                continue
            buf = self._buffer(k, e)
            pairs.append((buf, src))
            device = src.device
            out.append(replace(e, tensor=buf))
        event = self.ops.copy_to_host_async(pairs, device) if device is not None else None
        return Staged(out, event)

    def ready(self, staged: Staged) -> list[Entry]:
        """(writer thread) Wait for the copies; returns the host entries to write."""
        self.ops.wait_event(staged.event)
        return staged.entries

    def writing(self, thread: threading.Thread) -> None:
        """Note the thread writing the staged buffers (the next :meth:`stage` waits for it)."""
        self._writer = thread
