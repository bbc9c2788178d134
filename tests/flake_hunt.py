"""The flake hunt: the tests that race the OS, run again and again on a loaded machine.

    python -m tests.flake_hunt --rounds 10 --copies 2 --json flake_hunt.json

Each round starts ``copies`` pytest processes at once over the tests marked ``timing``
(signals, kills, hangs, subprocesses, threads, timeouts, wall clocks: see conftest), so every
copy runs on a machine the others load; ``rounds`` rounds run one after another. A run that
fails lists its failing tests. Prints one line per run and a summary, writes it all as JSON
with ``--json``, and exits 1 if any run failed. ``make flake-hunt`` runs the default hunt
(10 rounds of 2 copies: 20 runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_COUNTS = re.compile(r"(\d+) (passed|failed|error|errors|skipped|deselected)")


def _pytest_command(basetemp: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE",  # -q: addopts
            "-m", "timing and not gpu", f"--basetemp={basetemp}", *extra, "tests"]


def _summary(output: str) -> dict[str, object]:
    """Counts from pytest's closing line ('2 failed, 85 passed, ... in 9.1s', the last line
    with counts: the time table may follow it) and the FAILED / ERROR test ids of ``-rfE``."""
    closing = next((line for line in reversed(output.splitlines())
                    if _COUNTS.search(line) and " in " in line), "")
    counts = {word.rstrip("s") if word == "errors" else word: int(n)
              for n, word in _COUNTS.findall(closing)}
    failing = [line.split(" ", 2)[1] for line in output.splitlines()
               if line.startswith(("FAILED ", "ERROR "))]
    return {"counts": counts, "failing": failing, "closing": closing}


def hunt(rounds: int, copies: int, extra: list[str]) -> list[dict[str, object]]:
    """Run the rounds; one record per run (round, copy, exit status, seconds, counts)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="flake-hunt-") as tmp:
        for r in range(rounds):
            began = time.monotonic()
            procs = []
            for c in range(copies):
                log = Path(tmp) / f"r{r}c{c}.log"
                with open(log, "w") as out:
                    procs.append((c, log, subprocess.Popen(
                        _pytest_command(Path(tmp) / f"r{r}c{c}", extra), cwd=REPO, env=env,
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        start_new_session=True)))
            for c, log, proc in procs:
                status = proc.wait()
                record = {"round": r, "copy": c, "status": status,
                          "seconds": round(time.monotonic() - began, 1),
                          **_summary(log.read_text())}
                runs.append(record)
                print(f"round {r + 1}/{rounds} copy {c + 1}/{copies}: exit {status}, "
                      f"{record['closing']}", flush=True)
                for test in record["failing"]:  # type: ignore[union-attr]
                    print(f"    {test}", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="rounds, one after another")
    parser.add_argument("--copies", type=int, default=2, help="pytest copies at once per round")
    parser.add_argument("--json", type=Path, help="write every run's record here")
    args, extra = parser.parse_known_args(argv)
    if args.rounds < 1 or args.copies < 1:
        parser.error("--rounds and --copies must be >= 1")
    began = time.monotonic()
    runs = hunt(args.rounds, args.copies, extra)
    failed = [run for run in runs if run["status"] != 0]
    print(f"flake hunt: {len(failed)} of {len(runs)} runs failed "
          f"({args.rounds} rounds x {args.copies} copies, {time.monotonic() - began:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "copies": args.copies,
                                         "failed_runs": len(failed), "runs": runs}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
