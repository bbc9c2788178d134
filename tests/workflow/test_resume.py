"""Re-running a command into an existing checkpoint.save (issue 14, items 2 and 7): the same
run resumes from its latest checkpoint (logged) and metrics.jsonl continues without duplicate
steps; a finished run exits 0 without training; another run's checkpoints are refused unless
checkpoint.on_existing says resume / overwrite; what the log says was saved is on disk; and a
layout change on resume keeps the checkpoint's global batch (same data, same losses).

Issue 35: 'overwrite' keeps the earlier checkpoints until its own first save (a crash before it
loses nothing, and neither a restart nor a re-run resumes from them by mistake), also into a
save dir that does not exist yet; a resumed run's elapsed time, closing summary and metrics
records cover the whole run, and a record a resume drops says which attempt wrote it."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from colonnade.cli import main
from colonnade.config.load import load_config
from colonnade.config.validate import resolve
from colonnade.reliability.startup import resume_config
from tests.reliability.faults import Fault, install, uninstall
from tests.reliability.jobs import losses, tiny_args
from tests.workflow.cli import Cli, hashes, steps_logged, steps_logged_file


def _crash_after(ckpt: Path, step: int) -> None:
    """Make ``ckpt`` look like a run that died after committing ``step`` (latest names it)."""
    (ckpt / "latest").write_text(f"step_{step:08d}\n")


@contextlib.contextmanager
def _crash_at(step: int) -> Iterator[None]:
    """Rank 0 raises at the start of ``step`` (a crash: nothing after it runs, no final save);
    the stop-signal handlers the dead loop left are put back."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    install(Fault("raise", 0, step))
    try:
        with pytest.raises(RuntimeError, match=f"injected failure on rank 0 at step {step}"):
            yield
    finally:
        uninstall()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _args(corpus: tuple[Path, Path], run: Path, ckpt: Path, **extra: object) -> list[str]:
    return ["train", *tiny_args(*corpus, run, checkpoint__save=ckpt, checkpoint__interval=4,
                                **extra)]


@pytest.fixture()
def finished(corpus: tuple[Path, Path], tmp_path: Path,
             capsys: pytest.CaptureFixture[str]) -> tuple[list[str], Path, dict[int, float]]:
    """A completed 8-step run saving at steps 4 and 8: (its command, save dir, losses)."""
    ckpt = tmp_path / "ckpt"
    argv = _args(corpus, tmp_path / "run", ckpt)
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    return argv, ckpt, losses(tmp_path / "run")


def test_rerun_of_a_finished_run_trains_nothing(
        finished: tuple[list[str], Path, dict[int, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv, ckpt, _ = finished
    before = hashes(ckpt)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"{ckpt} already holds step 8 >= training.steps=8; nothing to train" in out, out
    assert "step     1" not in out
    assert hashes(ckpt) == before
    assert steps_logged(tmp_path / "run") == list(range(1, 9))


def test_rerun_after_a_crash_resumes_without_duplicate_metrics(
        finished: tuple[list[str], Path, dict[int, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Died after committing step 8 but before `latest` named it: the re-run resumes from step
    4, logs it, re-does 5..8 with the same losses, and replaces the unnamed step_8 (the log's
    "saved" is what is on disk); metrics.jsonl holds each step once."""
    argv, ckpt, want = finished
    _crash_after(ckpt, 4)
    old_index = (ckpt / "step_00000008" / "index.json").stat().st_ino
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"resuming from {ckpt / 'step_00000004'}" in out, out
    assert f"saved checkpoint {ckpt / 'step_00000008'}" in out, out
    assert "moved 4 metrics.jsonl record(s) past step 4" in out, out
    assert steps_logged_file(tmp_path / "run" / "metrics.dropped.jsonl") == [5, 6, 7, 8]
    assert (ckpt / "latest").read_text().strip() == "step_00000008"
    assert (ckpt / "step_00000008" / "index.json").stat().st_ino != old_index
    assert steps_logged(tmp_path / "run") == list(range(1, 9))
    got = losses(tmp_path / "run")
    for step in range(1, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0.0), step


def test_another_runs_checkpoints_are_refused_unless_told(
        finished: tuple[list[str], Path, dict[int, float]], corpus: tuple[Path, Path],
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, ckpt, _ = finished
    before = hashes(ckpt)
    wider = _args(corpus, tmp_path / "run_b", ckpt, model__hidden_size=48)
    assert main(wider) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.save={ckpt} holds another run's checkpoints" in err, err
    assert "model.hidden_size=48 (checkpoint: 32)" in err, err
    assert "--checkpoint.on_existing=overwrite" in err, err
    assert main(_args(corpus, tmp_path / "run_c", ckpt, training__seed=5)) == 2
    err = capsys.readouterr().err
    assert "training.seed=5 (checkpoint: 1234)" in err and "=resume" not in err, err
    moved = tmp_path / "moved"  # the same dataset under another path: resumable when told
    shutil.copytree(corpus[1], moved)
    reseeded = _args((corpus[0], moved), tmp_path / "run_c", ckpt, training__steps=12,
                     checkpoint__lr_schedule="checkpoint")
    assert main(reseeded) == 2
    err = capsys.readouterr().err
    assert f"data.prepared_dir='{moved}'" in err and "=resume" in err, err
    same = _args(corpus, tmp_path / "run", ckpt)
    assert main([*same, "--checkpoint.on_existing=refuse"]) == 2
    assert "checkpoint.on_existing='refuse'" in capsys.readouterr().err
    assert hashes(ckpt) == before  # every refusal left the checkpoints as they were
    assert main([*reseeded, "--checkpoint.on_existing=resume"]) == 0
    assert f"resuming from {ckpt / 'step_00000008'}" in capsys.readouterr().out
    assert main([*wider, "--checkpoint.on_existing=overwrite"]) == 0
    out = capsys.readouterr().out  # steps 4, 8, 12: deleted once step 4 is committed
    assert (f"the 3 earlier checkpoint(s) under {ckpt} (step_00000004 .. step_00000012) are "
            "kept until this run's first checkpoint is committed, then deleted") in out, out
    meta = json.loads((ckpt / "step_00000008" / "metadata.json").read_text())
    assert meta["model"]["hidden_size"] == 48
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000004",
                                                      "step_00000008"]


def test_overwrite_keeps_the_old_checkpoints_until_its_first_save(
        finished: tuple[list[str], Path, dict[int, float]], corpus: tuple[Path, Path],
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another model (hidden 48) overwriting the finished run's steps 4 and 8: a crash at step 2,
    before its first save, leaves them as they were; a restart starts the new run again and a
    re-run that does not overwrite is refused (neither resumes the old hidden-32 checkpoints);
    a crash at step 6, after its first save, leaves only its own step 4, which a restart
    resumes."""
    _, ckpt, _ = finished
    before = hashes(ckpt)
    wider = _args(corpus, tmp_path / "run_b", ckpt, model__hidden_size=48)
    overwrite = [*wider, "--checkpoint.on_existing=overwrite"]
    with _crash_at(2):
        main(overwrite)
    out = capsys.readouterr().out
    assert (f"the 2 earlier checkpoint(s) under {ckpt} (step_00000004 .. step_00000008) are "
            "kept until") in out, out
    assert {k: v for k, v in hashes(ckpt).items() if k != "replacing.json"} == before
    config = resolve(load_config(None, overwrite[1:]), 1)
    restarted, note = resume_config(config, 1)
    assert restarted.checkpoint.load is None, note
    assert note == (f"restart 1: no checkpoint of this run under checkpoint.save={ckpt} yet (the "
                    "2 earlier one(s) it replaces are kept until its first save); starting "
                    "again from scratch")
    assert main(wider) == 2
    err = capsys.readouterr().err
    assert (f"checkpoint.save={ckpt} holds 2 checkpoint(s) (step_00000004 .. step_00000008) "
            "that a run with checkpoint.on_existing=overwrite began replacing") in err, err
    assert f"to resume from them instead, remove {ckpt / 'replacing.json'}" in err, err
    with _crash_at(6):
        main(overwrite)
    capsys.readouterr()
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000004"]
    meta = json.loads((ckpt / "step_00000004" / "metadata.json").read_text())
    assert meta["model"]["hidden_size"] == 48
    restarted, note = resume_config(config, 1)
    assert restarted.checkpoint.load == str(ckpt)
    assert note == f"restart 1: resuming from {ckpt / 'step_00000004'}"


def test_overwrite_into_a_save_dir_that_does_not_exist_yet(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "new" / "ckpt"
    argv = ["train", *tiny_args(*corpus, tmp_path / "run", training__steps=2,
                                checkpoint__save=ckpt, checkpoint__on_existing="overwrite")]
    assert main(argv) == 0, capsys.readouterr().err
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002"]


def test_a_resumed_run_reports_the_whole_run(corpus: tuple[Path, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Resumed at step 4 of 8 from a checkpoint that recorded 1000 s of training: elapsed_s goes
    on from 1000, the closing summary spans steps 0-8 (the first segment's step-0 validation
    loss), and every record says which attempt wrote it, the dropped ones too."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = _args(corpus, run, ckpt, training__eval_interval=4, training__eval_batches=1)
    assert main(argv) == 0, capsys.readouterr().err
    first = {r["step"]: r for r in _records(run / "metrics.jsonl")}
    meta_path = ckpt / "step_00000004" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    assert first[3]["elapsed_s"] <= meta["elapsed_s"] <= first[4]["elapsed_s"]  # saved, logged
    meta_path.write_text(json.dumps({**meta, "elapsed_s": 1000.0}))
    _crash_after(ckpt, 4)
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    records = _records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(9))
    for r in records:
        resumed = r["step"] > 4
        assert r["attempt"] == int(resumed), r
        assert (1000.0 <= r["elapsed_s"] < 1100.0) if resumed else r["elapsed_s"] < 1000.0, r
    assert json.loads((ckpt / "step_00000008" / "metadata.json").read_text())["elapsed_s"] > 1000
    valid = {r["step"]: r["valid_loss"] for r in records if "valid_loss" in r}
    assert sorted(valid) == [0, 4, 8]
    assert f"validation loss {valid[0]:.4f} -> {valid[8]:.4f} (" in out, out
    assert re.search(r"lower\) over steps 0-8, 1[678]m\d\ds of training", out), out  # 1000 s +
    dropped = _records(run / "metrics.dropped.jsonl")
    assert [(r["step"], r["attempt"]) for r in dropped] == [(s, 0) for s in range(5, 9)]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_layout_change_on_resume_keeps_the_global_batch(
        corpus: tuple[Path, Path], tmp_path: Path, cli: Cli) -> None:
    """Saved by dp2 (global batch 4 = 2 x 2 ranks), resumed on one rank: the global batch stays
    4 (2 micro-batches of 2), so steps 5..8 see the same samples and match the dp2 run. Both
    commands in this process, the dp2 ranks on the rank pool (the ``cli`` fixture)."""
    ckpt = tmp_path / "ckpt"
    args = _args(corpus, tmp_path / "run", ckpt)[1:]
    status, out = cli(["train", "--nproc", "2", *args])
    assert status == 0, out
    want = losses(tmp_path / "run")
    _crash_after(ckpt, 4)
    status, out = cli(["train", *args])
    assert status == 0, out
    assert "keeping its global batch 4" in out and "global batch 4 x 16 tokens" in out, out
    got = losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0.0), step


def test_fine_tune_rerun_resumes_its_own_checkpoints(
        finished: tuple[list[str], Path, dict[int, float]], corpus: tuple[Path, Path],
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--init-from with a checkpoint.save that already holds this fine-tune's checkpoints: the
    re-run resumes from them (step 4, its optimizer and data position), not from the init
    weights again, and ends with the same losses."""
    _, source, _ = finished
    tuned, run = tmp_path / "tuned", tmp_path / "run_ft"
    argv = ["train", *tiny_args(*corpus, run, checkpoint__save=tuned, checkpoint__interval=4),
            f"--init-from={source}"]
    assert main(argv) == 0, capsys.readouterr().err
    want = losses(run)
    _crash_after(tuned, 4)
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"resuming from {tuned / 'step_00000004'}" in out, out
    assert f"resumed from {tuned / 'step_00000004'} at step 4" in out, out
    assert steps_logged(run) == list(range(1, 9))
    got = losses(run)
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0.0), step


def test_resume_in_another_layout_keeps_the_global_batch_over_config_microbatches(
        tmp_path: Path) -> None:
    """A config file's training.microbatches (written for the layout that saved) does not
    shrink a resumed run's global batch: saved at 64 = 8 x 2 x dp4, resumed at dp2 with the
    same file, the global batch stays 64 (4 micro-batches) and the note says so; resumed at
    dp3 it cannot divide 64, and validation refuses it by name before launch."""
    import dataclasses

    from colonnade.config.load import config_to_toml
    from colonnade.config.sections import Config, TrainingConfig
    from colonnade.config.validate import resolve, validate
    from colonnade.reliability.startup import _keep_global_batch

    saved = Config(training=TrainingConfig(micro_batch_size=8, microbatches=2,
                                           global_batch_size=64))
    (tmp_path / "config.toml").write_text(config_to_toml(saved))
    run = dataclasses.replace(saved, training=dataclasses.replace(
        saved.training, global_batch_size=None))
    config, note = _keep_global_batch(run, tmp_path)
    assert "keeping its global batch 64" in note and "microbatches=2 is re-derived" in note
    tr = resolve(config, 2).training
    assert (tr.global_batch_size, tr.microbatches) == (64, 4)
    assert resolve(config, 4).training.microbatches == 2  # the saving layout: unchanged
    with pytest.raises(Exception, match="global_batch_size=64"):
        validate(resolve(config, 3), 3)
