"""The ``gpu`` marker (not gpu-marked itself): a plain run deselects gpu tests, so CI reports no
skips; ``-m gpu`` selects them, and where no CUDA device is visible each one errors instead of
being skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
                          check=False)


def test_gpu_tests_are_deselected_by_default_and_fail_without_a_gpu() -> None:
    plain = _pytest("tests/gpu/test_gpu.py")
    assert plain.returncode == 5, plain.stdout  # 5: nothing selected
    assert "4 deselected" in plain.stdout and "skipped" not in plain.stdout
    chosen = _pytest("-m", "gpu", "tests/gpu/test_gpu.py", "-k", "sdpa")
    assert chosen.returncode == 1, chosen.stdout
    assert "1 error" in chosen.stdout and "needs a CUDA device" in chosen.stdout
    assert "skipped" not in chosen.stdout
