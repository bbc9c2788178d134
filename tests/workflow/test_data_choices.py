"""Data choices from the CLI (issue 35, items 1, 6, 7 and 13): data prepared again with another
tokenizer is named as the cause before any hint that deletes checkpoints; data.blend weights
must sum to 1, a prepared dir may stand for its prefix and the dry run shows the blend;
valid_fraction=0 trains without a validation set; a launched job prints one prepare line."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.distributed import HashStore

from colonnade.cli import main
from colonnade.config.load import load_config
from colonnade.config.validate import problems
from colonnade.training.setup import prepare_data, prepare_once
from tests.reliability.jobs import WORDS, tiny_args
from tests.workflow.cli import hashes


def _word_tokenizer(path: Path, size: int) -> Path:
    """A word-level tokenizer.json of `size` tokens that covers the corpus's words."""
    names = ["<unk>", "<|endoftext|>", *WORDS]
    names += [f"pad{i}" for i in range(size - len(names))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


@pytest.mark.parametrize("save", ["ckpt", "auto"])  # auto: the default, <logging.dir>/checkpoints
def test_rebuilt_data_is_named_before_any_checkpoint_deletion(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        save: str) -> None:
    text, source = corpus
    prepared = tmp_path / "prep"
    ckpt = tmp_path / "ckpt" if save == "ckpt" else tmp_path / "run" / "checkpoints"
    shutil.copytree(source, prepared)
    args = [a for a in tiny_args(text, prepared, tmp_path / "run", training__steps=1,
                                 checkpoint__save=save if save == "auto" else ckpt)
            if not a.startswith("--data.input=")]
    assert main(["train", *args]) == 0, capsys.readouterr().err
    other = _word_tokenizer(tmp_path / "words.json", 310)
    assert main(["prepare", f"--data.input={text}", f"--data.prepared_dir={prepared}",
                 f"--data.tokenizer={other}", "--data.overwrite=true"]) == 0
    capsys.readouterr()
    saved = hashes(ckpt)
    for extra in ([], ["--model.vocab_size=310"]):  # the old hint, then the next one
        assert main(["train", *args, *extra]) == 2
        err = capsys.readouterr().err
        assert (f"the data's tokenizer {prepared / 'tokenizer.json'} (310 tokens) is not the "
                f"one the checkpoints under checkpoint.save={ckpt} were trained with ("
                f"{ckpt}/step_00000001/tokenizer.json, ") in err, err
        assert f"data.prepared_dir='{prepared}' was prepared again with another tokenizer" \
            in err, err
        assert (f"`colonnade prepare --data.input=YOUR_TEXT --data.tokenizer={ckpt}/"
                "step_00000001/tokenizer.json --data.prepared_dir=NEW_DIR`") in err, err
        assert "overwrite" not in err and "delete" not in err, err
        assert hashes(ckpt) == saved


def test_blend_weights_and_prepared_dir_paths(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, prepared = corpus
    args = [a for a in tiny_args(text, prepared, tmp_path / "run")
            if not a.startswith("--data.input=")]

    def found(blend: str) -> list[str]:
        return [p for p in problems(load_config(None, [*args, f"--data.blend={blend}"]))
                if "data.blend" in p]

    assert found(f"0.7:{prepared}/data,0.5:{prepared}") == [
        "data.blend weights sum to 1.2, not 1: each weight is the fraction of training samples "
        "drawn from its dataset. Give fractions that sum to 1, e.g. "
        f"--data.blend=0.5833:{prepared}/data,0.4167:{prepared} (the same proportions)."]
    assert found(f"0.333:{prepared},0.333:{prepared}/data,0.333:{prepared}/data.bin") == []
    assert "a directory without data.idx: not a prepared dir" in found(f"1:{tmp_path}")[0]
    assert main(["train", "--dry-run", *args, f"--data.blend=0.25:{prepared},"
                 f"0.75:{prepared}/data"]) == 0
    out = capsys.readouterr().out
    assert f"data: training samples are drawn from data.blend (validation from {prepared}):\n" \
           f"  blend 0.25 of the samples: {prepared}/data: 3 documents, " in out, out
    assert "samples per epoch, this run uses 4 = " in out and "this run uses 12 = " in out, out
    assert main(["train", *args, f"--data.prepared_dir={prepared}/data"]) == 2
    assert (f"{prepared} holds one ({prepared}/data is its data.bin/.idx prefix): did you mean "
            f"--data.prepared_dir={prepared}?") in capsys.readouterr().err


def test_valid_fraction_zero_trains_without_validation(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, prepared = corpus
    args = [a for a in tiny_args(text, prepared, tmp_path / "run", training__steps=2,
                                 data__valid_fraction=0) if not a.startswith("--data.input=")]
    assert main(["train", "--dry-run", *args]) == 0
    assert "(no validation: data.valid_fraction=0)" in capsys.readouterr().out
    assert main(["train", *args]) == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"step"') == 2
    assert "valid_loss" not in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_launched_rank_does_not_repeat_the_prepare_line(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`colonnade train --nproc N` prepares once before launch ('wrote'), then rank 0 finds
    the build: it used to print 'prepare: reusing' right after 'prepare: wrote'."""
    config = load_config(None, tiny_args(corpus[0], tmp_path / "p", tmp_path / "run"))
    prepare_data(config)  # the launcher, before the ranks start
    assert "prepare: wrote" in capsys.readouterr().out
    store = HashStore()
    world = SimpleNamespace(size=2, pg=SimpleNamespace(get_group_store=lambda: store))
    prepare_once(config, SimpleNamespace(world=world, rank=0))  # type: ignore[arg-type]
    assert capsys.readouterr().out == ""
    assert store.get("colonnade/prepare/1") == b"ok"


def test_blend_dir_of_another_tokenizer_is_refused(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A blend entry that names a prepared dir (not DIR/data) is checked against the data's
    tokenizer too: its tokenizer.json is DIR's, not DIR's parent's."""
    text, prepared = corpus
    other = tmp_path / "words"
    assert main(["prepare", f"--data.input={text}", f"--data.prepared_dir={other}",
                 f"--data.tokenizer={_word_tokenizer(tmp_path / 'w.json', 310)}"]) == 0
    args = [a for a in tiny_args(text, prepared, tmp_path / "run", training__steps=1,
                                 model__vocab_size=310) if not a.startswith("--data.input=")]
    capsys.readouterr()
    assert main(["train", *args, f"--data.blend=0.5:{prepared},0.5:{other}"]) == 2
    assert (f"data.blend entry '0.5:{other}' was tokenized with {other}/tokenizer.json, another "
            f"tokenizer than the data's {prepared}/tokenizer.json") in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
