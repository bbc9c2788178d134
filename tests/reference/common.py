"""Shared pieces of the independent-reference tests: tiny configs, Colonnade's randomised
float64 model, batches (loss mask, documents) and the per-parameter gradient errors (the
relative error itself is tests/parity.py's)."""

from __future__ import annotations

import torch

from colonnade.config.sections import Config, ModelConfig, TrainingConfig
from colonnade.models.build import build_reference
from tests.parity import rel_err
from tests.reference.plain_models import PlainSpec

BATCH, SEQ, VOCAB = 2, 16, 61
EOD = 0
"""End-of-document id in the document-reset cases (drawn nowhere else in those batches)."""


def model_config(arch: str, **over: object) -> ModelConfig:
    """Tiny llama (GQA 4/2, untied, no bias) or gpt2 (biases, tied head)."""
    llama = arch == "llama"
    base = dict(arch=arch, num_layers=2, hidden_size=32, num_heads=4,
                num_kv_heads=2 if llama else None, ffn_hidden_size=48 if llama else None,
                vocab_size=VOCAB, max_seq_len=32, rope_theta=500.0, norm_eps=1e-5,
                tie_embeddings=not llama, bias=not llama)
    return ModelConfig(**{**base, **over})  # type: ignore[arg-type]


def spec_of(cfg: ModelConfig, label_smoothing: float = 0.0) -> PlainSpec:
    """The plain model's shape, read field by field from the Colonnade config."""
    return PlainSpec(arch=cfg.arch, vocab=cfg.vocab_size, hidden=cfg.hidden_size,
                     layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.kv_heads,
                     ffn=cfg.ffn_size, max_seq=cfg.max_seq_len, theta=cfg.rope_theta,
                     eps=cfg.norm_eps, tie=cfg.tie_embeddings, bias=cfg.bias,
                     hidden_dropout=cfg.hidden_dropout,
                     attention_dropout=cfg.attention_dropout, label_smoothing=label_smoothing)


def colonnade_model(cfg: ModelConfig, seed: int = 0, label_smoothing: float = 0.0
                    ) -> torch.nn.Module:
    """Colonnade's float64 single-process model in train mode, every weight randomised far
    from its init (norm weights 1 + N(0, 0.2), biases N(0, 0.2), matrices N(0, 0.3)) so norms,
    biases and every head matter to the loss."""
    training = TrainingConfig(precision="fp64", seed=seed + 7, label_smoothing=label_smoothing)
    chunk = build_reference(Config(model=cfg, training=training))
    randomise(chunk, seed)
    return chunk.train()


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights 1 + N(0, 0.2), other vectors (biases) N(0, 0.2), matrices N(0, 0.3), drawn
    in parameter order from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_((0.2 if p.ndim == 1 else 0.3) * noise)


def batch(masked: bool, seed: int = 1, docs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, labels [b, s]; ``masked``: a prompt prefix and a tail of labels set to -100;
    ``docs``: EOD tokens at 4 and 10 in row 0, at 7 in row 1 (and nowhere else)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(EOD + 1 if docs else 0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    if docs:
        ids[0, 4] = ids[0, 10] = ids[1, 7] = EOD
    tokens, labels = ids[:, :-1].clone(), ids[:, 1:].clone()
    if masked:
        labels[0, :5] = -100
        labels[1, 3:7] = -100
        labels[1, -2:] = -100
    return tokens, labels


def grad_errors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative gradient error per parameter, each against max(||ref||, 1e-4 ||all ref||).

    The floor is for gradients that are zero in exact arithmetic: gpt2's key bias (without
    RoPE, q . b_k is the same for every key of a query row, and softmax ignores a constant
    shift; llama's rotates b_k by position, so its gradient is not zero), whose
    computed values are rounding noise (~1e-16) on both sides; a real error there still shows
    (1e-10 of the floor is ~1e-14 absolute).
    """
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    total = torch.stack([g.norm() for g in ref.values()]).norm().item()
    return {n: rel_err(ours[n], ref[n], 1e-4 * total) for n in ref}
