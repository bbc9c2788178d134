"""A user's Llama 3 fine-tune through the CLI (issue 36): an HF Llama-3-style folder (llama3
rope scaling, a Llama 3 chat template), SFT chat data prepared with that folder's tokenizer,
`train --init-from` in tp2 x pp2 (4 ranks) whose loss falls, and `convert --to-hf` whose
export transformers loads with zero warnings and the rope settings it was given."""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import torch
import transformers

from colonnade.data.tokenizer import train_bpe_from_texts
from tests.families.harness import save_hf
from tests.reliability.jobs import losses
from tests.workflow.cli import run_cli

LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
"""Llama 3's chat template (its header and end-of-turn tokens), without the date preamble."""
ROPE = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
"""Llama 3.1's rope scaling at a tiny original context (the model's is 64)."""
STEPS = 8


def _conversations() -> list[list[dict[str, str]]]:
    """Question / answer chats whose answer follows from the question (learnable)."""
    words = ["red", "green", "blue", "cat", "dog", "tree", "sun", "moon"]
    return [[{"role": "user", "content": f"say {a} {b}"},
             {"role": "assistant", "content": f"{a} {b} {a}"}]
            for a in words for b in words]


def _hf_folder(root: Path) -> Path:
    """A tiny random LlamaForCausalLM with llama3 rope, its tokenizer.json (a BPE with Llama 3's
    special tokens) and a tokenizer_config.json holding the chat template."""
    texts = [" ".join(m["content"] for m in chat) for chat in _conversations()] * 4
    tok = train_bpe_from_texts(texts, 300, None)
    tok.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rope_parameters=ROPE, tie_word_embeddings=False))
    save_hf(model, root)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": LLAMA3_TEMPLATE, "eos_token": "<|eot_id|>"}))
    return root


def test_llama3_fine_tune_from_hf_folder_in_tp2_pp2_and_export(tmp_path: Path) -> None:
    hf = _hf_folder(tmp_path / "hf")
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
    assert 'rope_scaling = "llama3"' in saved and "rope_original_max_seq_len = 16" in saved
    got = losses(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[STEPS] < got[1] - 1.0, got
    status, out = run_cli(["convert", "--to-hf", str(tmp_path / "ck"), "--out",
                           str(tmp_path / "export")])
    assert status == 0, out
    shutil.rmtree(tmp_path / "ck")  # the export stands on its own
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["rope_parameters"] == ROPE
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
    assert type(model).__name__ == "LlamaForCausalLM"
    prompt = tok.apply_chat_template(_conversations()[0][:1], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
