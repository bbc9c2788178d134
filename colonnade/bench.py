"""`colonnade bench`: list and run the side-by-side benchmark scripts of a source checkout.

    colonnade bench                            # every benchmark with its one-line description
    colonnade bench planner_cpu --rounds 8     # run benchmarks/planner_cpu.py --rounds 8

The scripts live in ``benchmarks/`` beside the package, not inside it: they compare against
peers that are not dependencies of Colonnade (DDP, FSDP2, DTensor, torch pipelining), so they
are not installed with it.  Each prints a table and writes JSON to ``benchmarks/results/``.
Ranks run one thread each: ``OMP_NUM_THREADS`` is 1 in the script's environment unless set.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the source checkout this package was imported from."""
    return Path(__file__).resolve().parents[1] / "benchmarks"


def describe(script: Path) -> str:
    """The first line of a script's module docstring (read, not executed)."""
    doc = ast.get_docstring(ast.parse(script.read_text()))
    return doc.splitlines()[0] if doc else ""


def is_script(path: Path) -> bool:
    """Whether ``path`` runs as a script (a top-level ``if __name__ == "__main__":``), rather
    than being a module the scripts import (``ratios``, ``pipeline_train``, ...)."""
    def is_main_guard(node: ast.stmt) -> bool:
        test = node.test if isinstance(node, ast.If) else None
        return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
                and test.left.id == "__name__" and len(test.comparators) == 1
                and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value == "__main__")

    return any(is_main_guard(node) for node in ast.parse(path.read_text()).body)


def available() -> dict[str, Path]:
    """Benchmark name -> script, for every ``benchmarks/*.py`` that runs as a script."""
    root = benchmarks_dir()
    scripts = sorted(root.glob("*.py")) if root.is_dir() else []
    return {p.stem: p for p in scripts if is_script(p)}


def run_bench(name: str | None, args: list[str]) -> int:
    """List the benchmarks (no ``name``) or run one with ``args``; returns the exit status."""
    scripts = available()
    if not scripts:
        print(f"colonnade bench: no benchmarks at {benchmarks_dir()}; they ship with the "
              "source checkout (git clone), not with an installed package.", file=sys.stderr)
        return 2
    if name is None:
        width = max(map(len, scripts))
        for stem, path in scripts.items():
            print(f"{stem:<{width}}  {describe(path)}")
        print("\nrun one: colonnade bench NAME [its options]; NAME --help lists them")
        return 0
    if name not in scripts:
        print(f"colonnade bench: unknown benchmark '{name}'; choose from "
              f"{', '.join(scripts)}", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call([sys.executable, str(scripts[name]), *args], env=env)
