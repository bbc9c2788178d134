"""Ctrl-C and SIGTERM (preemption) stop training at a step boundary that every rank agrees on.

:class:`StopRequest` installs SIGINT and SIGTERM handlers that only note the signal; the
training loop asks :meth:`StopRequest.agreed` once per step, which all-reduces (MAX) one int
over the world group, so every rank stops after the same step even when the signal reaches
them at different times (the elastic agent forwards it to each worker in turn). The loop then
saves a final checkpoint and returns; the caller exits with 128 + the signal number
(130 for SIGINT, 143 for SIGTERM). A second Ctrl-C of a single process interrupts at once
(KeyboardInterrupt).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: int) -> int:
    """Shell convention for a process stopped by ``signum``: 128 + its number."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    """'SIGINT', 'SIGTERM', ..."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """The first SIGINT / SIGTERM received by this process, and the ranks' agreement on it."""

    def __init__(self, second_sigint_aborts: bool = True) -> None:
        self.signum = 0
        """The first stop signal received (0: none)."""
        self.second_sigint_aborts = second_sigint_aborts
        """A second SIGINT raises KeyboardInterrupt at once. Off in launched ranks: Ctrl-C in a
        terminal reaches them directly and again through the agent, which forwards it."""
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        """Handle SIGINT and SIGTERM (main thread only; elsewhere this does nothing)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[int(sig)] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum and signum == signal.SIGINT and self.second_sigint_aborts:
            self.restore()
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def agreed(self, world: Any, device: torch.device) -> int:
        """The stop signal any rank received (MAX of one int over ``world``, a
        :class:`~colonnade.parallel.comm.CommGroup`), 0 for none. Collective: call it at the
        same point of every step on every rank."""
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        world.all_reduce(flag, op=dist.ReduceOp.MAX, name="stop_flag")
        return int(flag.item())
