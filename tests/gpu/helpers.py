"""Small builders shared by the gpu-marked tests and the CPU tests of the same paths."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from colonnade.checkpoint.convert import write_model_checkpoint
from colonnade.checkpoint.export import full_state
from colonnade.config.sections import Config, ModelConfig
from colonnade.data.tokenizer import train_bpe_from_texts
from colonnade.models.build import build_reference
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.setup import Runtime

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


SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
}
"""The aten op each SDPA backend dispatches to, by backend name."""
FUSED_SDPA = ("flash", "efficient", "cudnn")
"""Fused (O(s) memory) SDPA backends; "math" materialises the [b, a, s, s] scores."""


def sdpa_backends(fn: Callable[[], object]) -> list[str]:
    """The SDPA backends (:data:`SDPA_OPS` names) that running ``fn`` dispatched to, sorted.

    Read from the profiler's record of aten ops (the CPU side of the dispatch, so it works for
    CUDA tensors and on a CPU alike)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({SDPA_OPS[e.key] for e in prof.key_averages() if e.key in SDPA_OPS})


def trainer_on(device: torch.device, precision: str) -> Any:
    """A single-process Trainer of the checkpoint tests' tiny Llama (4 layers, hidden 32,
    seq 8, global batch 8) on ``device``; the same seed gives the same initial weights."""
    from colonnade.training.loop import Trainer
    from tests.checkpoint.harness import Layout, make_config

    cfg = make_config(Layout(), precision)
    return Trainer(Runtime(cfg, device, ProcessGroups.build(ParallelDims())), None)


def train_on_device(trainer: Any, count: int) -> list[float]:
    """``count`` steps on the checkpoint tests' synthetic batches, moved to the trainer's
    device; returns the losses."""
    from tests.checkpoint.harness import batches_for

    device = trainer.rt.device
    out = []
    for _ in range(count):
        batches = [(x.to(device), y.to(device)) for x, y in batches_for(trainer.step, 0, 1)]
        out.append(trainer.train_step(batches)["loss"])
    return out
