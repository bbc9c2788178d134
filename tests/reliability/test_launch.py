"""Real jobs through the elastic launcher: multi-node, a killed rank, restart, a hung rank.

Each test starts `colonnade train` (or the fault-injecting twin in ``faults.py``) as its own
process tree on CPU/gloo with a tiny model, and asserts on exit codes, the launcher's report,
the ranks' records and dumps and the losses in metrics.jsonl.

No assertion is on a measured duration: a test waits for the state it needs (a heartbeat's
step, a process in state T, a record on disk), with :data:`JOB_TIMEOUT_S` only as a backstop.
That a failed job ends promptly is proved by what ended it: the failure tests run the elastic
agent with :data:`~tests.reliability.jobs.AGENT_WAITS_FOR_RANKS` (no SIGKILL 30 s after its
SIGTERM), so their job ends only if every rank ends by itself or by the launcher's watch, and
the ranks' records say it was not a collective timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from colonnade.cli import main
from colonnade.config.load import load_config
from colonnade.reliability.monitor import failure_path
from colonnade.reliability.watch import process_state
from colonnade.training.setup import prepare_data
from tests.reliability.jobs import (
    AGENT_WAITS_FOR_RANKS,
    REPO,
    Job,
    alive,
    heartbeat,
    losses,
    start,
    tiny_args,
    wait_until,
    write_corpus,
)
from tests.workflow.cli import ranks_in_pool

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`

STEPS = 8
JOB_TIMEOUT_S = 600
"""Backstop of every wait on a job (its start-up alone took 100+ s on a 2-core machine running
other suites); it ends a test whose product broke, never orders one."""


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
def reference(corpus: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
              run_ranks: Callable[..., list[Any]]) -> dict[int, float]:
    """Losses of an uninterrupted tp2 x dp2 run of ``colonnade train --nproc 4``, in this
    process with its ranks on the rank pool (:func:`tests.workflow.cli.ranks_in_pool`): the
    comparison of the launched jobs here, not one of them (the launcher's one-node --nproc 4
    run is tests/workflow/test_end_to_end.py's, equal to the pool's)."""
    run = tmp_path_factory.mktemp("reference")
    with ranks_in_pool(run_ranks):
        assert main(["train", "--nproc", "4", *tiny_args(*corpus, run, parallel__tp=2)]) == 0
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    return got


def _wait_for_step(job: Job, run_dir: Path, rank: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s heartbeat once it has begun step ``step`` (it writes one as each step
    begins); fails if the job ends first."""
    beats: list[dict[str, Any]] = []

    def begun() -> bool:
        beat: dict[str, Any] | None = heartbeat(run_dir, rank)
        if beat is None or int(beat["step"]) < step:
            return False
        beats.append(beat)
        return True

    wait_until(begun, f"rank {rank} begins step {step}", JOB_TIMEOUT_S, job, poll_s=0.1)
    return beats[-1]


def _record(run_dir: Path, rank: int) -> dict[str, Any]:
    """Why rank ``rank`` ended on attempt 0 (its own record, or the launcher's 'frozen' one)."""
    record: dict[str, Any] = json.loads(failure_path(run_dir, rank, 0).read_text())
    return record


def _pids(run_dir: Path, world: int) -> list[int]:
    """The pids in the ranks' heartbeats (of every rank that has written one)."""
    beats: list[dict[str, Any] | None] = [heartbeat(run_dir, r) for r in range(world)]
    return [int(b["pid"]) for b in beats if b is not None]


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
    """kill -9 of rank 2 mid-training: exit 1, rank 2 named, every rank gone, and fast: what
    ended each survivor is rank 2's death reaching it (a collective failing on the closed
    connection, or the launcher's SIGTERM recorded by its watchdog), never a timeout (the hang
    limit is 240 s, the collective timeout 300 s). The agent waits for the ranks
    (AGENT_WAITS_FOR_RANKS), so the job ends only because every survivor ended by itself; on
    any schedule, since nothing here waits for a duration."""
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, training__steps=100_000,
                     logging__log_interval=1000)
    job = start(["train", "--nproc", "4", *args], tmp_path / "job.log", env=AGENT_WAITS_FOR_RANKS)
    victim = _wait_for_step(job, tmp_path, 2, 4)  # rank 2 is training
    pids = _pids(tmp_path, 4)
    assert len(pids) == 4
    os.kill(int(victim["pid"]), signal.SIGKILL)
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 1, out
    assert not [p for p in pids if alive(p)], "ranks survived the failed job"
    cause = next(line for line in out.splitlines() if "likely cause:" in line)
    assert "likely cause: rank 2:" in cause, cause
    assert "SIGKILL" in cause or "died without a Python error" in cause, cause
    assert "on group '" in out  # the survivors name the collective they were in
    for rank in (0, 1, 3):
        rec = _record(tmp_path, rank)
        assert rec["kind"] in ("exception", "terminated"), (rank, rec)
        assert "timed out" not in rec["summary"], (rank, rec)


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


def test_max_restarts_recovers_from_memory_then_disk(corpus: tuple[Path, Path],
                                                    reference: dict[int, float],
                                                    tmp_path: Path) -> None:
    """The recovery ladder in one job of 4 ranks (tp2 x dp2), two failures in a row, with
    --checkpoint.memory_interval=1 and a disk checkpoint every 3 steps:

    1. rank 2 SIGKILLs itself in step 5's backward and its node's memory goes with it (fault
       'lose': its own snapshot files and the copies it held deleted first): the restarted job
       continues from step 4 in memory (only the interrupted step is redone; the disk holds
       step 3):
       ranks 0, 1, 3 from their own snapshots, rank 2 from its partner rank 3's copy;
    2. in step 8 of that attempt rank 2 dies again, and this time rank 3's copy of its state
       is gone too ('lose-both'): both holders of its shard are lost, so the job falls back
       to the disk checkpoint of step 6 and says so.

    Every loss equals the uninterrupted run's, bit for bit. Prints the time from the first
    kill to the next completed step."""
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, checkpoint__memory_interval=1,
                     checkpoint__memory_dir=tmp_path / "mem", checkpoint__interval=3)
    job = start(["--fault", "lose:2:5", "--fault", "lose-both:2:8:1", "--nproc", "4",
                 "--max-restarts", "2", *args], tmp_path / "job.log",
                module="tests.reliability.faults")
    killed_at = tmp_path / "killed_at"
    wait_until(killed_at.exists, "rank 2 is killed", JOB_TIMEOUT_S, job, poll_s=0.05)
    first_kill = float(killed_at.read_text())
    # the restarted rank 0 begins step 6 (heartbeat) once step 5 is done
    wait_until(lambda: int((heartbeat(tmp_path, 0, attempt=1) or {}).get("step", 0)) >= 6,
               "the restarted job completes step 5", JOB_TIMEOUT_S, poll_s=0.01)
    recovered_s = time.time() - first_kill
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 0, out
    assert out.count("likely cause: rank 2:") == 2, out
    first = next(x for x in out.splitlines() if "restart 1: recovered" in x)
    assert "recovered from memory at step 4" in first, first
    assert "rank(s) 2 from their partner's copy" in first and "no disk read" in first, first
    second = next(x for x in out.splitlines() if "restart 2: recovered" in x)
    assert "recovered from disk at step 6 in " in second, second
    assert ("rank 2's snapshot of step 7 and its copy on rank 3 are both gone: falling back to "
            "disk step 6") in second, second
    got = losses(tmp_path)
    assert got == reference, (got, reference)  # bit for bit
    print(f"kill to the next completed step (memory): {recovered_s:.1f} s ({first.strip()})")


def test_in_process_restart_replaces_only_the_dead_rank(corpus: tuple[Path, Path],
                                                        reference: dict[int, float],
                                                        tmp_path: Path) -> None:
    """--checkpoint.restart=in-process, memory snapshots every step, no disk checkpoint until
    the end, two failures in a row in one job of 4 ranks (tp2 x dp2):

    1. rank 2 SIGKILLs itself in step 5's backward with its snapshot files gone ('lose'): the
       supervisor starts one replacement rank 2; ranks 0, 1, 3 leave their broken groups and
       rejoin as generation 1 in the same processes; all continue from step 4 in memory, rank
       2 from its partner rank 3's copy, no disk read;
    2. rank 1 (an original process) is killed in step 7's backward: generation 2, from step 6.

    Ranks 0 and 3 keep their pids to the end, ranks 1 and 2 are new processes, every loss
    equals the uninterrupted run's bit for bit; prints the time from the first kill to the
    next completed step (the job-restart path's is printed by the test above)."""
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, checkpoint__memory_interval=1,
                     checkpoint__memory_dir=tmp_path / "mem", checkpoint__restart="in-process")
    job = start(["--fault", "lose:2:5", "--fault", "kill:1:7", "--nproc", "4",
                 "--max-restarts", "2", *args], tmp_path / "job.log",
                module="tests.reliability.faults")
    wait_until(lambda: all(heartbeat(tmp_path, r) for r in range(4)), "every rank beats",
               JOB_TIMEOUT_S, job)
    first = {r: (heartbeat(tmp_path, r) or {})["pid"] for r in range(4)}  # before step 5
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 0, out
    last = {r: (heartbeat(tmp_path, r) or {})["pid"] for r in range(4)}
    assert [last[r] == first[r] for r in range(4)] == [True, False, False, True], (first, last)
    lines = [x for x in out.splitlines() if "in-process restart: rank 0 rejoined" in x]
    assert len(lines) == 2, out
    assert "generation 1" in lines[0] and "recovered from memory at step 4" in lines[0], lines
    assert "rank(s) 2 from their partner's copy" in lines[0] and "no disk read" in lines[0]
    assert "generation 2" in lines[1] and "recovered from memory at step 6" in lines[1], lines
    got = losses(tmp_path)
    assert got == reference, (got, reference)  # bit for bit
    killed_at = float((tmp_path / "killed_at").read_text())
    done = next(x for x in out.splitlines() if "step 5 completed" in x)
    print(f"in-process restart, kill to the next completed step: {done} (killed at "
          f"{killed_at:.1f})")


def test_hung_rank_is_reported_before_the_collective_timeout(corpus: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    """Rank 1 blocks in Python at step 3: both ranks' watchdogs record the hang at watchdog_s,
    long before the collective timeout: rank 1 is named STUCK outside any collective (the
    cause), rank 0 HUNG in the tp all-reduce waiting for it; both dumps hold stacks and
    collectives. Once the waiting rank is gone (killed here, as its backend's timeout or a
    scheduler would end it), the launcher stops the stuck rank (SIGTERM, served by its watchdog
    thread while its main thread sleeps) and reports.

    Ordering: nothing can end either rank before its hang record: the collective timeout is
    300 s, the test kills rank 0 only once both records exist, and a rank records once, so the
    later failure and SIGTERM do not replace them. The agent waits for the ranks
    (AGENT_WAITS_FOR_RANKS): the job ends only because rank 1 honours the launcher's SIGTERM.
    The one outcome left to the scheduler is beyond the hang limit itself: a rank whose
    watchdog thread the machine does not run for ~5 s (watchdog_s plus the launcher's slack,
    less its heartbeat period) is, to the launcher, frozen."""
    watchdog_s = 4
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, parallel__watchdog_s=watchdog_s,
                     training__steps=50)
    job = start(["--fault", "hang:1:3", "--nproc", "2", *args], tmp_path / "job.log",
                module="tests.reliability.faults", env=AGENT_WAITS_FOR_RANKS)
    wait_until(lambda: all(failure_path(tmp_path, r, 0).exists() for r in range(2)),
               "both ranks record the hang", JOB_TIMEOUT_S, job, poll_s=0.1)
    rec, stuck_rec = _record(tmp_path, 0), _record(tmp_path, 1)
    os.kill(int(rec["pid"]), signal.SIGKILL)
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 1, out
    assert not alive(int(stuck_rec["pid"])), "the stuck rank survived the job"
    cause = next(line for line in out.splitlines() if "likely cause:" in line)
    assert "rank 1: STUCK outside any collective at step 3" in cause, cause
    waiting = next(line for line in out.splitlines() if line.strip().startswith("rank 0:"))
    assert "HUNG at step 3 while in all_reduce(" in waiting, waiting
    assert "on group 'tp'" in waiting and "parallel.watchdog_s=4" in waiting, waiting
    # recorded at watchdog_s of no progress, not as the timed-out collective's exception
    assert rec["kind"] == "hang" and watchdog_s <= rec["idle_s"], rec
    assert stuck_rec["kind"] == "hang" and not stuck_rec["in_flight"], stuck_rec
    assert "timed out (parallel.timeout_s)" not in waiting  # the record came first
    stuck = (tmp_path / "failures" / "rank1-a0.txt").read_text()
    assert "time.sleep(3600)" in stuck and "in train_step" in stuck, stuck
    assert "in flight: nothing" in stuck and "last collective: all_reduce(" in stuck, stuck
    dump = (tmp_path / "failures" / "rank0-a0.txt").read_text()
    assert "in flight: all_reduce(" in dump and "group 'tp'" in dump, dump
    assert "Thread 'MainThread'" in dump, dump


def test_frozen_rank_is_a_hang_and_the_job_ends_within_the_timeout(corpus: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    """Rank 1 SIGSTOPs itself at step 3 (its watchdog freezes with it): the launcher records it
    FROZEN with its current step and last collective and SIGKILLs it; rank 0 reports the tp
    all-reduce it waited in; the job ends, no collective timing out (it used to take ~34 s
    more, and say 'died' at step 1).

    Ordering: only the launcher's watch can record a stopped process, and it records before it
    kills, so rank 1 is FROZEN on any schedule; the agent waits for the ranks
    (AGENT_WAITS_FOR_RANKS), so the job ends only because the watch killed rank 1 and rank 0
    then ended by itself. Rank 0's own line is a race the product allows: its watchdog records
    HUNG after watchdog_s of no progress and the watch then kills rank 1 at once (a stopped
    rank once a peer failed), unless rank 0's watchdog thread was not run for the launcher's
    slack (2 s) more, when the watch kills rank 1 for its stale heartbeat first and rank 0
    fails in that all-reduce (closed connection) or is stopped in it by the launcher. Each of
    these names step 3 and the tp all-reduce; the HUNG line alone is the hung-rank test's."""
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, parallel__watchdog_s=4,
                     training__steps=50)
    job = start(["--fault", "stop:1:3", "--nproc", "2", *args], tmp_path / "job.log",
                module="tests.reliability.faults", env=AGENT_WAITS_FOR_RANKS)
    _wait_for_step(job, tmp_path, 1, 3)  # rank 1 begins step 3 and freezes
    pids = _pids(tmp_path, 2)
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 1, out
    assert len(pids) == 2 and not [p for p in pids if alive(p)], "ranks survived the job"
    cause = next(line for line in out.splitlines() if "likely cause:" in line)
    assert "likely cause: rank 1: FROZEN at step 3: no heartbeat for " in cause, cause
    assert "; last collective all_reduce(grad_norm) on group 'tp'" in cause, cause  # step 2's last
    assert "stopped by a signal (SIGSTOP / SIGTSTP)" in cause and "SIGKILL" in cause, cause
    assert "rank 1: died" not in out and "has died" not in out, out
    waiting = next(line for line in out.splitlines() if line.strip().startswith("rank 0:"))
    assert "at step 3" in waiting and "all_reduce(" in waiting, waiting
    assert "on group 'tp'" in waiting, waiting
    rec = _record(tmp_path, 0)
    assert rec["kind"] in ("hang", "exception", "terminated"), rec
    assert rec["kind"] != "hang" or "HUNG at step 3 while in all_reduce(" in waiting, waiting
    assert "timed out" not in rec["summary"], rec


def test_sigterm_to_the_launcher_with_a_frozen_rank_stops_at_once(corpus: tuple[Path, Path],
                                                                  tmp_path: Path) -> None:
    """SIGTERM to the launcher while rank 1 is frozen (a stopped process ignores SIGTERM): the
    job is reported as stopped by SIGTERM, names the frozen rank, and ends without the agent's
    SIGKILL (it used to wait 30 s for it).

    Ordering: SIGTERM is sent once rank 1 is in state T (read from /proc, not a sleep). The
    agent waits for the ranks (AGENT_WAITS_FOR_RANKS), so the job ends only after rank 0 ended
    on the SIGTERM (its watchdog records 'terminated' after its grace) and the launcher's watch
    then killed the stopped rank 1 (a peer failed); the launcher names only ranks its watch
    killed. Neither rank's hang limit (48 s) nor the collective timeout (60 s) is near the few
    seconds this takes."""
    args = tiny_args(*corpus, tmp_path, parallel__tp=2, parallel__timeout_s=60,
                     training__steps=50)
    job = start(["--fault", "stop:1:3", "--nproc", "2", *args], tmp_path / "job.log",
                module="tests.reliability.faults", env=AGENT_WAITS_FOR_RANKS)
    frozen = _wait_for_step(job, tmp_path, 1, 3)
    pids = _pids(tmp_path, 2)
    wait_until(lambda: process_state(int(frozen["pid"])) == "T", "rank 1 is stopped",
               JOB_TIMEOUT_S, job, poll_s=0.05)
    os.kill(job.proc.pid, signal.SIGTERM)
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 143, out
    assert "colonnade: the job was stopped by SIGTERM" in out, out
    assert "rank 1 was frozen and could not stop: no heartbeat for" in out, out
    assert "failed before training" not in out, out
    assert len(pids) == 2 and not [p for p in pids if alive(p)], "ranks survived the job"
    rec = _record(tmp_path, 0)
    assert rec["kind"] == "terminated" and "group 'tp'" in rec["in_flight"][0], rec
    assert _record(tmp_path, 1)["kind"] == "frozen"


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
