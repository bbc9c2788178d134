"""A user's Qwen3-MoE fine-tune through the CLI (issue 36): an HF ``Qwen3MoeForCausalLM``
folder (q/k norms, head_dim 16 != hidden / heads, a sliding window on every layer, a dense
first layer) with a ChatML chat template, SFT chats prepared with that folder's tokenizer,
``train --init-from`` under cp2 (ring, windowed) x ep2 whose loss falls, and
``convert --to-hf`` whose export transformers loads with zero warnings and our logits."""

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
from tests.reliability.jobs import losses
from tests.workflow.cli import run_cli

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' "
          "+ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""Qwen's ChatML template, without the system prompt and thinking blocks."""
STEPS = 10


def _conversations() -> list[list[dict[str, str]]]:
    """Question / answer chats whose answer follows from the question (learnable)."""
    words = ["red", "green", "blue", "cat", "dog", "tree", "sun", "moon"]
    return [[{"role": "user", "content": f"say {a} {b}"},
             {"role": "assistant", "content": f"{a} {b} {a}"}]
            for a in words for b in words]


def _hf_folder(root: Path) -> tuple[Path, int]:
    """A tiny random Qwen3MoeForCausalLM, its tokenizer.json (a BPE with ChatML's special
    tokens) and a tokenizer_config.json with the chat template; (folder, vocabulary)."""
    texts = [" ".join(m["content"] for m in chat) for chat in _conversations()] * 4
    tok = train_bpe_from_texts(texts, 300, None)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
        moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[0], num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=64, use_sliding_window=True, sliding_window=8,
        tie_word_embeddings=False))
    save_hf(model, root)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return root, tok.get_vocab_size()


def test_qwen3_moe_fine_tune_from_hf_folder_in_cp2_ep2_and_export(tmp_path: Path) -> None:
    hf, vocab = _hf_folder(tmp_path / "hf")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _conversations()))
    status, out = run_cli(["prepare", "--data.format=sft", f"--data.input={chats}",
                           f"--data.tokenizer={hf}", f"--data.prepared_dir={tmp_path / 'sft'}"])
    assert status == 0, out
    status, out = run_cli([
        "train", "--nproc", "2", "--parallel.cp=2", "--parallel.ep=2", f"--init-from={hf}",
        "--data.format=sft", f"--data.prepared_dir={tmp_path / 'sft'}",
        "--training.seq_len=32", "--training.micro_batch_size=2", "--training.microbatches=2",
        f"--training.steps={STEPS}", "--training.eval_interval=0", "--training.device=cpu",
        "--optim.lr=1e-2", "--optim.warmup_steps=1", "--logging.log_interval=1",
        "--logging.progress=false", f"--logging.dir={tmp_path / 'run'}",
        f"--checkpoint.save={tmp_path / 'ck'}"])
    assert status == 0, out
    assert "initialised the weights from Hugging Face model" in out, out
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert 'arch = "qwen3"' in saved and "sliding_window = 8" in saved and "head_dim = 16" in saved
    got = losses(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1)) and got[STEPS] < got[1] - 1.0, got
    status, out = run_cli(["convert", "--to-hf", str(tmp_path / "ck"), "--out",
                           str(tmp_path / "export")])
    assert status == 0, out
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (exported["use_sliding_window"], exported["sliding_window"]) == (True, 8)
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
    prompt = tok.apply_chat_template(_conversations()[0][:1], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n"), prompt
    _, ours = load_exported(tmp_path / "ck", dtype=torch.float32)
    ids = torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mine = ours.eval()(ids).transpose(0, 1)[..., :vocab]  # [b, s, V]
        err = float((model.eval()(ids).logits - mine).abs().max())
    assert err < 1e-4, err
