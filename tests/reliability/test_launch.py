"""Real jobs through the elastic launcher: multi-node, a killed rank, restart, a hung rank.

Each test starts `colonnade train` (or the fault-injecting twin in ``faults.py``) as its own
process tree on CPU/gloo with a tiny model, and asserts on exit codes, timings, the launcher's
report, the ranks' dumps and the losses in metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colonnade.config.load import load_config
from colonnade.training.setup import prepare_data
from tests.reliability.jobs import (
    REPO,
    alive,
    heartbeat,
    losses,
    start,
    tiny_args,
    write_corpus,
)

STEPS = 8
JOB_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(text directory, prepared directory) shared by every job of this module."""
    root = tmp_path_factory.mktemp("reliability_data")
    text = write_corpus(root / "text")
    prepared = root / "prepared"
    prepare_data(load_config(None, tiny_args(text, prepared, root / "unused")), log=False)
    return text, prepared


@pytest.fixture(scope="module")
def reference(corpus: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[int, float]:
    """Losses of an uninterrupted tp2 x dp2 run started by one launcher with --nproc 4."""
    run = tmp_path_factory.mktemp("reference")
    job = start(["train", "--nproc", "4", *tiny_args(*corpus, run, parallel__tp=2)],
                run / "job.log")
    assert job.wait(JOB_TIMEOUT_S) == 0, job.output()
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    return got


def _assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want), (got, want)
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-6, abs=0.0), (step, got[step], loss)


def test_two_launchers_nnodes2_match_one_launcher(corpus: tuple[Path, Path],
                                                  reference: dict[int, float],
                                                  tmp_path: Path) -> None:
    """Two launchers x 2 ranks (--nnodes 2 on 127.0.0.1) train tp2 x dp2 like --nproc 4."""
    endpoint = f"127.0.0.1:{_free_port()}"
    args = tiny_args(*corpus, tmp_path, parallel__tp=2)
    nodes = [start(["train", "--nproc", "2", "--nnodes", "2", "--node-rank", str(i),
                    "--rdzv-endpoint", endpoint, *args], tmp_path / f"node{i}.log")
             for i in (1, 0)]
    for node in nodes:
        assert node.wait(JOB_TIMEOUT_S) == 0, node.output()
    _assert_same_losses(losses(tmp_path), reference)
    assert "tp2-dp2" in nodes[1].output()  # node 0 hosts rank 0, which prints the layout


def test_kill_9_one_rank_fails_the_job_fast_and_names_it(corpus: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    """kill -9 of rank 2 mid-training: every rank gone within 60 s, exit 1, rank 2 named."""
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, training__steps=100_000,
                     logging__log_interval=1000)
    job = start(["train", "--nproc", "4", *args], tmp_path / "job.log")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    victim = None
    while victim is None or int(victim["step"]) < 4:  # wait until rank 2 is training
        assert job.proc.poll() is None, job.output()
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.2)
        victim = heartbeat(tmp_path, 2)
    beats = [heartbeat(tmp_path, r) for r in range(4)]
    pids = [int(b["pid"]) for b in beats if b is not None]
    assert len(pids) == 4
    os.kill(int(victim["pid"]), signal.SIGKILL)
    killed_at = time.monotonic()
    status = job.wait(JOB_TIMEOUT_S)
    gone_after = time.monotonic() - killed_at
    out = job.output()
    assert status == 1, out
    assert gone_after < 60, gone_after
    assert not [p for p in pids if alive(p)], "ranks survived the failed job"
    cause = next(line for line in out.splitlines() if "likely cause:" in line)
    assert "likely cause: rank 2:" in cause, cause
    assert "SIGKILL" in cause or "died without a Python error" in cause, cause
    assert "on group '" in out  # the survivors name the collective they were in


def test_max_restarts_resumes_from_latest_checkpoint(corpus: tuple[Path, Path],
                                                     reference: dict[int, float],
                                                     tmp_path: Path) -> None:
    """Rank 2 SIGKILLs itself in step 5's backward; --max-restarts 1 resumes from step 4 and
    the losses of every step equal the uninterrupted run's."""
    ckpt = tmp_path / "ckpt"
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, checkpoint__save=ckpt,
                     checkpoint__interval=2)
    job = start(["--fault", "kill:2:5", "--nproc", "4", "--max-restarts", "1", *args],
                tmp_path / "job.log", module="tests.reliability.faults")
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 0, out
    assert "likely cause: rank 2:" in out, out  # attempt 0's report, printed on restart
    assert "restart 1: resuming from" in out and "step_00000004" in out, out
    _assert_same_losses(losses(tmp_path), reference)


def test_hung_rank_is_reported_before_the_collective_timeout(corpus: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    """Rank 1 blocks in Python at step 3: both ranks' watchdogs record the hang at 0.8 x
    timeout_s, before gloo's timeout ends rank 0: rank 1 is named STUCK outside any collective
    (the cause), rank 0 HUNG in the tp all-reduce waiting for it; both dumps hold stacks and
    collectives; the job is gone soon after timeout_s."""
    timeout_s = 8
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, parallel__timeout_s=timeout_s,
                     training__steps=50)
    job = start(["--fault", "hang:1:3", "--nproc", "2", *args], tmp_path / "job.log",
                module="tests.reliability.faults")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    beat = heartbeat(tmp_path, 1)
    while beat is None or int(beat["step"]) < 3:  # rank 1 starts step 3 and blocks
        assert job.proc.poll() is None, job.output()
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.1)
        beat = heartbeat(tmp_path, 1)
    hung_at = time.monotonic()
    status = job.wait(JOB_TIMEOUT_S)
    took = time.monotonic() - hung_at
    out = job.output()
    assert status == 1, out
    # ~timeout_s + 1 s unloaded; the margin absorbs a 2-core machine running other jobs and
    # still fails a job left to the launcher's own 30 s stop timeout after the hang
    assert took < timeout_s + 20, (took, out)
    cause = next(line for line in out.splitlines() if "likely cause:" in line)
    assert "rank 1: STUCK outside any collective at step 3" in cause, cause
    waiting = next(line for line in out.splitlines() if line.strip().startswith("rank 0:"))
    assert "HUNG at step 3 while in all_reduce(" in waiting, waiting
    assert "on group 'tp'" in waiting and "parallel.watchdog_s=6.4" in waiting, waiting
    rec = json.loads((tmp_path / "failures" / "rank0-a0.json").read_text())
    # recorded at watchdog_s = 0.8 x timeout_s of no progress, before the timeout: the record
    # is a hang, not the timed-out collective's exception (event order, not a stopwatch)
    assert rec["kind"] == "hang" and 0.8 * timeout_s <= rec["idle_s"], rec
    assert "timed out (parallel.timeout_s)" not in waiting  # the record came first
    stuck = (tmp_path / "failures" / "rank1-a0.txt").read_text()
    assert "time.sleep(3600)" in stuck and "in train_step" in stuck, stuck
    assert "in flight: nothing" in stuck and "last collective: all_reduce(" in stuck, stuck
    dump = (tmp_path / "failures" / "rank0-a0.txt").read_text()
    assert "in flight: all_reduce(" in dump and "group 'tp'" in dump, dump
    assert "Thread 'MainThread'" in dump, dump


def test_frozen_rank_is_a_hang_and_the_job_ends_within_the_timeout(corpus: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    """Rank 1 SIGSTOPs itself at step 3 (its watchdog freezes with it): the launcher sees its
    heartbeat go stale, records it FROZEN with its current step and last collective, SIGKILLs
    it; rank 0's watchdog reports it waited in the tp all-reduce; everything is gone well
    within timeout_s of the freeze (it used to take ~34 s more, and say 'died' at step 1)."""
    timeout_s = 8
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, parallel__timeout_s=timeout_s,
                     training__steps=50)
    job = start(["--fault", "stop:1:3", "--nproc", "2", *args], tmp_path / "job.log",
                module="tests.reliability.faults")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    beat = heartbeat(tmp_path, 1)
    while beat is None or int(beat["step"]) < 3:  # rank 1 starts step 3 and freezes
        assert job.proc.poll() is None, job.output()
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.1)
        beat = heartbeat(tmp_path, 1)
    frozen_at = time.monotonic()
    pids = [int(b["pid"]) for b in (heartbeat(tmp_path, r) for r in range(2)) if b]
    status = job.wait(JOB_TIMEOUT_S)
    took = time.monotonic() - frozen_at
    out = job.output()
    assert status == 1, out
    # ~7 s unloaded (before the fix: 54 s); the margin absorbs a loaded 2-core machine
    assert took < timeout_s + 20, (took, out)
    assert len(pids) == 2 and not [p for p in pids if alive(p)], "ranks survived the job"
    cause = next(line for line in out.splitlines() if "likely cause:" in line)
    assert "likely cause: rank 1: FROZEN at step 3: no heartbeat for " in cause, cause
    assert "; last collective all_reduce(grad_norm) on group 'tp'" in cause, cause  # step 2's last
    assert "stopped by a signal (SIGSTOP / SIGTSTP)" in cause and "SIGKILL" in cause, cause
    assert "rank 1: died" not in out and "has died" not in out, out
    waiting = next(line for line in out.splitlines() if line.strip().startswith("rank 0:"))
    assert "HUNG at step 3 while in all_reduce(" in waiting, waiting
    assert "on group 'tp'" in waiting, waiting


def test_sigterm_to_the_launcher_with_a_frozen_rank_stops_at_once(corpus: tuple[Path, Path],
                                                                  tmp_path: Path) -> None:
    """SIGTERM to the launcher while rank 1 is frozen (a stopped process ignores SIGTERM): the
    job is reported as stopped by SIGTERM, names the frozen rank, and is gone within seconds
    (the agent used to wait 30 s before its SIGKILL)."""
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, parallel__timeout_s=60,
                     training__steps=50)
    job = start(["--fault", "stop:1:3", "--nproc", "2", *args], tmp_path / "job.log",
                module="tests.reliability.faults")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    beat = heartbeat(tmp_path, 1)
    while beat is None or int(beat["step"]) < 3:
        assert job.proc.poll() is None, job.output()
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.1)
        beat = heartbeat(tmp_path, 1)
    pids = [int(b["pid"]) for b in (heartbeat(tmp_path, r) for r in range(2)) if b]
    time.sleep(1.0)
    os.kill(job.proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    status = job.wait(JOB_TIMEOUT_S)
    took = time.monotonic() - sent
    out = job.output()
    assert status == 143, out
    # rank 0's stop grace (5 s) + the watch, ~7 s unloaded; the agent's own SIGKILL came after
    # 30 s, so anything under that proves the watch ended it (margin for a loaded machine)
    assert took < 28, (took, out)
    assert "colonnade: the job was stopped by SIGTERM" in out, out
    assert "rank 1 was frozen and could not stop: no heartbeat for" in out, out
    assert "failed before training" not in out, out
    assert len(pids) == 2 and not [p for p in pids if alive(p)], "ranks survived the job"


RANK_BARS = """
import multiprocessing, multiprocessing.resource_tracker as tracker
multiprocessing.set_start_method("spawn")  # as in a rank the launcher spawned
registered = []
register = tracker.register
tracker.register = lambda name, rtype: (registered.append(rtype), register(name, rtype))
from tqdm import tqdm
{setup}
with tqdm(total=3, disable=True) as bar:  # the training loop's bar when stdout is a pipe
    bar.update(1)
print(registered)
"""


@pytest.mark.parametrize("own", [False, True])
def test_rank_progress_bars_take_no_named_semaphore(own: bool) -> None:
    """A rank that ends by os._exit after Ctrl-C must hold no multiprocessing lock, or Python's
    resource tracker prints "1 leaked semaphore objects" after the job: tqdm's default lock is
    one (even for a disabled bar; named, and so tracked, under the spawn start method the
    ranks run with); :func:`own_progress_lock` gives tqdm a thread lock."""
    setup = "from colonnade.launch import own_progress_lock; own_progress_lock()" if own else ""
    out = subprocess.run([sys.executable, "-c", RANK_BARS.format(setup=setup)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == ("[]" if own else "['semaphore']")
