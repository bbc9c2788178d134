"""Import a script of benchmarks/ in a test, the one way the benchmark smoke tests do it."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from unittest import mock

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
"""The benchmarks folder (its scripts import their siblings, e.g. ``workloads``)."""


def load_benchmark(script: str, module_name: str) -> ModuleType:
    """benchmarks/``script`` imported as ``module_name`` (once per session), with benchmarks/ on
    sys.path while it loads and without keeping the environment defaults it sets (thread
    counts). ``module_name`` must not be a tests package's name: the rank pool imports rank
    functions by module name first."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ), mock.patch.object(sys, "path", [str(BENCH), *sys.path]):
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return module
