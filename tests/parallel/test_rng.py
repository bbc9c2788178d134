"""The counter-based dropout generator (colonnade/parallel/rng.py), on one process.

* bit-exact against a pure-Python SplitMix64 (unsigned 64-bit arithmetic), including element
  indices above 2^32, so int64 wrap-around and the logical shifts are what they claim;
* a slice drawn alone equals the same slice of the full mask (any slices, across draw
  chunks), and only the slice's elements are evaluated;
* statistics on >= 1e5 elements: dropped fraction p within 5 sigma, E[dropout(x)] = x,
  sites / micro-batches / steps / seeds give unrelated masks (agreement p^2 + (1-p)^2);
* dropout keeps a 1-byte bool mask for backward and its gradient is keep / (1 - p).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from colonnade.parallel import rng as rng_mod
from colonnade.parallel.rng import GOLDEN, MASK64, MaskStream, RNGTracker, mix64, stream_key

CPU = torch.device("cpu")


def python_bits(key: int, n: int) -> int:
    """Output n of the SplitMix64 stream seeded with key, in unsigned 64-bit arithmetic."""
    return mix64((key + (n + 1) * GOLDEN) & MASK64)


def test_matches_python_splitmix64() -> None:
    stream = MaskStream(stream_key(1234, "layers.0.attn.attn_dropout", 3, 1), 0.25)
    full = (3, 5, 1 << 31, 7)  # element indices beyond 2^32
    index = (slice(1, 3), slice(0, 5, 2), slice((1 << 31) - 3, None), slice(2, 6))
    ranges = rng_mod._ranges(full, index)
    bits = rng_mod.mix64_(stream.counters(full, ranges, CPU))
    strides = [math.prod(full[i + 1:]) for i in range(4)]
    got = bits.flatten().tolist()
    want = [python_bits(stream.key, sum(c * s for c, s in zip(cs, strides, strict=True)))
            for cs in _product(ranges)]
    assert [g & MASK64 for g in got] == want
    threshold = round(0.25 * 2.0**64)
    keep = stream.keep(full, index, CPU).flatten().tolist()
    assert keep == [w >= threshold for w in want]


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*prefix, c) for prefix in out for c in r]
    return out


def test_key_mixes_every_input() -> None:
    base = stream_key(1, "a", 2, 3)
    others = {stream_key(2, "a", 2, 3), stream_key(1, "b", 2, 3), stream_key(1, "a", 3, 3),
              stream_key(1, "a", 2, 4), stream_key(1, "a", 3, 2)}
    assert base not in others and len(others) == 5


@pytest.mark.parametrize("chunk", [1 << 22, 64, 7, 1])
def test_slice_equals_slice_of_full(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """Any slice drawn alone (also in draw chunks of 64, 7, 1 elements) is that slice of the
    full mask."""
    monkeypatch.setattr(rng_mod, "DRAW_CHUNK", {"cpu": chunk, "other": chunk})
    tracker = RNGTracker(seed=5)
    tracker.set_context(2, 3)
    full_shape = (4, 6, 10)
    full = tracker.keep_mask("site", full_shape, 0.4, (), CPU)
    assert full.dtype == torch.bool and full.shape == full_shape
    for index in [(slice(1, 3),), (slice(None), slice(2, 6)), (slice(0, 4, 2), slice(5, 6),
                                                                slice(3, 10, 3))]:
        assert torch.equal(tracker.keep_mask("site", full_shape, 0.4, index, CPU), full[index])


def test_only_the_slice_is_evaluated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice's draw evaluates exactly its elements (a quarter of the full mask here)."""
    evaluated: list[int] = []
    mix = rng_mod.mix64_

    def counting(z: torch.Tensor) -> torch.Tensor:
        evaluated.append(z.numel())
        return mix(z)

    monkeypatch.setattr(rng_mod, "mix64_", counting)
    tracker = RNGTracker(seed=1)
    tracker.keep_mask("s", (2, 8, 16, 16), 0.1, (slice(None), slice(2, 4)), CPU)
    assert evaluated == [2 * 2 * 16 * 16]


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_dropped_fraction_and_expectation(p: float) -> None:
    n = 200_000
    tracker = RNGTracker(seed=9)
    keep = tracker.keep_mask("layers.1.mlp_out", (n,), p, (), CPU)
    dropped = 1.0 - float(keep.double().mean())
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped - p) < 5 * sigma, f"p={p}: dropped {dropped:.5f}"
    x = torch.full((n,), 3.0, dtype=torch.float64)
    mean = float(tracker.dropout(x, p, "layers.1.mlp_out", (n,), ()).mean())
    assert abs(mean - 3.0) < 5 * 3.0 * sigma / (1 - p), f"p={p}: E[dropout(3)] = {mean}"
    first, second = keep[: n // 2].double().mean(), keep[n // 2:].double().mean()
    assert abs(float(first - second)) < 10 * sigma  # no drift along the element index


@pytest.mark.parametrize("change", ["site", "microbatch", "step", "seed"])
def test_contexts_give_unrelated_masks(change: str) -> None:
    """Two masks of p = 0.5 agree on half their 1e5 elements (not identical, not inverted)."""
    n, p = 100_000, 0.5
    a = RNGTracker(seed=3, step=4, microbatch=1)
    b = RNGTracker(seed=4 if change == "seed" else 3, step=5 if change == "step" else 4,
                   microbatch=2 if change == "microbatch" else 1)
    site_b = "layers.0.attn_out" if change == "site" else "layers.0.mlp_out"
    agree = float((a.keep_mask("layers.0.mlp_out", (n,), p, (), CPU)
                   == b.keep_mask(site_b, (n,), p, (), CPU)).double().mean())
    assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / n), f"{change}: agreement {agree:.4f}"


def test_dropout_saves_a_bool_mask_and_scales_the_gradient() -> None:
    saved: list[Any] = []
    x = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    tracker, p = RNGTracker(seed=2), 0.3
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t,
                                                  lambda t: t):
        y = tracker.dropout(x, p, "s", (64, 8), ())
    assert saved == [torch.bool]
    y.sum().backward()
    keep = tracker.keep_mask("s", (64, 8), p, (), CPU)
    assert x.grad is not None
    assert torch.equal(x.grad, keep.double() * (1 / (1 - p)))
    assert torch.equal(y, x.detach() * keep * (1 / (1 - p)))
    assert tracker.dropout(x, 0.0, "s", (64, 8), ()) is x
