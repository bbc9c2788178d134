"""Ctrl-C and SIGTERM save and resume (issue 14, item 3), through the real CLI.

SIGTERM to the launcher of a multi-rank job (the agent forwards it, every rank agrees on the
step to stop after and saves it, exit 143 with one line naming the checkpoint, the re-run
resumes with an uninterrupted run's losses) is tested by tests/workflow/test_end_to_end.py on
its tp2 x dp2 job, which would otherwise repeat the same three launches. SIGTERM to one rank
only stops the whole job at one step. Ctrl-C of a single-process run exits 130 without a
traceback, saved under <logging.dir>/checkpoints by default; with checkpoint.save=none it says
nothing could be saved and how to enable it.

Each job runs with a stop gate (:func:`tests.workflow.cli.start_gated`): the signalled ranks
take step ``GATE`` only once their signal has arrived. The signal is sent once the job has
logged step ``GATE - 1`` (every rank is then in its training loop, handlers installed), so for
every interleaving the job is still running when it comes, and it stops after step ``GATE``
exactly: no rank passes that step without the signal, and the step's all-reduce carries it.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.reliability.jobs import heartbeat, tiny_args
from tests.workflow.cli import (
    JOB_TIMEOUT_S,
    assert_clean,
    start_gated,
    steps_logged,
    stopped_at,
    wait_for_records,
)

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`

STEPS = 60
GATE = 6


@pytest.mark.parametrize(("target", "sig"), [("rank1", signal.SIGTERM),
                                             ("group", signal.SIGINT)],
                         ids=["sigterm_rank1_only", "ctrl_c_whole_process_group"])
def test_a_signal_to_some_processes_stops_every_rank_at_one_step(
        corpus: tuple[Path, Path], tmp_path: Path, target: str, sig: signal.Signals) -> None:
    """SIGTERM to rank 1 alone (rank 0 learns it in the all-reduce), or Ctrl-C in a terminal
    (SIGINT to the launcher and every rank, then again from the agent to the ranks)."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    job = start_gated(["train", "--nproc", "2", *tiny_args(*corpus, run, parallel__dp=2,
                                                           training__steps=STEPS,
                                                           checkpoint__save=ckpt)],
                      tmp_path / "job.log", GATE, (1,) if target == "rank1" else (0, 1))
    wait_for_records(job, run, GATE - 1)
    if target == "group":
        os.killpg(job.proc.pid, sig)
    else:
        beat = heartbeat(run, 1)
        assert beat is not None
        os.kill(int(beat["pid"]), sig)
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 128 + int(sig), out
    assert_clean(out)
    step = stopped_at(out, sig.name)
    assert step == GATE, out
    assert (ckpt / "latest").read_text().strip() == f"step_{step:08d}"
    assert json.loads((ckpt / f"step_{step:08d}" / "metadata.json").read_text())["step"] == step
    assert steps_logged(run)[-1] == step


@pytest.mark.parametrize("save", [True, False], ids=["saved", "nothing_to_save"])
def test_ctrl_c_of_one_process_saves_and_exits_130(
        corpus: tuple[Path, Path], tmp_path: Path, save: bool) -> None:
    """Saved under <logging.dir>/checkpoints by default; checkpoint.save=none saves nothing."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    extra = {} if save else {"checkpoint__save": "none"}
    job = start_gated(["train", *tiny_args(*corpus, run, training__steps=STEPS, **extra)],
                      tmp_path / "job.log", GATE, (0,))
    wait_for_records(job, run, GATE - 1)
    os.kill(job.proc.pid, signal.SIGINT)
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 130, out
    assert_clean(out)
    step = stopped_at(out, "SIGINT")
    assert step == GATE, out
    if save:
        assert f"saved checkpoint {ckpt / f'step_{step:08d}'}; re-run" in out, out
        assert (ckpt / "latest").read_text().strip() == f"step_{step:08d}"
    else:
        assert "nothing was saved: checkpoint.save=none (leave it unset, or give" in out, out
        assert not ckpt.exists()
