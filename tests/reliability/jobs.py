"""Helpers of the reliability tests: a tiny corpus, a tiny model, and real launcher jobs.

Jobs are separate process trees (``start_new_session``) so a test can time them out and kill
exactly what it started. Every job trains the same tiny Llama (2 layers, hidden 32, vocab 300,
seq 16) on a 6-document corpus prepared once per session.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi"]


def write_corpus(directory: Path, docs: int = 6, words: int = 1500, seed: int = 0) -> Path:
    """A directory of small deterministic text files."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(docs):
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        (directory / f"doc{i}.txt").write_text(text + "\n")
    return directory


def tiny_args(corpus: Path, prepared: Path, run_dir: Path, **extra: object) -> list[str]:
    """``--section.field=value`` overrides of the tiny model and data, plus ``extra``
    (keys 'section__field')."""
    fields: dict[str, object] = {
        "model.num_layers": 2, "model.hidden_size": 32, "model.num_heads": 4,
        "model.vocab_size": 300, "model.max_seq_len": 32, "training.seq_len": 16,
        "training.micro_batch_size": 2, "training.steps": 8, "training.eval_interval": 0,
        "training.device": "cpu", "logging.log_interval": 1, "logging.progress": "false",
        "logging.tensorboard": "false", "logging.peak_tflops": 1.0,
        "data.input": str(corpus), "data.prepared_dir": str(prepared),
        "logging.dir": str(run_dir),
    }
    fields.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"--{k}={v}" for k, v in fields.items()]


@dataclass
class Job:
    """A started job: its process, where its output goes, when it began."""

    proc: subprocess.Popen[bytes]
    log: Path
    started: float

    def wait(self, timeout: float) -> int:
        """Exit status; kills the whole job and fails the test after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not end within {timeout} s; output:\n{self.output()}"
                                 ) from None

    def kill(self) -> None:
        """SIGKILL the job's process group (only what this test started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def output(self) -> str:
        """Everything the job printed (stdout and stderr)."""
        return self.log.read_text(errors="replace")


def start(argv: list[str], log: Path, module: str = "colonnade.cli") -> Job:
    """Run ``python -m module argv`` from the repository root, output to ``log``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    fh = log.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, env=env,
                            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    fh.close()
    return Job(proc, log, time.monotonic())


def losses(run_dir: Path) -> dict[int, float]:
    """Loss of every logged step of ``run_dir/metrics.jsonl`` (a re-logged step: the last)."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[int(rec["step"])] = float(rec["loss"])
    return out


def heartbeat(run_dir: Path, rank: int, attempt: int = 0) -> dict[str, object] | None:
    """Rank ``rank``'s heartbeat, or None when it has not written one yet."""
    path = run_dir / "heartbeat" / f"rank{rank}-a{attempt}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
