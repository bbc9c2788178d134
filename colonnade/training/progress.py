"""The training progress bar, and whole log lines around it on a terminal."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool, desc: str = "train",
                 unit: str = "step") -> Iterator[Any]:
    """A tqdm bar of ``total`` steps on the terminal, or None: ``enabled`` False (not rank 0,
    or ``logging.progress=false``), or stderr (where the bar is drawn) is not a terminal, so
    a log file holds plain lines. ``desc`` / ``unit``: the bar's label and what it counts.

    While the bar is drawn, everything printed to stdout goes through ``tqdm.write`` one whole
    line at a time: the bar's line is cleared, the line printed, the bar drawn again below it.
    Without this a line printed while the bar is shown (the first evaluation's ``step 0``
    line, a skipped-step note) starts right after the bar's text, on the bar's line.
    """
    if not enabled:
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib import DummyTqdmFile

    bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False,
               disable=None)  # None: off when stderr is not a terminal
    if bar.disable:
        yield None
        return
    try:
        with contextlib.redirect_stdout(DummyTqdmFile(sys.stdout)):
            yield bar
    finally:
        bar.close()
