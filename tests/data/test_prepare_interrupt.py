"""``colonnade prepare`` stopped half-way (Ctrl-C or SIGTERM, with and without worker
processes) leaves nothing behind: the exit status is 128 + the signal, one line says so, and
the prepared directory it created (holding a partial ``data.bin.tmp`` when the signal came) is
gone, so a re-run starts clean. Before ``sigterm_interrupts`` SIGTERM killed the process with
the partial file in place."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu"]


def _corpus(path: Path, docs: int = 150_000) -> None:
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=40))}) + "\n"
                            for _ in range(docs)))


@pytest.mark.parametrize(("sig", "workers"), [(signal.SIGTERM, 1), (signal.SIGINT, 2)])
def test_stopped_prepare_leaves_nothing(tmp_path: Path, sig: signal.Signals, workers: int
                                        ) -> None:
    _corpus(tmp_path / "big.jsonl")
    out = tmp_path / "data" / "big"
    proc = subprocess.Popen(
        [sys.executable, "-m", "colonnade.cli", "prepare", "--data.input=big.jsonl",
         f"--data.prepared_dir={out}", f"--data.num_workers={workers}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (out / "data.bin.tmp").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "tokenizing never started"
        time.sleep(0.01)
    assert proc.poll() is None, "prepare finished before it could be stopped"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    name = "SIGTERM" if sig == signal.SIGTERM else "Ctrl-C"
    assert proc.returncode == 128 + sig, err
    assert f"colonnade: interrupted ({name}) during `prepare` (nothing to save yet)" in err
    assert "Traceback" not in err and "Terminated" not in err, err
    assert not out.exists()
