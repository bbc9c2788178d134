"""SFT chat records (issue 35, item 14): the built-in "<role>: <content>\\n" format and a
tokenizer's own chat template, rendered by transformers.

Checked: transformers renders :data:`BUILTIN_CHAT_TEMPLATE` into exactly the built-in format's
text (and "assistant: " as the generation prompt); with a tokenizer whose tokenizer_config.json
holds a (ChatML) template, `prepare_sft` trains on exactly
``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=False)`` + EOD with
the mask on the assistant replies and their end-of-turn text only, keeps the template in the
prepared dir, tokenizes again when the template changes, and lists the records the template
refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from colonnade.data import CorpusError, IndexedDataset
from colonnade.data.chat import BUILTIN_CHAT_TEMPLATE, builtin_segments
from colonnade.data.prepare import prepare
from colonnade.data.sft import prepare_sft
from colonnade.data.tokenizer import train_bpe_from_texts

CHATML = ("{% for message in messages %}"
          "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""Qwen's ChatML template, refusing roles other than system/user/assistant."""

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?\nthanks"},
     {"role": "assistant", "content": "6, café"}],
]


def chat_tokenizer(directory: Path, template: str = CHATML) -> Tokenizer:
    """A byte-level BPE (trained here) with ChatML's two special tokens, saved in
    ``directory`` with a tokenizer_config.json holding ``template``."""
    tok = train_bpe_from_texts(["hello there, how are you? fine thanks " * 20], 300, None)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|im_end|>"}))
    return tok


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_builtin_template_renders_the_builtin_format() -> None:
    """transformers' rendering of BUILTIN_CHAT_TEMPLATE == the joined built-in segments."""
    tok = PreTrainedTokenizerFast(tokenizer_object=train_bpe_from_texts(["ab ab"], 260, None),
                                  chat_template=BUILTIN_CHAT_TEMPLATE)
    for messages in CONVERSATIONS:
        text = "".join(t for t, _ in builtin_segments(messages))
        assert tok.apply_chat_template(messages, tokenize=False) == text
    assert text == ("system: be brief\nuser: 2+2?\nassistant: 4\nuser: and 3+3?\nthanks\n"
                    "assistant: 6, café\n")
    prompt = tok.apply_chat_template(CONVERSATIONS[0][:1], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "user: hi\nassistant: "


def test_a_tokenizer_chat_template_is_applied_with_replies_masked_in(tmp_path: Path) -> None:
    tok = chat_tokenizer(tmp_path / "tok")
    src = _write(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS])
    logged: list[str] = []
    res = prepare_sft(src, tmp_path / "out", None, tmp_path / "tok", progress=False,
                      log=logged.append)
    assert logged[0] == (f"prepare: rendering chat records with the chat template of "
                         f"{tmp_path / 'tok'} (assistant replies trained on)")
    data = IndexedDataset(tmp_path / "out" / "data")
    mask = IndexedDataset(tmp_path / "out" / "mask")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    for k, messages in enumerate(CONVERSATIONS):
        ids = data[k].tolist()
        assert ids[-1] == res.eod_id
        assert tok.decode(ids[:-1], skip_special_tokens=False) == hf.apply_chat_template(
            messages, tokenize=False)
    # the mask: each reply and its end-of-turn text, and the EOD; nothing else
    segments = [("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                 "<|im_start|>assistant\n", 0), ("4<|im_end|>\n", 1),
                ("<|im_start|>user\nand 3+3?\nthanks<|im_end|>\n<|im_start|>assistant\n", 0),
                ("6, café<|im_end|>\n", 1)]
    enc = [tok.encode(t, add_special_tokens=False).ids for t, _ in segments]
    assert data[1].tolist() == [i for e in enc for i in e] + [res.eod_id]
    assert mask[1].tolist() == [m for e, (_, m) in zip(enc, segments, strict=True) for _ in e] + [1]
    kept = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert kept == {"chat_template": CHATML, "eos_token": "<|im_end|>"}
    assert prepare_sft(src, tmp_path / "out", None, tmp_path / "tok", progress=False,
                       log=logged.append).reused
    other = CHATML.replace("role'] + '\\n'", "role'] + ':\\n'").replace(
        "assistant\\n' }}", "assistant:\\n' }}")  # "user:\n", "assistant:\n"
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": other, "eos_token": "<|im_end|>"}))
    again = prepare_sft(src, tmp_path / "out", None, tmp_path / "tok", progress=False,
                        log=logged.append)
    assert not again.reused and again.num_tokens > res.num_tokens  # one ':' more per turn
    assert "user:\nhi<|im_end|>" in tok.decode(IndexedDataset(tmp_path / "out" / "data")[0]
                                               .tolist(), skip_special_tokens=False)


def test_records_the_template_refuses_are_listed(tmp_path: Path) -> None:
    chat_tokenizer(tmp_path / "tok")
    tool = [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"},
            {"role": "assistant", "content": "z"}]
    src = _write(tmp_path / "chats.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": tool}])
    with pytest.raises(CorpusError, match=r"chats.jsonl:2: the chat template of .*tok fails "
                       r"on it: unknown role tool\nfix them \(e.g. messages the chat template of "
                       r".*tok accepts; or set data.prompt_key / data.response_key\)"):
        prepare_sft(src, tmp_path / "out", None, tmp_path / "tok", progress=False,
                    log=lambda _m: None)
    assert not (tmp_path / "out").exists()
    res = prepare_sft(src, tmp_path / "out", None, tmp_path / "tok", errors="skip",
                      progress=False, log=lambda _m: None)
    assert res.num_docs == 1
    # a template whose generation prompt is not how it renders the reply's turn: no mask
    chat_tokenizer(tmp_path / "odd", CHATML.replace("assistant\\n' }}", "bot\\n' }}"))
    with pytest.raises(CorpusError, match=r"chats.jsonl:1: the chat template of .*odd does "
                       r"not render messages\[:2\] as the start of the whole conversation, so "
                       r"the reply of messages\[1\] cannot be located for the loss mask"):
        prepare_sft(src, tmp_path / "out2", None, tmp_path / "odd", progress=False,
                    log=lambda _m: None)


def test_a_chat_template_jinja_file_is_applied_and_kept(tmp_path: Path) -> None:
    """transformers >= 4.50 saves a tokenizer's template as chat_template.jinja: it is applied
    like a tokenizer_config.json key, and kept there for checkpoints and the HF export."""
    tok = chat_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>"}))
    (tmp_path / "tok" / "chat_template.jinja").write_text(CHATML)
    src = _write(tmp_path / "chats.jsonl", [{"messages": CONVERSATIONS[0]}])
    prepare_sft(src, tmp_path / "out", None, tmp_path / "tok" / "tokenizer.json",
                progress=False, log=lambda _m: None)
    ids = IndexedDataset(tmp_path / "out" / "data")[0].tolist()
    assert tok.decode(ids[:-1], skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhey<|im_end|>\n")
    kept = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert kept == {"chat_template": CHATML, "eos_token": "<|im_end|>"}


def test_a_reused_dataset_takes_the_tokenizers_new_chat_template(tmp_path: Path) -> None:
    """Pretraining data reused as it is (same tokenizer.json, same input) still gets the
    tokenizer folder's current tokenizer_config.json, logged: its tokens do not depend on it,
    but checkpoints and the HF export carry it."""
    chat_tokenizer(tmp_path / "tok")
    (tmp_path / "c.txt").write_text("hello there, how are you? " * 20)
    logged: list[str] = []
    prepare(tmp_path / "c.txt", tmp_path / "out", None, tmp_path / "tok", progress=False,
            log=logged.append)
    other = {"chat_template": BUILTIN_CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(other))
    logged.clear()
    assert prepare(tmp_path / "c.txt", tmp_path / "out", None, tmp_path / "tok",
                   progress=False, log=logged.append).reused
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == other
    assert logged[1] == (f"prepare: {tmp_path / 'out'}: tokenizer_config.json (special tokens, "
                         f"chat template) updated to the one of {tmp_path / 'tok'}")
