"""A user's Qwen2.5 fine-tune through the CLI (issue 36): an HF ``Qwen2ForCausalLM`` folder
(q/k/v biases, tied embeddings as the small Qwen2.5 models, ``use_sliding_window`` with
``max_window_layers`` 1 of 2, window 8 on 32-token samples) with a ChatML template, SFT chats
prepared with that folder's tokenizer, ``train --init-from`` in tp2 x pp2 (4 ranks: the tied
head on the other stage) whose loss falls, and ``convert --to-hf`` whose export transformers
loads with zero warnings, the same window fields and our logits."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch
import transformers

from colonnade.checkpoint.export import load_exported
from colonnade.data.tokenizer import train_bpe_from_texts
from tests.families.harness import save_hf
from tests.families.test_qwen3_finetune import CHATML, _conversations
from tests.reliability.jobs import losses
from tests.workflow.cli import run_cli

STEPS = 8


def _hf_folder(root: Path) -> tuple[Path, int]:
    """A tiny random Qwen2ForCausalLM, its tokenizer.json (a BPE with ChatML's special tokens)
    and a tokenizer_config.json with the chat template; (folder, vocabulary)."""
    texts = [" ".join(m["content"] for m in chat) for chat in _conversations()] * 4
    tok = train_bpe_from_texts(texts, 300, None)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, use_sliding_window=True, sliding_window=8,
        max_window_layers=1, tie_word_embeddings=True))
    save_hf(model, root)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return root, tok.get_vocab_size()


def test_qwen2_fine_tune_from_hf_folder_in_tp2_pp2_and_export(tmp_path: Path) -> None:
    hf, vocab = _hf_folder(tmp_path / "hf")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _conversations()))
    status, out = run_cli(["prepare", "--data.format=sft", f"--data.input={chats}",
                           f"--data.tokenizer={hf}", f"--data.prepared_dir={tmp_path / 'sft'}"])
    assert status == 0, out
    status, out = run_cli([
        "train", "--nproc", "4", "--parallel.tp=2", "--parallel.pp=2", f"--init-from={hf}",
        "--data.format=sft", f"--data.prepared_dir={tmp_path / 'sft'}",
        "--training.seq_len=32", "--training.micro_batch_size=2", "--training.microbatches=2",
        f"--training.steps={STEPS}", "--training.eval_interval=0", "--training.device=cpu",
        "--optim.lr=1e-2", "--optim.warmup_steps=1", "--logging.log_interval=1",
        "--logging.progress=false", f"--logging.dir={tmp_path / 'run'}",
        f"--checkpoint.save={tmp_path / 'ck'}"])
    assert status == 0, out
    assert "initialised the weights from Hugging Face model" in out, out
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert 'arch = "qwen2"' in saved and "sliding_window = 8" in saved, saved
    got = losses(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[STEPS] < got[1] - 1.0, got
    status, out = run_cli(["convert", "--to-hf", str(tmp_path / "ck"), "--out",
                           str(tmp_path / "export")])
    assert status == 0, out
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (exported["use_sliding_window"], exported["sliding_window"],
            exported["max_window_layers"], exported["tie_word_embeddings"]) == (True, 8, 1, True)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    finally:
        hf_logger.removeHandler(handler)
    assert not caught and not logged, [str(w.message) for w in caught] + logged
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    _, ours = load_exported(tmp_path / "ck")
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = float((ours.full_logits(tokens) - model.eval()(tokens).logits).abs().max())
    assert err < 1e-4, f"exported logits differ by {err:.2e}"  # fp32
