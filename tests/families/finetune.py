"""A user's fine-tune of a model family through the CLI, shared by the families' tests
(issue 36): an HF folder (a tiny random transformers model, a BPE tokenizer.json with the
family's chat special tokens, a tokenizer_config.json holding its chat template), SFT chats
prepared with that folder's tokenizer, ``train --init-from`` under a layout whose loss falls
by more than 1 in a few steps, and ``convert --to-hf`` whose export transformers loads with
zero warnings (Python's and its logger's) and whose logits equal the checkpoint's.

The commands run in the test's process and the training ranks on the session's rank pool
(the ``cli`` fixture, tests/conftest.py): the CLI's parsing, HF import, preparation
and checks are the product's, and no interpreter, torch or transformers is started per
command (a family's five processes cost ~20 s of CPU). The real processes and launcher run
in tests/workflow/test_end_to_end.py."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from colonnade.checkpoint.export import load_exported
from colonnade.data.tokenizer import train_bpe_from_texts
from tests.families.harness import save_hf
from tests.reliability.jobs import losses
from tests.workflow.cli import Cli


def conversations() -> list[list[dict[str, str]]]:
    """Question / answer chats whose answer follows from the question (learnable)."""
    words = ["red", "green", "blue", "cat", "dog", "tree", "sun", "moon"]
    return [[{"role": "user", "content": f"say {a} {b}"},
             {"role": "assistant", "content": f"{a} {b} {a}"}]
            for a in words for b in words]


def hf_folder(root: Path, make_model: Callable[[int], Any], specials: list[str],
              template: str, eos: str) -> tuple[Path, int]:
    """``make_model(vocab)``'s random model saved in ``root`` with a tokenizer.json (a BPE of
    the chats plus ``specials``) and a tokenizer_config.json (``template``, ``eos``);
    returns (folder, vocabulary size)."""
    texts = [" ".join(m["content"] for m in chat) for chat in conversations()] * 4
    tok = train_bpe_from_texts(texts, 300, None)
    tok.add_special_tokens(specials)
    torch.manual_seed(0)
    save_hf(make_model(tok.get_vocab_size()), root)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                            "eos_token": eos}))
    return root, tok.get_vocab_size()


def fine_tune(cli: Cli, tmp_path: Path, hf: Path, layout: list[str], steps: int) -> str:
    """Prepare the chats with ``hf``'s tokenizer and chat template, then ``train --init-from``
    under ``layout`` (``--nproc N --parallel...`` arguments) for ``steps`` steps, saving to
    tmp_path/ck; asserts the loss falls by more than 1. Returns the run's config.toml."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()))
    status, out = cli(["prepare", "--data.format=sft", f"--data.input={chats}",
                           f"--data.tokenizer={hf}", f"--data.prepared_dir={tmp_path / 'sft'}"])
    assert status == 0, out
    status, out = cli([
        "train", *layout, f"--init-from={hf}", "--data.format=sft",
        f"--data.prepared_dir={tmp_path / 'sft'}", "--training.seq_len=32",
        "--training.micro_batch_size=2", "--training.microbatches=2",
        f"--training.steps={steps}", "--training.eval_interval=0", "--training.device=cpu",
        "--optim.lr=1e-2", "--optim.warmup_steps=1", "--logging.log_interval=1",
        "--logging.progress=false", f"--logging.dir={tmp_path / 'run'}",
        f"--checkpoint.save={tmp_path / 'ck'}"])
    assert status == 0, out
    assert "initialised the weights from Hugging Face model" in out, out
    got = losses(tmp_path / "run")
    assert sorted(got) == list(range(1, steps + 1)), got
    assert got[steps] < got[1] - 1.0, got
    return (tmp_path / "run" / "config.toml").read_text()


def export_and_load(cli: Cli, tmp_path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """``convert --to-hf`` of tmp_path/ck into tmp_path/export, loaded by transformers (model
    and tokenizer) with no warning at all; returns (model, tokenizer, config.json)."""
    status, out = cli(["convert", "--to-hf", str(tmp_path / "ck"), "--out",
                           str(tmp_path / "export")])
    assert status == 0, out
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
            tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    finally:
        hf_logger.removeHandler(handler)
    assert not caught and not logged, [str(w.message) for w in caught] + logged
    return model.eval(), tok, json.loads((tmp_path / "export" / "config.json").read_text())


def assert_same_logits(tmp_path: Path, model: Any, vocab: int, seq: int = 20) -> None:
    """The exported model's logits equal the fine-tuned checkpoint's (float32, 1e-4)."""
    _, ours = load_exported(tmp_path / "ck", dtype=torch.float32)
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mine = ours.eval()(ids).transpose(0, 1)[..., :vocab]  # [b, s, V]
        err = float((model(ids).logits - mine).abs().max())
    assert err < 1e-4, f"exported logits differ by {err:.2e}"
