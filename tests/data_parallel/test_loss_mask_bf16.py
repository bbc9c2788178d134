"""The token-weighted loss with masked labels in bf16 (fp32 gradients) tracks fp32.

The looser companion of the float64 masked parity (tests/pipeline/test_parity.py): dp=2 with
ZeRO-1, 2 micro-batches per rank keeping 25%, 50%, 75% and 100% of their labels, 30 steps on
one fixed global batch. Same tolerance argument as test_mixed_precision.py (bf16 rounding of
O(1) logits, ~1e-2 absolute, no drift thanks to fp32 masters): every micro-batch loss within
0.05 and the step losses (token-weighted over the global batch) within 0.03, while the fp32
step loss falls by more than 1.0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from colonnade.config.sections import Config
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX
from tests.data_parallel.common import make_batches, rank_train, tiny_config


def _masked(config: Config) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(9)
    step = make_batches(config)[0]
    keep = [torch.rand(t.shape, generator=gen) < (j + 1) / len(step) for j, (t, _) in
            enumerate(step)]
    step = [(t, lab.masked_fill(~k, IGNORE_INDEX)) for (t, lab), k in zip(step, keep,
                                                                         strict=True)]
    return [step] * config.training.steps


def _both(bf16: Config, fp32: Config, batches: list[Any]) -> dict[str, Any]:
    return {"bf16": rank_train(bf16, batches)["losses"], "fp32": rank_train(fp32, batches)[
        "losses"]}


def _step_losses(results: list[dict[str, Any]], key: str, batches: list[Any]) -> list[float]:
    """Token-weighted step loss from every rank's per-micro-batch means (rank r: [2r, 2r+2))."""
    counts = [int((lab != IGNORE_INDEX).sum()) for _, lab in batches[0]]
    out = []
    for s in range(len(batches)):
        total = sum(v * counts[2 * r + k] for r, res in enumerate(results)
                    for k, v in enumerate(res[key][s]))
        out.append(total / sum(counts))
    return out


def test_masked_bf16_tracks_fp32(run_ranks: Callable[..., list[Any]]) -> None:
    kw: dict[str, Any] = dict(dp=2, zero=True, steps=30, microbatches=2, clip=1.0, lr=3e-3)
    bf16, fp32 = tiny_config(precision="bf16", **kw), tiny_config(precision="fp32", **kw)
    batches = _masked(fp32)
    results = run_ranks(2, _both, bf16, fp32, batches)  # rank order = dp rank order
    for res in results:
        for low, high in zip(res["bf16"], res["fp32"], strict=True):
            assert max(abs(a - b) for a, b in zip(low, high, strict=True)) <= 0.05
    low, high = _step_losses(results, "bf16", batches), _step_losses(results, "fp32", batches)
    assert high[0] - high[-1] > 1.0, f"fp32 loss barely moved: {high[0]:.3f} -> {high[-1]:.3f}"
    assert max(abs(a - b) for a, b in zip(low, high, strict=True)) <= 0.03
