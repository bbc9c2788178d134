"""Helpers of the workflow tests: run ``colonnade`` as a user would and read what it left.

Run as a module, this is ``colonnade`` with a stop gate (:func:`start_gated`): chosen ranks take
a chosen step only once their own SIGINT / SIGTERM has arrived, so a test that signals a job
"mid-run" cannot find it already finished, and knows the step it stops after, whatever the
scheduler does. Only the ranks' ``Trainer.train_step`` is wrapped; the CLI, the launcher, the
signal handling and the stop protocol are the product's.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from colonnade.cli import main
from colonnade.config.sections import Config
from tests.reliability.jobs import REPO, Job, start

JOB_TIMEOUT_S = 240
STOP_GATE_ENV = "COLONNADE_TEST_STOP_GATE"
"""'STEP:RANK,RANK...' in a gated job's environment (the spawned ranks inherit it)."""


def run_cli(argv: list[str], timeout: float = JOB_TIMEOUT_S) -> tuple[int, str]:
    """``python -m colonnade.cli argv`` in its own process; (exit status, stdout + stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "colonnade.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)
    return proc.returncode, proc.stdout + proc.stderr


Cli = Callable[[list[str]], tuple[int, str]]
"""``cli(argv)`` -> (exit status, stdout + stderr) of ``colonnade argv`` (the ``cli`` fixture of
tests/conftest.py)."""


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``colonnade argv`` in this process (no interpreter, torch or transformers to start);
    (exit status, stdout + stderr), as :func:`run_cli` returns them."""
    capsys.readouterr()
    status = main(argv)
    got = capsys.readouterr()
    return status, got.out + got.err


def pool_rank(config: Config) -> str:
    """One rank of ``colonnade train`` on a rank-pool worker: torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) taken from the pool's default group for the
    call, then the launched rank's own body (:func:`~colonnade.launch.run_rank`, which joins
    the group already there); returns what the rank printed (a worker's stdout is not the
    test's)."""
    import torch.distributed as dist

    from colonnade.launch import run_rank

    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update({key: str(value) for key, value in env.items()})
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            run_rank(config)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return out.getvalue()


@contextlib.contextmanager
def ranks_in_pool(run_ranks: Callable[..., list[Any]]) -> Iterator[None]:
    """Inside, ``colonnade train --nproc N`` (one node) run in this process starts no process:
    the CLI parses, initialises, prepares and checks as ever, and its launcher's N ranks are
    the session's warm pool of N (:func:`pool_rank`; rank 0's output printed here). For the
    tests of what a run computes; the launcher itself (spawn, signals, exit codes) keeps its
    real runs (tests/workflow/test_end_to_end.py, tests/reliability/test_launch.py)."""
    import colonnade.launch as launch_mod

    real = launch_mod.launch

    def launch(config: Config, args: Any, overrides: list[str] | None = None,
               **_: Any) -> int:
        assert args.nnodes == 1, "the rank pool is one node"
        print(run_ranks(args.nproc, pool_rank, config)[0], end="", flush=True)
        return 0

    launch_mod.launch = launch  # type: ignore[assignment]
    try:
        yield
    finally:
        launch_mod.launch = real  # type: ignore[assignment]


def hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory`` by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def steps_logged(run_dir: Path) -> list[int]:
    """The step of every record of metrics.jsonl, in file order (duplicates kept)."""
    return steps_logged_file(run_dir / "metrics.jsonl")


def steps_logged_file(path: Path) -> list[int]:
    """The step of every record of a JSONL metrics file, in file order."""
    return [int(json.loads(line)["step"]) for line in path.read_text().splitlines()]


def start_gated(argv: list[str], log: Path, step: int, ranks: Sequence[int]) -> Job:
    """:func:`~tests.reliability.jobs.start` of ``colonnade argv`` whose ranks ``ranks`` take
    step ``step`` only once they have received a stop signal (:func:`install_stop_gate`)."""
    gate = f"{step}:{','.join(str(r) for r in ranks)}"
    return start(["--stop-gate", gate, *argv], log, module="tests.workflow.cli")


def _await_stop_signal() -> int:
    """Block until this process has received SIGINT or SIGTERM in its training loop; the
    signal number (the loop's :class:`~colonnade.reliability.interrupt.StopRequest` noted it).

    Each stop handler is wrapped to also write a byte to a pipe that this waits on (a signal
    interrupts the ``select``, its handler runs, and the ``select`` goes on and sees the byte):
    a signal handled before the wrapping is seen in ``StopRequest.signum``, any later one in
    the pipe (a handler still pending at the wrapping runs as the wrapper).
    """
    from colonnade.reliability.interrupt import STOP_SIGNALS, StopRequest

    handlers = {int(sig): signal.getsignal(sig) for sig in STOP_SIGNALS}
    stopper = getattr(handlers[int(signal.SIGTERM)], "__self__", None)
    assert isinstance(stopper, StopRequest), handlers
    read_end, write_end = os.pipe()

    def noted(signum: int, frame: FrameType | None) -> None:
        handlers[signum](signum, frame)  # type: ignore[operator]
        os.write(write_end, b"s")

    try:
        for sig in STOP_SIGNALS:
            signal.signal(sig, noted)
        if not stopper.signum:
            ready, _, _ = select.select([read_end], [], [], JOB_TIMEOUT_S)
            assert ready, f"no stop signal reached the gate within {JOB_TIMEOUT_S} s"
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, handlers[int(sig)])
        os.close(read_end)
        os.close(write_end)
    assert stopper.signum
    return stopper.signum


def install_stop_gate() -> None:
    """Wrap ``Trainer.train_step`` per :data:`STOP_GATE_ENV` (nothing when it is unset): the
    listed ranks block before the listed step until a stop signal has arrived, then take the
    step with it, so every rank stops after exactly that step."""
    spec = os.environ.get(STOP_GATE_ENV)
    if not spec:
        return
    from colonnade.training.loop import Trainer

    step_text, ranks_text = spec.split(":")
    step, ranks = int(step_text), {int(r) for r in ranks_text.split(",")}
    original = Trainer.train_step

    def train_step(self: Any, batches: list[Any], signum: int = 0) -> dict[str, float]:
        if self.step + 1 == step and self.groups.rank in ranks and not signum:
            signum = _await_stop_signal()
        return original(self, batches, signum)

    Trainer.train_step = train_step  # type: ignore[method-assign]


def gated_rank(config: Config, launched: bool = False) -> dict[str, Any]:
    """A rank entry point: the stop gate, then the ordinary rank body."""
    from colonnade.launch import run_rank

    install_stop_gate()
    return run_rank(config, launched)


def gated_main(argv: list[str]) -> int:
    """``colonnade`` with ``--stop-gate STEP:RANKS`` first: the gate in the ranks (and in this
    process, where a 1-process run trains)."""
    import colonnade.launch as launch_mod
    from tests.workflow.cli import gated_rank as entry  # by its importable name, not __main__

    assert argv[0] == "--stop-gate", argv
    os.environ[STOP_GATE_ENV] = argv[1]
    install_stop_gate()
    real = launch_mod.launch

    def launch(config: Config, args: Any, overrides: list[str] | None = None,
               **_: Any) -> int:
        return real(config, args, overrides, entrypoint=entry, entry_args=(config, True))

    launch_mod.launch = launch  # type: ignore[assignment]
    return main(argv[2:])


def wait_for_records(job: Job, run: Path, count: int) -> None:
    """Block until ``run/metrics.jsonl`` holds ``count`` records (the job still running).

    A poll for a condition: its outcome does not depend on the poll's timing, and the deadline
    is only a backstop far above any stall."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    path = run / "metrics.jsonl"
    while not path.exists() or len(path.read_text().splitlines()) < count:
        assert job.proc.poll() is None, job.output()
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.05)


def stopped_at(out: str, signame: str) -> int:
    """The step of the job's "interrupted by SIGNAME at step N; " line (asserted present)."""
    found = re.search(rf"interrupted by {signame} at step (\d+); ", out)
    assert found, out
    return int(found.group(1))


def assert_clean(out: str) -> None:
    """A stop that printed no traceback, no launcher-failure report and no warning from
    Python's resource tracker (a rank ending by ``os._exit`` with a multiprocessing lock
    alive: tqdm's default one, before ``run_rank`` gave tqdm a thread lock)."""
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "launcher failed" not in out and "likely cause" not in out, out
    assert "leaked semaphore" not in out and "resource_tracker" not in out, out


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps: range,
                       rel: float) -> None:
    """Every step of ``steps`` is logged in ``got`` and equals ``want`` within ``rel``."""
    assert set(steps) <= set(got), (got, want)
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=rel, abs=0.0), (step, got, want)


def greedy_text(model_dir: Path, capsys: pytest.CaptureFixture[str], prompt: str) -> str:
    """What ``colonnade generate`` prints for ``prompt`` with greedy decoding (12 tokens)."""
    capsys.readouterr()
    assert main(["generate", str(model_dir), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "12", "--device", "cpu"]) == 0
    return capsys.readouterr().out


if __name__ == "__main__":
    sys.exit(gated_main(sys.argv[1:]))
