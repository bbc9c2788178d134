"""A fake GPU for the staging tests: streams as queues of operations, run by a scheduler that
picks an adversarial order, so a missing device-side wait shows up as wrong values.

CUDA semantics modelled: work on one stream runs in the order queued; a stream waiting on an
event runs nothing after the wait until the event's record has run on its own stream; a
copy reads its source when it *runs*, not when it is queued; the host blocks only in
:meth:`FakeGpu.wait_event`. Among the streams whose next operation may run, the scheduler runs
``prefer``'s first ('current': the training stream races ahead; 'side': the copies do), the two
extremes a real GPU may take.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Op = tuple[str, object]  # ("run", fn) | ("record", event id) | ("wait", event id)


@dataclass
class FakeGpu:
    """:class:`colonnade.checkpoint.staging.DeviceOps` on host tensors that it treats as device
    memory. ``drop`` names device ops to ignore (to prove the tests catch their absence);
    ``host_runs_current``: the host's own work (a training step run eagerly on the CPU) is
    the current stream's, so its queue is drained whenever the host issues more work after
    staging (at the current stream's wait on the copies' event)."""

    prefer: str = "current"
    drop: tuple[str, ...] = ()
    host_runs_current: bool = False
    log: list[tuple[str, str]] = field(default_factory=list)
    pinned: int = 0
    queues: dict[str, list[Op]] = field(default_factory=lambda: {"current": []})
    done: set[int] = field(default_factory=set)
    _events: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _note(self, what: str) -> bool:
        self.log.append((what, threading.current_thread().name))
        return what not in self.drop

    def _event(self) -> int:
        self._events += 1
        return self._events

    def launch(self, fn: Callable[[], object], stream: str = "current") -> None:
        """Queue a kernel (e.g. a training step's in-place update) on ``stream``."""
        self.queues[stream].append(("run", fn))

    def on_host(self, t: torch.Tensor) -> bool:
        return False

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        self.pinned += 1
        return torch.full(shape, float("nan"), dtype=dtype)

    def current_stream(self, device: torch.device) -> str:
        return "current"

    def new_stream(self, device: torch.device) -> str:
        name = f"side{len(self.queues)}"
        self.queues[name] = []
        return name

    def stream_wait_stream(self, waiter: str, waited: str) -> None:
        if self._note("stream_wait_stream"):
            event = self._event()
            self.queues[waited].append(("record", event))
            self.queues[waiter].append(("wait", event))

    def copy_on_stream(self, dst: torch.Tensor, src: torch.Tensor, stream: str) -> None:
        self._note("copy")
        self.queues[stream].append(("run", lambda: dst.copy_(src)))

    def record_event(self, stream: str) -> int:
        self._note("record_event")
        event = self._event()
        self.queues[stream].append(("record", event))
        return event

    def stream_wait_event(self, stream: str, event: int) -> None:
        if self._note("stream_wait_event"):
            self.queues[stream].append(("wait", event))
        if self.host_runs_current:
            with self._lock:
                self._run_until(lambda: not self.queues["current"])

    def wait_event(self, event: int) -> None:
        self._note("wait_event")
        with self._lock:
            self._run_until(lambda: event in self.done)

    def _run_until(self, finished: Callable[[], bool]) -> None:
        while not finished():
            first = self.prefer == "current"
            names = sorted(self.queues, key=lambda n: (n == "current") != first)
            ready = [n for n in names if self.queues[n] and (
                self.queues[n][0][0] != "wait" or self.queues[n][0][1] in self.done)]
            if not ready:
                raise RuntimeError(f"streams deadlocked: {self.queues}")
            kind, arg = self.queues[ready[0]].pop(0)
            if kind == "run":
                arg()  # type: ignore[operator]
            elif kind == "record":
                self.done.add(arg)  # type: ignore[arg-type]
