"""Re-running a command into an existing checkpoint.save (issue 14, items 2 and 7): the same
run resumes from its latest checkpoint (logged) and metrics.jsonl continues without duplicate
steps; a finished run exits 0 without training; another run's checkpoints are refused unless
checkpoint.on_existing says resume / overwrite; what the log says was saved is on disk; and a
layout change on resume keeps the checkpoint's global batch (same data, same losses)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colonnade.cli import main
from tests.reliability.jobs import losses, tiny_args
from tests.workflow.cli import hashes, run_cli, steps_logged, steps_logged_file


def _crash_after(ckpt: Path, step: int) -> None:
    """Make ``ckpt`` look like a run that died after committing ``step`` (latest names it)."""
    (ckpt / "latest").write_text(f"step_{step:08d}\n")


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
    assert "deleted 3 earlier checkpoint(s)" in capsys.readouterr().out  # steps 4, 8, 12
    meta = json.loads((ckpt / "step_00000008" / "metadata.json").read_text())
    assert meta["model"]["hidden_size"] == 48
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000004",
                                                      "step_00000008"]


def test_layout_change_on_resume_keeps_the_global_batch(
        corpus: tuple[Path, Path], tmp_path: Path) -> None:
    """Saved by dp2 (global batch 4 = 2 x 2 ranks), resumed on one rank: the global batch stays
    4 (2 micro-batches of 2), so steps 5..8 see the same samples and match the dp2 run."""
    ckpt = tmp_path / "ckpt"
    args = _args(corpus, tmp_path / "run", ckpt)[1:]
    status, out = run_cli(["train", "--nproc", "2", *args])
    assert status == 0, out
    want = losses(tmp_path / "run")
    _crash_after(ckpt, 4)
    status, out = run_cli(["train", *args])
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
