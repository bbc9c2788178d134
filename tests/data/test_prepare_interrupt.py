"""``colonnade prepare`` stopped half-way (Ctrl-C or SIGTERM, with and without worker
processes) leaves nothing behind: the exit status is 128 + the signal, one line says so, and
the prepared directory it created (holding a partial ``data.bin.tmp`` when the signal came) is
gone, so a re-run starts clean. Before ``sigterm_interrupts`` SIGTERM killed the process with
the partial file in place."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_the_pool_forks_is_raised_after_it(sig: signal.Signals,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C / SIGTERM that reaches another thread while the worker pool forks is raised in
    the main thread once the pool is up, not inside the fork (where Python ran the handler in
    logging's at-fork hook and ignored the KeyboardInterrupt: the CI run at 2e00f77 saw
    ``prepare`` run to the end with exit 0). The fork is stood in for by a wait that swallows
    a KeyboardInterrupt as an at-fork hook does."""
    from colonnade.data import encode
    from colonnade.data.tokenizer import train_bpe_from_texts
    from colonnade.reliability.interrupt import Terminated, sigterm_interrupts

    tok = train_bpe_from_texts(["alpha beta gamma delta"] * 50, 300, None)
    real_start = encode._start_pool
    ready, sent = threading.Event(), threading.Event()

    def other_thread() -> None:  # a thread started before the fork, its mask not blocked
        ready.wait(30)
        os.kill(os.getpid(), sig)
        sent.set()

    def forking_pool(*args: object) -> object:
        pool = real_start(*args)
        try:  # the handler runs at some bytecode in here; a fork hook would swallow it
            ready.set()
            deadline = time.monotonic() + 30
            while not sent.is_set() and time.monotonic() < deadline:
                pass
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                pass
        except KeyboardInterrupt:
            pool.terminate()
            pool.join()
            pytest.fail("the signal was raised inside the fork, where it would be lost")
        return pool

    monkeypatch.setattr(encode, "_start_pool", forking_pool)
    helper = threading.Thread(target=other_thread)
    helper.start()
    # the signal reaches a thread that does not block it: the helper's (or another); which
    # one, the kernel picks, and Python runs the handler in the main thread either way
    expected = Terminated if sig == signal.SIGTERM else KeyboardInterrupt
    with sigterm_interrupts(), pytest.raises(expected):
        for _ in encode.encode_stream(tok, 0, ["alpha beta"] * 10, num_workers=2):
            pytest.fail("a batch was encoded after the signal")
    helper.join()
