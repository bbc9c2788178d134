"""Helpers of the workflow tests: run ``colonnade`` as a user would and read what it left."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colonnade.cli import main
from tests.reliability.jobs import REPO, Job

JOB_TIMEOUT_S = 240


def run_cli(argv: list[str], timeout: float = JOB_TIMEOUT_S) -> tuple[int, str]:
    """``python -m colonnade.cli argv`` in its own process; (exit status, stdout + stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "colonnade.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)
    return proc.returncode, proc.stdout + proc.stderr


def hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory`` by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def steps_logged(run_dir: Path) -> list[int]:
    """The step of every record of metrics.jsonl, in file order (duplicates kept)."""
    return steps_logged_file(run_dir / "metrics.jsonl")


def steps_logged_file(path: Path) -> list[int]:
    """The step of every record of a JSONL metrics file, in file order."""
    return [int(json.loads(line)["step"]) for line in path.read_text().splitlines()]


def wait_for_records(job: Job, run: Path, count: int) -> None:
    """Block until ``run/metrics.jsonl`` holds ``count`` records (the job still running)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    path = run / "metrics.jsonl"
    while not path.exists() or len(path.read_text().splitlines()) < count:
        assert job.proc.poll() is None, job.output()
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.05)


def stopped_at(out: str, signame: str) -> int:
    """The step of the job's "interrupted by SIGNAME at step N; " line (asserted present)."""
    found = re.search(rf"interrupted by {signame} at step (\d+); ", out)
    assert found, out
    return int(found.group(1))


def assert_clean(out: str) -> None:
    """A stop that printed no traceback, no launcher-failure report and no warning from
    Python's resource tracker (a rank ending by ``os._exit`` with a multiprocessing lock
    alive: tqdm's default one, before ``run_rank`` gave tqdm a thread lock)."""
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "launcher failed" not in out and "likely cause" not in out, out
    assert "leaked semaphore" not in out and "resource_tracker" not in out, out


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps: range,
                       rel: float) -> None:
    """Every step of ``steps`` is logged in ``got`` and equals ``want`` within ``rel``."""
    assert set(steps) <= set(got), (got, want)
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=rel, abs=0.0), (step, got, want)


def greedy_text(model_dir: Path, capsys: pytest.CaptureFixture[str], prompt: str) -> str:
    """What ``colonnade generate`` prints for ``prompt`` with greedy decoding (12 tokens)."""
    capsys.readouterr()
    assert main(["generate", str(model_dir), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "12", "--device", "cpu"]) == 0
    return capsys.readouterr().out
