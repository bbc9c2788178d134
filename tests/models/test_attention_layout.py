"""The batch-first residual stream (cp = 1 without sp) against the sequence-first one (float64).

At cp = 1 without sp the whole model runs on [b, s, h] (``ParallelContext.batch_first``:
PyTorch's CPU flash kernel is faster on [b, s, n, d] memory, and no transpose is then needed
anywhere). The maths must not change: for every path (fused SDPA, the blockwise dropout kernel
and hidden dropout, selective recompute, document-reset positions and masks, RoPE with GQA and
learned positions, KV-cache prefill and decoding) the same model forced sequence-first gives
the same loss and gradients, and the same generation logits. The parallel parity suites
compare the two layouts as well: their single-process reference runs batch-first, tp x sp and
cp run sequence-first.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colonnade.models.blocks import DocReset
from colonnade.models.build import build_reference
from colonnade.models.gpt import ModelChunk
from colonnade.tensor_parallel.context import ParallelContext
from tests.models.test_model import tiny

EOD = 7
CASES = {
    "llama": ("llama", []),
    "gpt2": ("gpt2", []),
    "llama-dropout": ("llama", ["--model.attention_dropout=0.2", "--model.hidden_dropout=0.1"]),
    "gpt2-selective": ("gpt2", ["--training.recompute=selective"]),
    "llama-doc-reset": ("llama", []),
}


class SequenceFirstContext(ParallelContext):
    """The same context, forced to the sequence-first layout sp and cp use."""

    @property
    def batch_first(self) -> bool:
        return False


def set_batch_first(model: ModelChunk, on: bool) -> None:
    """Switch the layout of ``model`` (one context object shared by all its modules)."""
    model.ctx.__class__ = ParallelContext if on else SequenceFirstContext
    assert all(layer.attn.batch_first == on and layer.ctx is model.ctx
               for layer in model.layers.values())


def loss_and_grads(model: ModelChunk, tokens: torch.Tensor, labels: torch.Tensor
                   ) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels, reduction="sum")
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_first_equals_sequence_first(case: str) -> None:
    arch, extra = CASES[case]
    model = build_reference(tiny(arch, *extra), torch.float64).train()
    if case == "gpt2-selective":
        for layer in model.layers.values():
            layer.attn.recompute_core = True
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 101, (3, 16), generator=gen)
    labels = torch.randint(0, 101, (3, 16), generator=gen)
    if case == "llama-doc-reset":
        tokens[0, 5] = tokens[2, 9] = EOD
        model.doc_reset = DocReset(EOD)
    assert all(layer.attn.batch_first for layer in model.layers.values())
    model.ctx.rng.set_context(1, 0)
    loss_b, grads_b = loss_and_grads(model, tokens, labels)
    set_batch_first(model, False)
    loss_s, grads_s = loss_and_grads(model, tokens, labels)
    assert abs(loss_b - loss_s) <= 1e-12 * abs(loss_s), (loss_b, loss_s)
    for name, g in grads_s.items():
        err = float((grads_b[name] - g).abs().max())
        assert err < 1e-12, f"{case}: {name} differs by {err:.3e}"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generation_logits_equal(arch: str) -> None:
    """KV-cache prefill then single tokens: the same logits in both layouts (gpt2: learned
    positions offset by the cache length)."""
    model = build_reference(tiny(arch), torch.float64).eval()
    tokens = torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(5))
    out = {}
    for on in (True, False):
        set_batch_first(model, on)
        with torch.no_grad():
            caches = model.new_caches(2, 32)
            out[on] = torch.cat([model.full_logits(tokens[:, lo:hi], caches)
                                 for lo, hi in ((0, 6), (6, 7), (7, 10))], dim=1)
    assert float((out[True] - out[False]).abs().max()) < 1e-12


def test_layout_rule() -> None:
    """Batch-first exactly when cp = 1 and sp is off (sp and cp need the sequence on dim 0)."""
    model = build_reference(tiny("llama"), torch.float64)
    ctx = model.ctx
    assert ctx.batch_first and all(layer.attn.batch_first for layer in model.layers.values())
    assert not dataclasses.replace(ctx, sp=True).batch_first
