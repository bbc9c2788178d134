"""The training progress bar on a terminal: every log line is a line of its own. The first
evaluation's ``step 0`` line was printed while the bar was drawn, so a terminal showed it after
the bar's text, on the bar's line."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from colonnade.cli import main
from tests.reliability.jobs import tiny_args


class FakeTerminal(io.StringIO):
    """stdout and stderr of a terminal: one stream, a tty."""

    def isatty(self) -> bool:
        return True


def screen(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: '\\r' returns to column 0 and what follows
    overwrites, trailing blanks are not seen, escape sequences are dropped."""
    lines = []
    for raw in re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text).split("\n"):
        row: list[str] = []
        col = 0
        for ch in raw:
            if ch == "\r":
                col = 0
                continue
            row[col:col + 1] = [ch]
            col += 1
        lines.append("".join(row).rstrip())
    return lines


def test_log_lines_are_whole_lines_under_the_progress_bar(
        corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text, prepared = corpus
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    args = tiny_args(text, prepared, tmp_path / "run", training__steps=2,
                     training__eval_interval=2, logging__progress="true")
    assert main(["train", *args]) == 0
    shown = screen(terminal.getvalue())
    assert any(line.startswith("train:") for line in terminal.getvalue().split("\r")), shown
    logged = [line for line in shown if re.search(r"step +\d+ \|", line)]
    assert [line.split("|")[0].split() for line in logged] == [
        ["step", "0"], ["step", "1"], ["step", "2"]], shown
