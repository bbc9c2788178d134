"""A pytest plugin: the suite's time grouped by test directory, printed at the end of the run.

Every test's set-up, call and tear-down durations are added to its directory
(``tests/checkpoint``; files directly under ``tests/`` count as ``tests``), so each capability
sees what it costs the suite, against the whole run's wall time. The suite's budget is
:data:`SUITE_BUDGET_S` on a quiet 2-core machine (CI's cap for ``make test`` is 20 minutes).
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import PurePosixPath

import pytest

SUITE_BUDGET_S = 12 * 60.0
"""The whole suite's wall-time target on a quiet 2-core machine (issue 41)."""


class DirectoryTimes:
    """Seconds and test counts per test directory, and the session's wall clock."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, set[str]] = defaultdict(set)
        self.began = time.monotonic()

    @staticmethod
    def directory(nodeid: str) -> str:
        """'tests/data/test_x.py::test_y[1]' -> 'tests/data'; 'tests/test_cli.py::t' -> 'tests'."""
        parts = PurePosixPath(nodeid.split("::", 1)[0]).parts
        return "/".join(parts[:2]) if len(parts) > 2 else "/".join(parts[:1])

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        where = self.directory(report.nodeid)
        self.seconds[where] += report.duration
        self.tests[where].add(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.seconds:
            return
        wall = time.monotonic() - self.began
        total = sum(self.seconds.values())
        write = terminalreporter.write_line
        terminalreporter.section("time by directory")
        write(f"{'directory':<28} {'tests':>6} {'seconds':>8} {'share':>6} {'s/test':>7}")
        for where, secs in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            n = len(self.tests[where])
            write(f"{where:<28} {n:>6} {secs:>8.1f} {secs / total:>6.1%} {secs / n:>7.2f}")
        write(f"{'all tests':<28} {sum(map(len, self.tests.values())):>6} {total:>8.1f}")
        write(f"wall {wall:.0f} s (budget {SUITE_BUDGET_S:.0f} s on a quiet 2-core machine: "
              f"{wall / SUITE_BUDGET_S:.0%} of it)")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(DirectoryTimes(), "colonnade-time-budget")
