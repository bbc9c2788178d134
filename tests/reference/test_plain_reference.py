"""Colonnade's single-process model against a plain ``torch.nn`` decoder (tests/reference/
plain_models.py: no Colonnade layer, loss or RNG code), float64, training mode: the loss
agrees to 1e-12 and every parameter gradient to 1e-10 (relative, in norm), for llama and gpt2,
with and without a loss mask, with label smoothing, with document resets (positions and
attention restarting after EOD, Colonnade's ``DocReset``), and with dropout on. With dropout
the plain model draws its masks through Colonnade's public ``RNGTracker.keep_mask``, the
documented dropout contract (mask element n of site S is a pure function of (seed, S, step,
micro-batch, n)); where and how a mask is applied, its layout and its scaling are the plain
model's own.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colonnade.config.sections import Config, ModelConfig, TrainingConfig
from colonnade.models.blocks import DocReset
from colonnade.models.build import build_reference
from tests.reference.plain_models import (
    PlainLM,
    PlainSpec,
    grads_as_colonnade,
    load_from_colonnade,
)

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
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_((0.2 if p.ndim == 1 else 0.3) * noise)
    return chunk.train()


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


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """||a - b|| / max(||b||, floor) (b the reference)."""
    return ((a - b).norm() / b.norm().clamp(min=max(floor, 1e-300))).item()


def grad_errors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative gradient error per parameter, each against max(||ref||, 1e-4 ||all ref||).

    The floor is for gradients that are zero in exact arithmetic: the key bias (q . b_k is
    the same for every key of a query row, and softmax ignores a constant shift), whose
    computed values are rounding noise (~1e-16) on both sides; a real error there still shows
    (1e-10 of the floor is ~1e-14 absolute).
    """
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    total = torch.stack([g.norm() for g in ref.values()]).norm().item()
    return {n: rel(ours[n], ref[n], 1e-4 * total) for n in ref}


def compare(cfg: ModelConfig, masked: bool, label_smoothing: float = 0.0, docs: bool = False
            ) -> tuple[float, float, float]:
    """(loss, max over parameters of the gradient rel. error, loss rel. error)."""
    ours = colonnade_model(cfg, label_smoothing=label_smoothing)
    if docs:
        ours.doc_reset = DocReset(eod_id=EOD, positions=True, attention=True)
    tokens, labels = batch(masked, docs=docs)
    loss = ours(tokens, labels)
    loss.backward()
    plain = PlainLM(spec_of(cfg, label_smoothing)).double().train()
    load_from_colonnade(plain, dict(ours.named_parameters()))
    rng = ours.ctx.rng

    def keep(site: str, shape: tuple[int, ...], p: float) -> torch.Tensor:
        return rng.keep_mask(site, shape, p, (slice(None),), torch.device("cpu"))

    ref = plain(tokens, labels, keep, EOD if docs else None)
    ref.backward()
    if cfg.bias:  # the key bias gradient is zero in exact arithmetic (see grad_errors)
        for name, p in ours.named_parameters():
            if name.endswith("attn.k.bias"):
                assert p.grad.norm() < 1e-14 * loss.abs().item() * p.numel(), name
    errors = grad_errors({n: p.grad for n, p in ours.named_parameters()},
                         grads_as_colonnade(plain))
    return ref.item(), max(errors.values()), abs(loss.item() - ref.item()) / abs(ref.item())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("masked", [False, True])
def test_loss_and_grads_match_plain_torch(arch: str, masked: bool) -> None:
    loss, grad_err, loss_err = compare(model_config(arch), masked)
    assert 1.0 < loss < 50.0  # randomised weights: far from uniform log V = 4.1
    assert loss_err < 1e-12
    assert grad_err < 1e-10


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_label_smoothing_matches_plain_torch(arch: str) -> None:
    """training.label_smoothing = 0.1 against F.cross_entropy(label_smoothing=0.1), masked."""
    loss, grad_err, loss_err = compare(model_config(arch), masked=True, label_smoothing=0.1)
    assert loss_err < 1e-12
    assert grad_err < 1e-10
    unsmoothed, _, _ = compare(model_config(arch), masked=True)
    assert abs(unsmoothed - loss) > 1e-2


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_document_reset_matches_plain_torch(arch: str) -> None:
    """Positions and attention restart after each EOD (plain: derived row by row)."""
    loss, grad_err, loss_err = compare(model_config(arch), masked=True, docs=True)
    assert loss_err < 1e-12
    assert grad_err < 1e-10
    # the resets matter: the same tokens without them give another loss
    no_reset = colonnade_model(model_config(arch))(*batch(True, docs=True)).item()
    assert abs(no_reset - loss) > 1e-3


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_dropout_matches_plain_torch(arch: str) -> None:
    cfg = model_config(arch, hidden_dropout=0.2, attention_dropout=0.3)
    loss, grad_err, loss_err = compare(cfg, masked=True)
    assert loss_err < 1e-12
    assert grad_err < 1e-10
    # the masks matter: the same model without dropout has a different loss
    plain_loss, _, _ = compare(dataclasses.replace(cfg, hidden_dropout=0.0,
                                                   attention_dropout=0.0), masked=True)
    assert abs(plain_loss - loss) > 1e-3


def test_mapping_is_checked() -> None:
    """The loader refuses a Colonnade parameter it cannot place (a renamed layer fails loudly
    instead of being compared against an untouched init)."""
    cfg = model_config("llama")
    ours = colonnade_model(cfg)
    params = dict(ours.named_parameters())
    params["layers.0.attn.extra.weight"] = params.pop("layers.0.attn.q.weight")
    with pytest.raises(KeyError, match=r"layers\.0\.attn\.extra\.weight"):
        load_from_colonnade(PlainLM(spec_of(cfg)).double(), params)
