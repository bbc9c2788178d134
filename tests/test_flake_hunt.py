"""The flake hunt reads each run's counts and failing tests from pytest's own output."""

from __future__ import annotations

from pathlib import Path

from tests.flake_hunt import _pytest_command, _summary


def test_summary_reads_the_closing_line_before_the_time_table() -> None:
    output = ("....F\nFAILED tests/a/test_x.py::test_y[2] - assert 1 == 2\n"
              "ERROR tests/b/test_z.py::test_w - RuntimeError\n"
              "2 failed, 85 passed, 2181 deselected, 1 error in 9.10s\n"
              "============ time by directory ============\nwall 9 s (budget 720 s)\n")
    got = _summary(output)
    assert got["counts"] == {"failed": 2, "passed": 85, "deselected": 2181, "error": 1}
    assert got["failing"] == ["tests/a/test_x.py::test_y[2]", "tests/b/test_z.py::test_w"]
    assert got["closing"] == "2 failed, 85 passed, 2181 deselected, 1 error in 9.10s"
    assert _summary("") == {"counts": {}, "failing": [], "closing": ""}


def test_the_hunt_selects_the_timing_tests_only() -> None:
    command = _pytest_command(Path("/tmp/x"), ["-x"])
    marker = len(command) - 1 - command[::-1].index("-m")  # after python's own -m pytest
    assert command[marker + 1] == "timing and not gpu"
    assert command[-2:] == ["-x", "tests"] and "--basetemp=/tmp/x" in command
