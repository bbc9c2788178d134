"""The HF export's chat template reproduces what SFT trained on (issue 35, item 14).

The whole path a user takes, in-process: `colonnade train` on chat records (data.format='sft';
it prepares them), a checkpoint, `colonnade convert --to-hf`; then
``AutoTokenizer.from_pretrained(export).apply_chat_template(messages, tokenize=False)`` equals
the text of each training example (its tokens before the EOD, decoded) — with the BPE that
prepare trains (the built-in "<role>: <content>\\n" format; its generation prompt is
"assistant: ") and with a tokenizer that has its own (ChatML) template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from colonnade.cli import main
from colonnade.data import IndexedDataset
from colonnade.data.tokenizer import load_tokenizer
from tests.data.test_sft_chat import CHATML, CONVERSATIONS, chat_tokenizer
from tests.reliability.jobs import tiny_args


@pytest.mark.parametrize("own_template", [False, True], ids=["builtin", "chatml"])
def test_exported_chat_template_renders_the_training_text(tmp_path: Path,
                                                          own_template: bool) -> None:
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 12))
    prep, ckpt, out = tmp_path / "prep", tmp_path / "ckpt", tmp_path / "hf"
    extra: dict[str, object] = {"data__format": "sft", "training__steps": 2,
                                "checkpoint__save": ckpt}
    if own_template:
        tok = chat_tokenizer(tmp_path / "tok")
        extra.update(data__tokenizer=tmp_path / "tok", model__vocab_size=tok.get_vocab_size())
    assert main(["train", *tiny_args(src, prep, tmp_path / "run", **extra)]) == 0
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(out)]) == 0
    hf = AutoTokenizer.from_pretrained(str(out))
    tok = load_tokenizer(prep / "tokenizer.json")
    data = IndexedDataset(prep / "data")
    for k, messages in enumerate(CONVERSATIONS):
        trained_on = tok.decode(data[k].tolist()[:-1], skip_special_tokens=False)
        assert hf.apply_chat_template(messages, tokenize=False) == trained_on
    if own_template:
        assert trained_on.startswith("<|im_start|>system\nbe brief<|im_end|>\n")
        assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    else:
        assert trained_on == ("system: be brief\nuser: 2+2?\nassistant: 4\n"
                              "user: and 3+3?\nthanks\nassistant: 6, café\n")
        assert hf.apply_chat_template(messages[:2], tokenize=False,
                                      add_generation_prompt=True) == (
            "system: be brief\nuser: 2+2?\nassistant: ")
