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

from colonnade.config.sections import ModelConfig
from colonnade.models.blocks import DocReset
from tests.reference.common import (
    EOD,
    batch,
    colonnade_model,
    grad_errors,
    model_config,
    spec_of,
)
from tests.reference.plain_models import PlainLM, grads_as_colonnade, load_from_colonnade


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
    if cfg.bias and cfg.arch == "gpt2":  # key bias gradient: zero (see grad_errors)
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


@pytest.mark.parametrize(("arch", "over"), [
    ("llama", {"num_kv_heads": 1}),  # multi-query
    ("llama", {"num_kv_heads": 4}),  # plain multi-head
    ("llama", {"tie_embeddings": True, "bias": True}),
    ("gpt2", {"tie_embeddings": False}),
    ("gpt2", {"num_layers": 3, "hidden_size": 48, "num_heads": 3}),  # head dim 16, odd heads
])
def test_variants_match_plain_torch(arch: str, over: dict[str, object]) -> None:
    _, grad_err, loss_err = compare(model_config(arch, **over), masked=True)
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
