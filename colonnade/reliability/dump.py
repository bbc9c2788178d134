"""Text dumps of a rank's state for failure reports: its collectives and its Python stacks.

Both functions only read; they are safe to call from the watchdog thread while the main thread
is blocked inside a collective (the backend releases the GIL while it waits).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

from colonnade.parallel.comm import CommStats


def comm_state(stats: CommStats | None, now: float | None = None) -> list[str]:
    """Lines naming the last posted collective and every collective still in flight."""
    if stats is None:
        return ["collectives: none recorded (process groups not built yet)"]
    now = time.monotonic() if now is None else now
    pending = stats.pending()
    lines = [f"last collective: {stats.last.describe(now) if stats.last else 'none yet'}"]
    if pending:
        lines += [f"in flight: {rec.describe(now)}" for rec in pending]
    else:
        lines.append("in flight: nothing")
    lines.append(f"collectives posted: {stats.posted}; last completion "
                 f"{max(0.0, now - stats.progressed_at()):.1f} s ago")
    return lines


def last_op_text(stats: CommStats | None, ages: bool = True) -> str:
    """One line: the operation in flight (oldest) or else the last one posted (``ages``: with
    how long ago, as of now)."""
    if stats is None:
        return "none"
    pending = stats.pending()
    rec = pending[0] if pending else stats.last
    return rec.describe(ages=ages) if rec is not None else "none"


def python_stacks() -> str:
    """Stacks of every Python thread, most recent call last, main thread first.

    Called from a helper thread (the watchdog), that thread itself is left out.
    """
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    order = sorted((i for i in frames if i == main or i != me),
                   key=lambda ident: (ident != main, names.get(ident, "")))
    out = []
    for ident in order:
        name = names.get(ident, f"thread {ident}")
        stack = "".join(traceback.format_stack(frames[ident]))
        out.append(f"Thread '{name}' (most recent call last):\n{stack}")
    return "\n".join(out)
