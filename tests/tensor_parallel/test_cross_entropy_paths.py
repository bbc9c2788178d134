"""The two paths of :func:`~colonnade.tensor_parallel.cross_entropy.cross_entropy` agree.

At tp = 1 with an unpadded vocabulary the loss is PyTorch's ``F.cross_entropy``; the
vocab-parallel autograd function is the other path. Float64: per-token loss and logit gradient
equal to 1e-15 relative, with ignored labels (-100) and with label smoothing; bf16 logits give
an fp32 loss and bf16 gradients on both paths; a padded vocabulary (V' > V) or tp > 1 takes the
vocab-parallel path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel import cross_entropy as ce

S, B, V = 12, 3, 50


def logits_and_targets(dtype: torch.dtype, width: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [s, b, width] (scale 3) and targets [s, b] with 7 labels set to IGNORE_INDEX."""
    gen = torch.Generator().manual_seed(11)
    z = (3 * torch.randn(S, B, width, generator=gen, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, V, (S, B), generator=gen)
    targets.view(-1)[torch.randperm(S * B, generator=gen)[:7]] = ce.IGNORE_INDEX
    return z, targets


def loss_and_grad(fn: Any, z: torch.Tensor, targets: torch.Tensor, smoothing: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    z = z.clone().requires_grad_()
    loss = fn(z, targets, ProcessGroups.single().tp, V, smoothing)  # [s, b]
    weights = torch.linspace(0.5, 2.0, S * B, dtype=loss.dtype).view(S, B)
    (loss * weights).sum().backward()
    assert z.grad is not None
    return loss.detach(), z.grad


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_torch_path_equals_vocab_parallel_path_float64(smoothing: float) -> None:
    z, targets = logits_and_targets(torch.float64)
    loss, grad = loss_and_grad(ce.cross_entropy, z, targets, smoothing)
    ref_loss, ref_grad = loss_and_grad(ce.vocab_parallel_cross_entropy, z, targets, smoothing)
    ignored = targets == ce.IGNORE_INDEX
    assert torch.equal(loss[ignored], torch.zeros(7, dtype=torch.float64))
    assert torch.equal(grad[ignored], torch.zeros(7, V, dtype=torch.float64))
    assert loss.sum().item() > 10.0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-15, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-14, atol=1e-15)


def test_half_logits_give_fp32_loss_and_half_gradients() -> None:
    z, targets = logits_and_targets(torch.bfloat16)
    loss, grad = loss_and_grad(ce.cross_entropy, z, targets, 0.0)
    ref_loss, ref_grad = loss_and_grad(ce.vocab_parallel_cross_entropy, z, targets, 0.0)
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert grad.dtype == ref_grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=0.0, atol=2 ** -8)


def test_padded_vocabulary_takes_the_vocab_parallel_path(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Logits wider than the vocabulary (padding) go through the vocab-parallel function,
    which masks the padded columns; an unpadded width does not."""
    calls: list[int] = []
    original = ce.VocabParallelCrossEntropy.apply

    def spy(*args: Any) -> Any:
        calls.append(args[0].shape[-1])
        return original(*args)

    monkeypatch.setattr(ce.VocabParallelCrossEntropy, "apply", spy)
    z, targets = logits_and_targets(torch.float64, width=V + 2)
    padded, _ = loss_and_grad(ce.cross_entropy, z, targets, 0.0)
    unpadded, _ = loss_and_grad(ce.cross_entropy, z[..., :V], targets, 0.0)
    assert calls == [V + 2]
    torch.testing.assert_close(padded, unpadded, rtol=1e-15, atol=1e-14)
