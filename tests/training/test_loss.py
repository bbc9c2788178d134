"""The loss over real batches: the token-weighted mean over the valid tokens of the global batch.

Checked against a hand computation (cross entropy of a 3-token vocabulary) and against plain
PyTorch: ``F.cross_entropy(logits, labels, ignore_index=-100, reduction='sum') / valid tokens``
over the whole global batch, loss and gradients, with and without label smoothing. The old
convention (mean of per-micro-batch means) fails these: the micro-batches hold 0 to 32 valid
tokens.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from colonnade.config.load import ConfigError
from colonnade.config.sections import Config, ModelConfig, TrainingConfig
from colonnade.config.validate import resolve, validate
from colonnade.models.build import build_reference
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.plan import StepPlan
from colonnade.reliability.interrupt import agreed_signal, signal_votes
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from colonnade.training.step import forward_backward, forward_only, mean_loss, start_mean_loss

VOCAB, SEQ, MICRO = 64, 16, 2


def _config(arch: str, smoothing: float = 0.0) -> Config:
    model = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4, vocab_size=VOCAB,
                        max_seq_len=SEQ, tie_embeddings=arch == "gpt2", bias=arch == "gpt2")
    tr = TrainingConfig(steps=1, seq_len=SEQ, micro_batch_size=MICRO, microbatches=4,
                        precision="fp64", eval_interval=0, label_smoothing=smoothing)
    return validate(resolve(Config(model=model, training=tr), 1), 1)


def _masked_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """4 micro-batches with 0, 5, 20 and 32 valid labels."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for valid in (0, 5, 20, 32):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=gen)
        labels = ids[:, 1:].clone().reshape(-1)
        keep = torch.randperm(MICRO * SEQ, generator=gen)[:valid]
        mask = torch.ones_like(labels, dtype=torch.bool)
        mask[keep] = False
        labels[mask] = IGNORE_INDEX
        out.append((ids[:, :-1].contiguous(), labels.reshape(MICRO, SEQ)))
    return out


def test_cross_entropy_mask_matches_hand_computation() -> None:
    """Per-token loss log(sum exp z) - z_y; 0 loss and 0 gradient where the label is -100;
    label smoothing (eps = 0.3) mixes in the mean of -log p over the vocabulary."""
    z = torch.tensor([[[1.0, 2.0, 0.5]], [[0.0, -1.0, 3.0]], [[2.0, 2.0, 2.0]]],
                     dtype=torch.float64, requires_grad=True)  # [s=3, b=1, V=3]
    targets = torch.tensor([[1], [IGNORE_INDEX], [0]])  # [s, b]
    group = ProcessGroups.single().tp
    loss = vocab_parallel_cross_entropy(z, targets, group, 3)
    lse0 = math.log(math.exp(1.0) + math.exp(2.0) + math.exp(0.5))
    assert loss[0, 0].item() == pytest.approx(lse0 - 2.0, rel=1e-14)
    assert loss[1, 0].item() == 0.0
    assert loss[2, 0].item() == pytest.approx(math.log(3.0), rel=1e-14)
    (loss.sum() / 2).backward()  # 2 valid tokens
    assert z.grad is not None
    assert torch.equal(z.grad[1], torch.zeros(1, 3, dtype=torch.float64))
    p0 = [math.exp(v - lse0) for v in (1.0, 2.0, 0.5)]
    want = [(p0[0]) / 2, (p0[1] - 1) / 2, p0[2] / 2]
    assert z.grad[0, 0].tolist() == pytest.approx(want, rel=1e-13)
    assert z.grad[2, 0].tolist() == pytest.approx([(1 / 3 - 1) / 2, 1 / 6, 1 / 6], rel=1e-13)
    eps = 0.3
    smooth = vocab_parallel_cross_entropy(z.detach(), targets, group, 3, eps)
    mean_neg_logp = lse0 - (1.0 + 2.0 + 0.5) / 3
    assert smooth[0, 0].item() == pytest.approx((1 - eps) * (lse0 - 2.0) + eps * mean_neg_logp,
                                                rel=1e-14)
    assert smooth[1, 0].item() == 0.0


@pytest.mark.parametrize(("arch", "smoothing"), [("llama", 0.0), ("gpt2", 0.0), ("gpt2", 0.1)])
def test_step_loss_equals_torch_token_mean(arch: str, smoothing: float) -> None:
    """The step's loss and gradients equal plain torch's sum-over-valid / count over the
    global batch, not the mean of the 4 micro-batch means."""
    cfg = _config(arch, smoothing)  # training.label_smoothing reaches the model's loss
    batches = _masked_batches()
    model = build_reference(cfg, torch.float64)
    groups = ProcessGroups.single()
    losses = forward_backward([model], batches, StepPlan(groups, 0))
    got_loss = mean_loss(losses, groups, torch.device("cpu"), batches)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(t).transpose(0, 1).reshape(-1, VOCAB) for t, _ in batches])
    labels = torch.cat([lab.reshape(-1) for _, lab in batches])
    count = int((labels != IGNORE_INDEX).sum())
    assert count == 57
    want_loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum",
                                label_smoothing=smoothing) / count
    want_loss.backward()
    assert got_loss == pytest.approx(want_loss.item(), rel=1e-12)
    means = [v for v in losses if v != 0.0]
    assert abs(sum(means) / 4 - want_loss.item()) > 1e-3  # the old mean of means differs
    for name, p in model.named_parameters():
        assert p.grad is not None
        # floor: a key bias's gradient is mathematically 0 (softmax is shift invariant)
        err = float((got[name] - p.grad).norm() / p.grad.norm().clamp_min(1e-6))
        assert err < 1e-12, f"{name}: rel err {err:.2e}"
    ev = forward_only([model], batches, StepPlan(groups, 0))
    assert mean_loss(ev, groups, torch.device("cpu"), batches) == pytest.approx(
        want_loss.item(), rel=1e-12)  # evaluation: the same token-weighted mean


def test_label_smoothing_out_of_range_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"training.label_smoothing=1.5 must be in \[0, 1\)"):
        _config("llama", 1.5)


def test_fully_masked_global_batch_trains_nothing() -> None:
    """No valid label anywhere: loss 0 (not NaN, which would stop the run), zero gradients."""
    cfg = _config("llama")
    model = build_reference(cfg, torch.float64)
    tokens = _masked_batches()[0][0]
    batches = [(tokens, torch.full_like(tokens, IGNORE_INDEX))] * 2
    groups = ProcessGroups.single()
    losses = forward_backward([model], batches, StepPlan(groups, 0))
    assert losses == [0.0, 0.0]
    assert mean_loss(losses, groups, torch.device("cpu"), batches) == 0.0
    assert all(float(p.grad.abs().max()) == 0.0 for p in model.parameters()
               if p.grad is not None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_give_an_fp32_loss(dtype: torch.dtype) -> None:
    """bf16/fp16 logits: the per-token loss (and so every sum of it) is fp32, equal to the fp32
    computation on the same rounded logits; the gradient comes back in the logits' dtype."""
    gen = torch.Generator().manual_seed(5)
    z = (3 * torch.randn(SEQ, MICRO, VOCAB, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(VOCAB, (SEQ, MICRO), generator=gen)
    group = ProcessGroups.single().tp
    loss = vocab_parallel_cross_entropy(z, targets, group, VOCAB)
    assert loss.dtype == torch.float32
    want = F.cross_entropy(z.detach().float().reshape(-1, VOCAB), targets.reshape(-1),
                           reduction="none").reshape(SEQ, MICRO)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    loss.sum().backward()
    assert z.grad is not None and z.grad.dtype == dtype


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_bf16_model_returns_fp32_loss(reduction: str) -> None:
    """Issue 20 item 3: a bf16 model's loss (sum and mean over tokens) is fp32, equal to the
    fp32 cross entropy of its own bf16 logits; the logits' gradient stays bf16."""
    model = build_reference(_config("llama"), dtype=torch.bfloat16)
    tokens, labels = _masked_batches()[3]
    loss = model(tokens, labels, reduction=reduction, tokens=tokens)
    assert loss.dtype == torch.float32
    logits = model(tokens, tokens=tokens).detach().float()  # [s, b, V]
    want = F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_signal_votes_read_back_as_the_largest_signal() -> None:
    """Summed vote vectors give the MAX of the ranks' stop signals (0 when none voted); a
    signal that is not a stop signal is refused."""
    def agree(*signals: int) -> int:
        return agreed_signal([sum(v) for v in zip(*map(signal_votes, signals), strict=True)])

    assert agree(0, 0) == 0
    assert agree(0, int(signal.SIGINT)) == int(signal.SIGINT)
    assert agree(int(signal.SIGINT), int(signal.SIGTERM), 0) == int(signal.SIGTERM)
    with pytest.raises(ValueError, match="stop signal"):
        signal_votes(int(signal.SIGHUP))


def _loss_and_signal(signals: list[int]) -> tuple[float, int]:
    rank = dist.get_rank()
    groups = ProcessGroups.build(ParallelDims(dp=2))
    batches = [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))]
    losses = [float(rank + 1)]  # rank r: mean r + 1 over 4 valid tokens
    return start_mean_loss(losses, groups, torch.device("cpu"), batches, signals[rank])()


def test_step_loss_reduction_carries_the_stop_signal_agreement(
        run_ranks: Callable[..., list[Any]]) -> None:
    """Two ranks: the loss all-reduce gives the token mean (1 + 2) / 2 and the larger of the
    ranks' signals to both, with no collective of its own."""
    sig = int(signal.SIGTERM)
    assert run_ranks(2, _loss_and_signal, [0, sig]) == [(1.5, sig), (1.5, sig)]
    assert run_ranks(2, _loss_and_signal, [0, 0]) == [(1.5, 0), (1.5, 0)]
