"""Every run saves by default (issue 35, item 3): under <logging.dir>/checkpoints, which
`generate` and `convert --to-hf` find from the run's logging.dir, and from which a re-run of the
same command resumes exactly as from an explicit checkpoint.save; checkpoint.save=none is the
explicit opt-out (kept as such in the run's config.toml), and an empty value is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from colonnade.checkpoint.commit import committed_steps
from colonnade.cli import main
from colonnade.config.load import load_config
from tests.reliability.jobs import losses, tiny_args
from tests.workflow.cli import greedy_text


def test_a_run_saves_under_its_logging_dir_and_resumes_from_it(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    argv = ["train", *tiny_args(*corpus, run, training__steps=4, checkpoint__interval=2)]
    assert main(argv) == 0, capsys.readouterr().err
    assert f"saved checkpoint {ckpt / 'step_00000004'}" in capsys.readouterr().out
    assert committed_steps(ckpt) == [2, 4]
    assert (ckpt / "latest").read_text().strip() == "step_00000004"
    assert load_config(run / "config.toml").checkpoint.save == str(ckpt)
    want = losses(run)
    # generate and convert take the run's logging.dir
    assert greedy_text(run, capsys, "alpha") == greedy_text(ckpt, capsys, "alpha")
    assert main(["convert", "--to-hf", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    # died after committing step 4, before `latest` named it: the same command resumes
    (ckpt / "latest").write_text("step_00000002\n")
    capsys.readouterr()
    assert main(argv) == 0
    assert f"resuming from {ckpt / 'step_00000002'}" in capsys.readouterr().out
    got = losses(run)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0.0), step
    # the same command once more: finished; the fixes name this run's own options
    capsys.readouterr()
    assert main(argv) == 0
    assert (f"{ckpt} already holds step 4 >= training.steps=4; nothing to train (raise "
            "--training.steps to continue, pick a new --logging.dir (checkpoints go to its "
            "checkpoints/) or --checkpoint.save to start over, or set "
            "--checkpoint.on_existing=overwrite to train it again from the start (its "
            "checkpoints are deleted once the new run saves))") in capsys.readouterr().out


def test_checkpoint_save_none_saves_nothing_and_says_so(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", *tiny_args(*corpus, run, training__steps=2,
                                     checkpoint__save="none")]) == 0
    assert not (run / "checkpoints").exists()
    assert 'save = "none"' in (run / "config.toml").read_text()  # reads back as the opt-out
    assert load_config(run / "config.toml").checkpoint.save is None
    capsys.readouterr()
    assert main(["generate", str(run)]) == 2
    err = capsys.readouterr().err
    assert "is a run's config with checkpoint.save=none: that run saved no model" in err, err
    bad = [("none", "2", "checkpoint.interval > 0 needs checkpoint.save=DIR or 'auto'"),
           ("", "0", "checkpoint.save is empty; give a directory, 'auto'")]
    for save, interval, message in bad:
        assert main(["train", *tiny_args(*corpus, tmp_path / "run_bad",
                                         checkpoint__save=save,
                                         checkpoint__interval=interval)]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "run_bad").exists()
