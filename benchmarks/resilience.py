"""Memory snapshots and the recovery ladder: what they cost and what they save.

    .venv/bin/python benchmarks/resilience.py [--worlds 4 8] [--steps 40] [--rounds 2]
        [--json PATH]

For the tiny Llama (2 layers, hidden 32, seq 16) at tp2 x dp(world/2), real jobs of
``colonnade train --nproc N`` on CPU/gloo, side by side in one run:

1. Snapshot overhead: the same job with ``--checkpoint.memory_interval=0`` and ``=1``,
   alternating for ``--rounds`` rounds; the median step time over steps 6..steps (from
   metrics.jsonl) of each, the ratio, and the snapshot bytes per rank (own + the partner's
   copy, from the start-up line).
2. Recovery: a job with ``--max-restarts 1`` in which the benchmark SIGKILLs rank 1 (from
   outside, as a node failure would) once its heartbeat says step ``kill`` has begun, and
   deletes the memory snapshot files that rank held (its node's memory is gone). Memory:
   ``--checkpoint.memory_interval=1`` (rank 1 restores from its partner's copy); disk (today's
   restart): ``--checkpoint.interval=5``, no snapshots. Reported: the seconds from the kill to
   the next completed step (rank 0's heartbeat of the restarted attempt begins step
   kill + 1), and the completed steps lost (recomputed). In process
   (``--checkpoint.restart=in-process`` with memory snapshots): only rank 1 is replaced, the
   others rejoin in their processes; until rank 0 reports the next completed step.

This machine is shared and noisy: compare the ratios of one run, not absolute times.
Writes benchmarks/results/resilience.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.reliability.jobs import heartbeat, tiny_args, write_corpus  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "resilience.json"
KILL_STEP = 8
DISK_INTERVAL = 5
BACKSTOP_S = 900.0


def _job(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``colonnade train argv`` with its logging.dir (the log's stem) and memory_dir
    cleared first (an earlier run's heartbeats and snapshots would be read as this one's)."""
    shutil.rmtree(log.with_suffix(""), ignore_errors=True)
    for arg in argv:
        if arg.startswith("--checkpoint.memory_dir="):
            shutil.rmtree(arg.split("=", 1)[1], ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with log.open("wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "colonnade.cli", "train", *argv],
                                cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _finish(proc: subprocess.Popen[bytes], log: Path) -> str:
    status = proc.wait(timeout=BACKSTOP_S)
    out = log.read_text(errors="replace")
    if status != 0:
        raise RuntimeError(f"job failed ({status}):\n{out[-3000:]}")
    return out


def _step_times(run: Path) -> list[float]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [float(r["step_time_s"]) for r in recs if "step_time_s" in r and r["step"] > 5]


def _args(data: tuple[Path, Path], run: Path, world: int, steps: int, **extra: Any) -> list[str]:
    return ["--nproc", str(world), *tiny_args(*data, run, parallel__tp=2,
                                                training__steps=steps, **extra)]


def overhead(data: tuple[Path, Path], work: Path, world: int, steps: int,
             rounds: int) -> dict[str, Any]:
    """Median step time without and with a snapshot every step: the two jobs alternate
    (order reversed every round) and each variant's median is over all its rounds' steps."""
    out: dict[str, Any] = {}
    times: dict[int, list[float]] = {0: [], 1: []}
    for k in range(rounds):
        for interval in ((0, 1) if k % 2 == 0 else (1, 0)):
            run = work / f"w{world}-overhead-m{interval}-r{k}"
            log = run.with_suffix(".log")
            text = _finish(_job(_args(data, run, world, steps,
                                      checkpoint__memory_interval=interval,
                                      checkpoint__memory_dir=work / f"mem{world}"), log), log)
            times[interval] += _step_times(run)
            found = re.search(r"([0-9.]+) MiB per rank at most \(own ([0-9.]+) MiB", text)
            if found:
                out["held_mib_per_rank"] = float(found.group(1))
                out["own_mib_per_rank"] = float(found.group(2))
    for interval, got in times.items():
        out[f"step_s_memory{interval}"] = statistics.median(got)
    out["overhead"] = out["step_s_memory1"] / out["step_s_memory0"] - 1.0
    out["rounds"] = rounds
    return out


def recovery(data: tuple[Path, Path], work: Path, world: int, memory: bool,
             in_process: bool = False) -> dict[str, Any]:
    """Kill rank 1 at step KILL_STEP; seconds to the next completed step, steps lost.
    ``in_process``: --checkpoint.restart=in-process (memory snapshots): only rank 1 is
    replaced; the next completed step is the one rank 0 reports after the rejoin."""
    name = "in-process" if in_process else "memory" if memory else "disk"
    run, mem = work / f"w{world}-recover-{name}", work / f"mem{world}-{name}"
    extra: dict[str, Any] = ({"checkpoint__memory_interval": 1, "checkpoint__memory_dir": mem}
                             if memory else {"checkpoint__interval": DISK_INTERVAL})
    if in_process:
        extra["checkpoint__restart"] = "in-process"
    log = run.with_suffix(".log")
    proc = _job(["--max-restarts", "1", *_args(data, run, world, KILL_STEP + 4, **extra)], log)
    deadline = time.monotonic() + BACKSTOP_S
    while int((heartbeat(run, 1) or {}).get("step", 0)) < KILL_STEP:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log.read_text(errors="replace")[-3000:])
        time.sleep(0.01)
    victim = heartbeat(run, 1) or {}
    os.kill(int(victim["pid"]), signal.SIGKILL)
    killed = time.time()
    for path in mem.glob("rank00001.*.own.*"):  # its node's memory is gone
        path.unlink(missing_ok=True)
    for path in mem.glob("*.peer-on00001.*"):
        path.unlink(missing_ok=True)
    def recovered() -> bool:
        if in_process:
            return "s after the failure" in log.read_text(errors="replace")
        return int((heartbeat(run, 0, attempt=1) or {}).get("step", 0)) >= KILL_STEP + 1

    while not recovered():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log.read_text(errors="replace")[-3000:])
        time.sleep(0.01)
    seconds = time.time() - killed
    text = _finish(proc, log)
    lines = text.splitlines()
    if in_process:
        line = next(x for x in lines if "rejoined as generation 1" in x)
        step = int(re.search(r"recovered from \w+ at step (\d+)", line).group(1))  # type: ignore[union-attr]
    elif memory:
        line = next(x for x in lines if "restart 1: recovered" in x)
        step = int(re.search(r"at step (\d+)", line).group(1))  # type: ignore[union-attr]
    else:
        line = next(x for x in lines if "restart 1: resuming from" in x)
        step = int(re.search(r"step_0*(\d+)", line).group(1))  # type: ignore[union-attr]
    return {"kill_to_next_step_s": seconds, "resumed_at": step,
            "steps_lost": (KILL_STEP - 1) - step, "line": line.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=Path("/tmp/colonnade-resilience"))
    args = parser.parse_args()
    from colonnade.config.load import load_config
    from colonnade.training.setup import prepare_data

    work = args.work
    text = write_corpus(work / "text", docs=3, words=1200)
    prepared = work / "prepared"
    prepare_data(load_config(None, tiny_args(text, prepared, work / "unused")), log=False)
    data = (text, prepared)
    report: dict[str, Any] = {"model": "tiny llama (2 layers, hidden 32, seq 16), tp2 x dp",
                              "kill_step": KILL_STEP, "disk_interval": DISK_INTERVAL}
    print(f"{'ranks':>5} {'step s':>8} {'+snap s':>8} {'overhead':>9} {'MiB/rank':>9} "
          f"{'mem recov s':>11} {'disk recov s':>12} {'in-proc s':>9} {'lost mem':>8} "
          f"{'lost disk':>9}")
    for world in args.worlds:
        row = {**overhead(data, work, world, args.steps, args.rounds),
               "memory": recovery(data, work, world, True),
               "disk": recovery(data, work, world, False),
               "in_process": recovery(data, work, world, True, in_process=True)}
        report[f"world{world}"] = row
        print(f"{world:>5} {row['step_s_memory0']:>8.4f} {row['step_s_memory1']:>8.4f} "
              f"{100 * row['overhead']:>8.1f}% {row.get('held_mib_per_rank', 0):>9.2f} "
              f"{row['memory']['kill_to_next_step_s']:>11.1f} "
              f"{row['disk']['kill_to_next_step_s']:>12.1f} "
              f"{row['in_process']['kill_to_next_step_s']:>9.1f} {row['memory']['steps_lost']:>8} "
              f"{row['disk']['steps_lost']:>9}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
