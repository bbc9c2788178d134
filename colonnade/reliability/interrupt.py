"""Ctrl-C and SIGTERM (preemption) stop training at a step boundary that every rank agrees on.

:class:`StopRequest` installs SIGINT and SIGTERM handlers that only note the signal; the
training step hands the pending signal to the step's loss all-reduce as a vote
(:func:`signal_votes`, read back by :func:`agreed_signal`: the MAX over the world group, with
no collective of its own), so every rank stops after the same step even when the signal
reaches them at different times (the elastic agent forwards it to each worker in turn). The
loop then saves a final checkpoint and returns; the caller exits with 128 + the signal number
(130 for SIGINT, 143 for SIGTERM). A second Ctrl-C of a single process interrupts at once
(KeyboardInterrupt). Outside training (data preparation, conversion, set-up),
:func:`sigterm_interrupts` makes SIGTERM unwind as Ctrl-C does, and while a worker pool forks
:func:`stop_signals_deferred` notes either signal and raises it once the fork is done.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

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


def signal_votes(signum: int) -> list[float]:
    """One rank's stop signal as a vote vector over :data:`STOP_SIGNALS` (1.0 at the
    signal's place, 0.0 elsewhere; all zero for ``signum = 0``). Summing the vectors of every
    rank and reading them with :func:`agreed_signal` gives the MAX of the ranks' signals, so
    the vote rides on a sum all-reduce the step takes anyway (the step's loss)."""
    if signum and signum not in STOP_SIGNALS:
        raise ValueError(f"stop signal {signum} is not one of {[int(s) for s in STOP_SIGNALS]}")
    return [1.0 if signum == int(sig) else 0.0 for sig in STOP_SIGNALS]


def agreed_signal(votes: list[float]) -> int:
    """The largest stop signal with a vote in ``votes`` (summed :func:`signal_votes`), 0 for
    none: every rank that reads the same sums stops after the same step."""
    voted = [int(sig) for sig, n in zip(STOP_SIGNALS, votes, strict=True) if n > 0]
    return max(voted, default=0)


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


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would raise KeyboardInterrupt (:func:`sigterm_interrupts`)."""


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block SIGTERM unwinds the main thread as Ctrl-C does (:class:`Terminated`, a
    KeyboardInterrupt), so what clean-up Ctrl-C gets, SIGTERM gets: ``colonnade prepare``
    removes its partial ``data.bin.tmp`` and the directory it created instead of being killed
    with them in place. Handlers installed inside (the training loop's :class:`StopRequest`,
    the launcher's agent) take over while they are in place. Main thread only; elsewhere the
    block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(_signum: int, _frame: FrameType | None) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Within the block Ctrl-C and SIGTERM are only noted; on leaving it the first one noted is
    raised again, to the handlers in place before (KeyboardInterrupt, :class:`Terminated`).

    For a block that forks (a worker pool): the signal may reach any thread of the process,
    and Python then runs its handler in the main thread at the next bytecode, which can be
    inside ``os.fork``'s at-fork hooks (logging's ``_releaseLock``), whose exceptions Python
    prints and ignores: the Ctrl-C was lost and ``prepare`` ran to the end. Blocking the
    signals (``pthread_sigmask``) keeps them from the main thread only. A signal this process
    ignores (``SIG_IGN``: SIGINT of a job a non-interactive shell started with ``&``) stays
    ignored. Main thread only; elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []

    def note(signum: int, _frame: FrameType | None) -> None:
        noted.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in STOP_SIGNALS
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if noted:
            signal.raise_signal(noted[0])
