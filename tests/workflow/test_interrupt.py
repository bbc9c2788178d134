"""Ctrl-C and SIGTERM save and resume (issue 14, item 3), through the real CLI.

SIGTERM to the launcher of a tp2 job: the agent forwards it, both ranks agree on the step to
stop after, save it (atomic, all ranks), the job exits 143 with one line naming the checkpoint;
re-running the same command resumes and ends with the losses of an uninterrupted run. SIGTERM
to one rank only stops the whole job at one step. Ctrl-C of a single-process run exits 130
without a traceback; without checkpoint.save it says nothing could be saved and how to enable it.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.reliability.jobs import heartbeat, losses, start, tiny_args
from tests.workflow.cli import JOB_TIMEOUT_S, steps_logged, wait_for_records

STEPS = 60


def _stopped_at(out: str, signame: str) -> int:
    found = re.search(rf"interrupted by {signame} at step (\d+); ", out)
    assert found, out
    return int(found.group(1))


def _assert_clean(out: str) -> None:
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "launcher failed" not in out and "likely cause" not in out, out


def test_sigterm_saves_and_the_same_command_resumes_exactly(
        corpus: tuple[Path, Path], tmp_path: Path) -> None:
    ref_run = tmp_path / "reference"
    ref = start(["train", "--nproc", "2", *tiny_args(*corpus, ref_run, parallel__tp=2,
                                                     training__steps=STEPS)],
                tmp_path / "ref.log")
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = ["train", "--nproc", "2", *tiny_args(*corpus, run, parallel__tp=2,
                                                training__steps=STEPS, checkpoint__save=ckpt)]
    job = start(argv, tmp_path / "job.log")
    wait_for_records(job, run, 5)
    os.kill(job.proc.pid, signal.SIGTERM)  # the launcher, as a scheduler would
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 143, out
    _assert_clean(out)
    step = _stopped_at(out, "SIGTERM")
    assert 5 <= step < STEPS, out
    saved = ckpt / f"step_{step:08d}"
    assert f"saved checkpoint {saved}; re-run the same command to resume" in out, out
    assert f"stopped by SIGTERM; latest checkpoint {saved}" in out, out
    assert (ckpt / "latest").read_text().strip() == saved.name
    meta = json.loads((saved / "metadata.json").read_text())
    assert meta["step"] == step and meta["layout"]["tp"] == 2
    assert sorted(p.name for p in saved.glob("*.safetensors")) != []  # every rank's shard
    assert ref.wait(JOB_TIMEOUT_S) == 0, ref.output()
    again = start(argv, tmp_path / "again.log")
    assert again.wait(JOB_TIMEOUT_S) == 0, again.output()
    assert f"resuming from {saved}" in again.output()
    assert steps_logged(run) == list(range(1, STEPS + 1))  # no duplicate step
    want, got = losses(ref_run), losses(run)
    for s in range(1, STEPS + 1):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0.0), s


@pytest.mark.parametrize(("target", "sig"), [("rank1", signal.SIGTERM),
                                             ("group", signal.SIGINT)],
                         ids=["sigterm_rank1_only", "ctrl_c_whole_process_group"])
def test_a_signal_to_some_processes_stops_every_rank_at_one_step(
        corpus: tuple[Path, Path], tmp_path: Path, target: str, sig: signal.Signals) -> None:
    """SIGTERM to rank 1 alone (rank 0 learns it in the all-reduce), or Ctrl-C in a terminal
    (SIGINT to the launcher and every rank, then again from the agent to the ranks)."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    job = start(["train", "--nproc", "2", *tiny_args(*corpus, run, parallel__dp=2,
                                                     training__steps=STEPS,
                                                     checkpoint__save=ckpt)],
                tmp_path / "job.log")
    wait_for_records(job, run, 5)
    if target == "group":
        os.killpg(job.proc.pid, sig)
    else:
        beat = heartbeat(run, 1)
        assert beat is not None
        os.kill(int(beat["pid"]), sig)
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 128 + int(sig), out
    _assert_clean(out)
    step = _stopped_at(out, sig.name)
    assert (ckpt / "latest").read_text().strip() == f"step_{step:08d}"
    assert json.loads((ckpt / f"step_{step:08d}" / "metadata.json").read_text())["step"] == step
    assert steps_logged(run)[-1] == step


@pytest.mark.parametrize("save", [True, False], ids=["saved", "nothing_to_save"])
def test_ctrl_c_of_one_process_saves_and_exits_130(
        corpus: tuple[Path, Path], tmp_path: Path, save: bool) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    extra = {"checkpoint__save": ckpt} if save else {}
    job = start(["train", *tiny_args(*corpus, run, training__steps=100_000, **extra)],
                tmp_path / "job.log")
    wait_for_records(job, run, 3)
    os.kill(job.proc.pid, signal.SIGINT)
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 130, out
    _assert_clean(out)
    step = _stopped_at(out, "SIGINT")
    if save:
        assert f"saved checkpoint {ckpt / f'step_{step:08d}'}; re-run" in out, out
        assert (ckpt / "latest").read_text().strip() == f"step_{step:08d}"
    else:
        assert "nothing was saved: checkpoint.save is unset (add --checkpoint.save=DIR" in out
        assert not ckpt.exists()
