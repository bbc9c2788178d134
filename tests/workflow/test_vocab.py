"""model.vocab_size from the data's tokenizer. Unset (the default), it is the tokenizer's size;
set far above it, the run warns with the numbers; the Hugging Face export of either loads and
generates in transformers. A config with vocab_size = 2048 trained on a smaller tokenizer ran
silently: more parameters, a first validation loss of ln 2048, and an export saying 2048."""

from __future__ import annotations

import json
import math
import re
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from colonnade.cli import main
from colonnade.data import load_tokenizer
from tests.reliability.jobs import tiny_args


def _train(corpus: tuple[Path, Path], run: Path, *extra: str) -> int:
    text, prepared = corpus
    args = tiny_args(text, prepared, run, training__steps=1, training__eval_interval=1,
                     checkpoint__save=run / "ck")
    keep = [a for a in args if not a.startswith(("--model.vocab_size", "--data.input"))]
    return main(["train", *keep, *extra])  # the prepared dir as it is: its tokenizer


def _params(out: str) -> int:
    found = re.search(r"([\d,]+) params on rank 0", out)
    assert found, out
    return int(found.group(1).replace(",", ""))


def _exported(run: Path, out: Path) -> tuple[transformers.PreTrainedModel, object]:
    assert main(["convert", "--to-hf", str(run / "ck"), "--out", str(out)]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("the cat", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=3, do_sample=False,
                                   pad_token_id=tok.pad_token_id)
    assert generated.shape == (1, ids.shape[1] + 3)
    return model, tok


def test_vocab_size_is_the_tokenizers_unless_set(corpus: tuple[Path, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    tokens = load_tokenizer(corpus[1] / "tokenizer.json").get_vocab_size()
    assert tokens < 2048 - 128
    runs = {"unset": tmp_path / "unset", "2048": tmp_path / "v2048"}
    assert _train(corpus, runs["unset"]) == 0
    out, err = capsys.readouterr()
    params = {"unset": _params(out)}
    assert "warning" not in err, err
    assert _train(corpus, runs["2048"], "--model.vocab_size=2048") == 0
    out, err = capsys.readouterr()
    params["2048"] = _params(out)
    extra = 2048 - tokens
    assert err.splitlines() == [
        f"colonnade: warning: model.vocab_size=2048 but the tokenizer has {tokens} tokens: "
        f"{extra} embedding and output-head rows ({extra * 32 * 2:,} parameters) belong to no "
        f"token, and the untrained model's loss starts near ln 2048 = 7.62 instead of "
        f"ln {tokens} = {math.log(tokens):.2f}; unset model.vocab_size "
        f"(--model.vocab_size=none) to take the tokenizer's size "
        f"(up to {-(-tokens // 128) * 128}, a multiple of 128 x tp, is taken as "
        "deliberate padding)."]
    assert params["2048"] - params["unset"] == extra * 32 * 2  # embedding and head rows
    for name, vocab in (("unset", tokens), ("2048", 2048)):
        saved = tomllib.loads((runs[name] / "config.toml").read_text())["model"]
        assert saved["vocab_size"] == vocab
        first = json.loads((runs[name] / "metrics.jsonl").read_text().splitlines()[0])
        assert first["step"] == 0
        assert first["valid_loss"] == pytest.approx(math.log(vocab), abs=0.05)
        model, tok = _exported(runs[name], tmp_path / f"hf_{name}")
        assert len(tok) == tokens  # type: ignore[arg-type]
        assert model.config.vocab_size == vocab  # the embedding's rows, the padding kept
        assert model.get_input_embeddings().weight.shape[0] == vocab
