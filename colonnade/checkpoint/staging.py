"""Host copies of an asynchronous save, taken without stalling the training thread.

An async save must write the values at the save point while training goes on. The training
thread only *stages*: each entry is copied into a host buffer, and a writer thread writes the
buffers. What could stall the training thread, and what is done about it:

- Allocating (and pinning) GBs of host buffers: done ahead, by :meth:`HostStager.reserve` in a
  background thread at start-up; :meth:`HostStager.stage` waits for it only when a save comes
  before it has finished (logged). The buffers are reused by every later save.
- Waiting for the previous save's writer: there are two buffer sets (double buffering), so a
  save can stage while the previous one is still being written; only a third save in flight
  waits for the oldest set to be written (logged, with the seconds waited).
- The device-to-host copy: queued on a side stream, non-blocking into pinned memory; the host
  returns at once and the writer thread waits on the copy's event (:meth:`HostStager.ready`).

Stream order (a GPU; every arrow is a device-side wait, the host never blocks)::

    current: ... last step's writes --(A)--> | --(B: waits event E)--> next step's writes
    side:                                 copies ... record E

(A) the side stream first waits for the current stream, so the copies read what the last step
wrote; (B) the current stream then waits for E, so the next step's in-place updates of the
parameters and optimizer states cannot overwrite a tensor before the copy has read it. A
tensor already in host memory (CPU training) is copied synchronously into its reused buffer,
which is the snapshot.

The device operations are passed in (:class:`DeviceOps`), so the choice of path and the
stream order are tested on a machine without a GPU (tests/checkpoint/streams.py simulates two
streams and catches a missing (A) or (B)).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from colonnade import device as dev
from colonnade.checkpoint.format import Entry

BUFFER_SETS = 2
"""Host buffer sets: a save stages into a free one while the other may still be written."""


class DeviceOps(Protocol):
    """What staging needs from the device layer (streams and events are opaque handles)."""

    def on_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in host memory (then it is copied synchronously)."""
        ...

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        """A page-locked host buffer for copies from ``device``."""
        ...

    def current_stream(self, device: torch.device) -> Any:
        """The stream training queues its work on."""
        ...

    def new_stream(self, device: torch.device) -> Any:
        """A side stream for the copies."""
        ...

    def stream_wait_stream(self, waiter: Any, waited: Any) -> None:
        """``waiter``'s later work starts after ``waited``'s work queued so far."""
        ...

    def copy_on_stream(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` without blocking the host."""
        ...

    def record_event(self, stream: Any) -> Any:
        """An event done when ``stream``'s work queued so far is."""
        ...

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        """``stream``'s later work waits for ``event``."""
        ...

    def wait_event(self, event: Any) -> None:
        """Block the calling (writer) thread until ``event`` is done."""
        ...


class _Device:
    """The real device layer (:mod:`colonnade.device`)."""

    def on_host(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        return dev.pinned_empty(shape, dtype, device)

    def current_stream(self, device: torch.device) -> Any:
        return dev.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return dev.new_stream(device)

    def stream_wait_stream(self, waiter: Any, waited: Any) -> None:
        dev.stream_wait_stream(waiter, waited)

    def copy_on_stream(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        dev.copy_on_stream(dst, src, stream)

    def record_event(self, stream: Any) -> Any:
        return dev.record_event(stream)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        dev.stream_wait_event(stream, event)

    def wait_event(self, event: Any) -> None:
        dev.wait_event(event)


Spec = tuple[tuple[int, ...], torch.dtype, torch.device, bool]
"""(shape, dtype, device, in host memory) of an entry's tensor: what its buffer must match."""


@dataclass
class BufferSet:
    """One set of host buffers (entry index -> buffer) and whether a save is using it."""

    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    free: threading.Event = field(default_factory=threading.Event)
    """Set while no save uses the set (cleared by :meth:`HostStager.stage`, set again by
    :meth:`HostStager.release` once its writer has written the buffers)."""
    step: int = -1
    """The step of the save using (or that last used) the set."""

    def __post_init__(self) -> None:
        self.free.set()


@dataclass
class Staged:
    """A save's entries with host tensors, valid once :meth:`HostStager.ready` returned."""

    entries: list[Entry]
    event: Any = None
    buffers: BufferSet | None = None


class HostStager:
    """Stages a rank's checkpoint entries into two reused sets of host buffers (module doc).

    ``note`` receives the lines worth logging (a save that waits, and for how long)."""

    def __init__(self, ops: DeviceOps | None = None,
                 note: Callable[[str], None] | None = None) -> None:
        self.ops: DeviceOps = ops or _Device()
        self.note = note or (lambda _line: None)
        self.sets = [BufferSet() for _ in range(BUFFER_SETS)]
        self.allocated = 0
        """Host buffers allocated so far (reuse keeps this at two saves' count)."""
        self._streams: dict[torch.device, Any] = {}
        self._reserving: threading.Thread | None = None
        self.in_flight: list[Any] = []
        """The caller's records of the saves staged here and not yet known to be done."""
        self.waited_s = 0.0
        """Seconds the training thread waited in :meth:`stage` (allocation or a busy set)."""

    def spec(self, t: torch.Tensor) -> Spec:
        """The buffer spec of an entry's tensor."""
        return tuple(t.shape), t.dtype, t.device, self.ops.on_host(t)

    def _new_buffer(self, spec: Spec) -> torch.Tensor:
        shape, dtype, device, host = spec
        self.allocated += 1
        if host:  # pinning would buy nothing: the copy is a host memcpy
            return torch.empty(shape, dtype=dtype).zero_()  # pages faulted in now
        return self.ops.pinned_empty(shape, dtype, device)

    def _fill(self, bufs: BufferSet, specs: list[Spec]) -> None:
        """Allocate the buffers of ``bufs`` that ``specs`` lack or that no longer match."""
        for k, spec in enumerate(specs):
            have = bufs.buffers.get(k)
            if have is None or (tuple(have.shape), have.dtype) != spec[:2]:
                bufs.buffers[k] = self._new_buffer(spec)

    def reserve(self, specs: list[Spec]) -> threading.Thread:
        """Allocate both buffer sets for entries of these specs in a background thread (pinned
        host memory takes seconds per GB to allocate); returns the thread."""
        def run() -> None:
            for bufs in self.sets:
                self._fill(bufs, specs)

        self._reserving = threading.Thread(target=run, name="colonnade-pin", daemon=True)
        self._reserving.start()
        return self._reserving

    def _take(self, step: int) -> BufferSet:
        """A free buffer set for the save at ``step``, waiting (logged) when none is."""
        t0 = time.perf_counter()
        if self._reserving is not None:
            if self._reserving.is_alive():
                self.note(f"checkpoint: the save at step {step} waits for its host buffers "
                          "to be allocated")
            self._reserving.join()
            self._reserving = None
        bufs = next((b for b in self.sets if b.free.is_set()), None)
        if bufs is None:
            bufs = min(self.sets, key=lambda b: b.step)
            self.note(f"checkpoint: the save at step {step} waits for the save at step "
                      f"{bufs.step} to be written (both host buffer sets are in use; "
                      "save less often or write faster)")
            bufs.free.wait()
            self.note(f"checkpoint: the save at step {step} waited "
                      f"{time.perf_counter() - t0:.2f} s")
        bufs.free.clear()
        bufs.step = step
        self.waited_s += time.perf_counter() - t0
        return bufs

    def stage(self, entries: list[Entry], step: int = 0) -> Staged:
        """Start the host copies of ``entries`` and return at once (training thread)."""
        bufs = self._take(step)
        self._fill(bufs, [self.spec(e.tensor) for e in entries])
        out: list[Entry] = []
        on_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for k, e in enumerate(entries):
            src, buf = e.tensor.detach(), bufs.buffers[k]
            if self.ops.on_host(src):
                buf.copy_(src)  # host memory: this copy is the snapshot
            else:
                on_device.setdefault(src.device, []).append((buf, src))
            out.append(replace(e, tensor=buf))
        events = [self._copy_async(device, pairs) for device, pairs in on_device.items()]
        return Staged(out, events, bufs)

    def _copy_async(self, device: torch.device,
                    pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queue the copies on the side stream in the order of the module doc; the event."""
        ops = self.ops
        current = ops.current_stream(device)
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = ops.new_stream(device)
        ops.stream_wait_stream(side, current)  # (A) after the last step's writes
        for dst, src in pairs:
            ops.copy_on_stream(dst, src, side)
        event = ops.record_event(side)
        ops.stream_wait_event(current, event)  # (B) before the next step's writes
        return event

    def ready(self, staged: Staged) -> list[Entry]:
        """(writer thread) Wait for the copies; returns the host entries to write."""
        for event in staged.event or []:
            self.ops.wait_event(event)
        return staged.entries

    def release(self, staged: Staged) -> None:
        """(writer thread) The buffers are written: a later save may stage into them."""
        if staged.buffers is not None:
            staged.buffers.free.set()
