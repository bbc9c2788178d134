"""Small builders shared by the gpu-marked tests and the CPU tests of the same paths."""

from __future__ import annotations

from pathlib import Path

from colonnade.checkpoint.convert import write_model_checkpoint
from colonnade.checkpoint.export import full_state
from colonnade.config.sections import Config, ModelConfig
from colonnade.data.tokenizer import train_bpe_from_texts
from colonnade.models.build import build_reference
from colonnade.parallel.groups import ProcessGroups

TEXTS = ["def foo(x):\n    return x + 1\n" * 3, "class Bar:\n    pass\n" * 4,
         "hello world, hello there " * 5, "import os\nprint(os.getcwd())\n" * 3]
"""A few lines of text for a 300-token BPE tokenizer."""


def tiny_checkpoint(root: Path, arch: str = "llama") -> Path:
    """A committed weights-only Colonnade checkpoint (2 layers, hidden 32, seq 32) of a random
    model with a large init (non-trivial greedy paths) and its BPE tokenizer.json; returns it."""
    tok = train_bpe_from_texts(TEXTS, 300, root / "tok" / "tokenizer.json")
    gpt2 = arch == "gpt2"
    model_cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4,
                            num_kv_heads=None if gpt2 else 2, max_seq_len=32,
                            vocab_size=tok.get_vocab_size(), tie_embeddings=gpt2, bias=gpt2,
                            init_std=0.3)
    config = Config(model=model_cfg)
    model = build_reference(config)
    write_model_checkpoint(root / "ck", config, full_state([model], ProcessGroups.single()),
                           root / "tok")
    return root / "ck"
