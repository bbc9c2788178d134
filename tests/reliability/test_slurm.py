"""examples/slurm/train.sbatch under a real Slurm (tests/reliability/slurm.py: a controller and
two node daemons on this machine): 2 nodes x 2 ranks train the tiny model; every process of
node n2 is SIGKILLed mid-run and the script's re-run resumes from the latest checkpoint; then
`scancel` makes every rank finish its step and save, as Ctrl-C does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.jobs import REPO, tiny_args, wait_until
from tests.reliability.slurm import SlurmCluster, free_ports, job_processes

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
LIMIT_S = 120.0
"""Backstop of every wait (not an ordering)."""


@pytest.fixture()
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    """A Slurm controller and nodes n1, n2 for this test, torn down after it."""
    cluster = SlurmCluster(tmp_path / "slurm")
    try:
        yield cluster
    finally:
        cluster.close()


def _records(run: Path) -> list[dict[str, object]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # the line being written
            continue
    return out


def _latest_step(save: Path) -> int:
    latest = save / "latest"
    return int(latest.read_text().strip().rsplit("_", 1)[-1]) if latest.exists() else 0


def test_sbatch_two_nodes_survives_a_killed_node_and_saves_on_scancel(
        slurm: SlurmCluster, corpus: tuple[Path, Path], tmp_path: Path) -> None:
    """sbatch -> steps logged; SIGKILL of node n2's launcher and ranks after the checkpoint
    of step 4 -> the script re-runs the step (RESTARTS), which resumes after a checkpoint and
    logs attempt 1; scancel -> every rank saves at the step it stopped after, the last logged
    one, and the script exits without a re-run."""
    run = tmp_path / "run"
    save = run / "checkpoints"
    env = dict(slurm.env, NPROC="2", RESTARTS="1", MASTER_PORT=str(free_ports(1)[0]),
               COLONNADE=f"{sys.executable} -m colonnade.cli", PYTHONPATH=str(REPO),
               OMP_NUM_THREADS="1")
    slurm.env = env
    out = tmp_path / "job.out"
    job = slurm.run("sbatch", "--parsable", f"--chdir={REPO}", f"--output={out}", str(SBATCH),
                    *tiny_args(*corpus, run, training__steps=100_000, checkpoint__interval=4,
                               parallel__tp=2, parallel__timeout_s=30,
                               logging__log_interval=1)).strip().split(";")[0]

    def text() -> str:
        return out.read_text(errors="replace") if out.exists() else ""

    wait_until(lambda: _latest_step(save) >= 4, "a checkpoint at step 4", LIMIT_S)
    victims = job_processes(job, "n2")
    assert victims, "no process of the job on node n2"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any(r.get("attempt", 0) == 1 and "loss" in r for r in _records(run)),
               "a step of the re-run", LIMIT_S)
    assert "job step failed" in text() and "re-running it (1/1)" in text(), text()
    slurm.run("scancel", job)
    wait_until(lambda: job not in slurm.jobs(), "the job ended after scancel", LIMIT_S)
    log = text()
    assert "stopped by a signal" in log, log
    records = [r for r in _records(run) if "loss" in r]
    steps = [(r["attempt"], r["step"]) for r in records]
    resumed = [r for r in records if r.get("attempt") == 1]
    first_attempt = [r for r in records if r.get("attempt", 0) == 0]
    assert resumed and first_attempt, steps
    found = re.search(r"resumed from \S+step_(\d+) at step (\d+)", log)
    assert found and found[1].lstrip("0") == found[2], log
    resumed_at = int(found[2])  # a checkpoint of the first attempt (its record may be unwritten)
    assert resumed_at >= 4 and resumed_at % 4 == 0 and resumed[0]["step"] == resumed_at + 1, (
        steps, log)
    last = records[-1]["step"]
    assert _latest_step(save) == last, (_latest_step(save), steps, log)  # saved where it stopped
    assert "saved checkpoint" in log.rsplit("re-running it", 1)[1], log
