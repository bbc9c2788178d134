"""``colonnade train --nproc 2 --parallel.pp=2 --parallel.vp=2 --parallel.schedule=zbv`` as a
user runs it, on the built-in corpus (capped small), float64: tied gpt2, 4 micro-batches,
evaluation at step 0 and every 2 steps (the forward-only V order). Every step's training
and validation loss equals the one-process
run's (1e-12, as the cp CLI tests); the checkpoint records the layout (pp 2, vp 2, schedule
zbv); ``colonnade generate`` from it writes the one-process checkpoint's greedy text; and the
run resumed from its step-2 checkpoint as pp 2 1F1B (vp 1) repeats steps 3-6. The commands
run in this process, the two ranks on the rank pool (the ``cli`` fixture)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from colonnade.cli import main
from tests.workflow.cli import Cli, assert_same_losses, greedy_text

STEPS, TOL = 6, 1e-12
VALID = "valid_loss"
ZBV = ["--parallel.pp=2", "--parallel.vp=2", "--parallel.schedule=zbv"]


def _args(prepared: Path, run: Path, ckpt: Path) -> list[str]:
    fields: dict[str, object] = {
        "model.arch": "gpt2", "model.tie_embeddings": "true", "model.bias": "true",
        "model.num_layers": 4, "model.hidden_size": 32, "model.num_heads": 4,
        "model.vocab_size": 300, "model.max_seq_len": 32, "training.seq_len": 16,
        "training.micro_batch_size": 2, "training.microbatches": 4, "training.steps": STEPS,
        "training.precision": "fp64", "training.device": "cpu", "training.eval_interval": 2,
        "training.eval_batches": 2, "data.valid_fraction": 0.1, "optim.lr": 3e-3,
        "optim.warmup_steps": 1, "logging.log_interval": 1, "logging.progress": "false",
        "logging.tensorboard": "false", "data.prepared_dir": prepared, "logging.dir": run,
        "checkpoint.save": ckpt, "checkpoint.interval": 2,
    }
    return [f"--{k}={v}" for k, v in fields.items()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The built-in corpus prepared (100 kB of stdlib source) and the one-process run:
    (prepared dir, run dir, checkpoint root)."""
    root = tmp_path_factory.mktemp("zbv-ref")
    prepared = root / "prepared"
    assert main(["prepare", "--data.max_corpus_bytes=100000", "--model.vocab_size=300",
                 f"--data.prepared_dir={prepared}"]) == 0
    assert main(["train", *_args(prepared, root / "run", root / "ckpt")]) == 0
    return prepared, root / "run", root / "ckpt"


def _logged(run: Path, key: str) -> dict[int, float]:
    """Step -> ``key`` of every metrics.jsonl record holding it (a re-logged step: the last)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): float(r[key]) for r in records if key in r}


def losses(run: Path) -> dict[int, float]:
    """Step -> training loss."""
    return _logged(run, "loss")


def test_zbv_train_equals_one_process(reference: tuple[Path, Path, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str], cli: Cli) -> None:
    prepared, ref_run, ref_ckpt = reference
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    status, out = cli(["train", "--nproc", "2", *_args(prepared, run, ckpt), *ZBV])
    assert status == 0, out
    assert "colonnade: pp2-vp2 (schedule zbv) on cpu" in out, out
    assert_same_losses(losses(run), losses(ref_run), range(1, STEPS + 1), TOL)
    want_valid = _logged(ref_run, VALID)
    assert sorted(want_valid) == [0, 2, 4, 6], want_valid
    assert_same_losses(_logged(run, VALID), want_valid, range(0, STEPS + 1, 2), TOL)
    step = ckpt / f"step_{STEPS:08d}"
    meta = json.loads((step / "metadata.json").read_text())
    assert (meta["layout"]["pp"], meta["layout"]["vp"]) == (2, 2), meta["layout"]
    saved = tomllib.loads((step / "config.toml").read_text())
    assert saved["parallel"]["schedule"] == "zbv", saved["parallel"]
    assert greedy_text(ckpt, capsys, "def ") == greedy_text(ref_ckpt, capsys, "def ")

    (ckpt / "latest").write_text("step_00000002\n")  # as if it died after step 2
    status, out = cli(["train", "--nproc", "2", *_args(prepared, run, ckpt),
                           "--parallel.pp=2"])
    assert status == 0, out
    assert "resuming from" in out and "step_00000002" in out, out
    assert "colonnade: pp2 (schedule 1f1b) on cpu" in out, out
    assert_same_losses(losses(run), losses(ref_run), range(1, STEPS + 1), TOL)
