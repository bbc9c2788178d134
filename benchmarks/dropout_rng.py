"""Dropout: the counter-based per-slice draw and blockwise attention, against the old way.

    .venv/bin/python benchmarks/dropout_rng.py [--rounds 5] [--json PATH]

Part 1 (attention, one tp rank's heads, fp32, forward + backward): the old eager path
(every rank draws the full [b, a_total, s, S] fp32 uniform tensor with a torch.Generator and
keeps its heads; scores, probabilities and mask stored) next to the blockwise kernel
(:mod:`colonnade.models.dropout_attention`, masks of its heads only, recomputed in backward)
and fused SDPA without dropout. Reports median time, peak live tensor bytes and the elements
of the largest tensor the draws make.
Part 2 (hidden dropout under sp, [s/tp, b, h] per rank): time of one rank's mask draw, old
(full [s, b, h] torch.rand then slice) against new (its rows only), for tp in 1, 2, 4.
Rounds interleave the variants; medians; ratios against the old path.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from colonnade.analysis.measure import PeakTensorBytes
from colonnade.models.dropout_attention import DropoutSpec, dropout_attention
from colonnade.parallel.rng import RNGTracker

P = 0.1


def old_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int) -> torch.Tensor:
    """The previous code path: full-mask draw on every rank, everything materialised."""
    b, a, s, d = q.shape
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    gen = torch.Generator().manual_seed(1)
    full = torch.rand((b, a * tp, s, s), generator=gen)  # every rank: all heads
    keep = full[:, :a] >= P
    return probs * keep.to(probs.dtype) / (1 - P) @ v


def new_blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int) -> torch.Tensor:
    spec = DropoutSpec(RNGTracker(1), "layers.0.attn.attn_dropout", P, q.shape[1] * tp, 0)
    return dropout_attention(q, k, v, spec)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "old eager + full draw": old_eager, "blockwise (new)": new_blockwise, "sdpa, p=0": sdpa}


def attention_rows(shape: tuple[int, int, int, int], tp: int, rounds: int) -> list[dict[str, Any]]:
    """Part 1 for q [b, a, s, d] (this rank's heads)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=gen).requires_grad_() for _ in range(3))
    times: dict[str, list[float]] = {name: [] for name in ATTENTION}
    for _ in range(rounds):
        for name, fn in ATTENTION.items():
            start = time.perf_counter()
            fn(q, k, v, tp).sum().backward()
            times[name].append(time.perf_counter() - start)
    rows = []
    for name, fn in ATTENTION.items():
        with PeakTensorBytes() as meter:
            fn(q, k, v, tp).sum().backward()
        rows.append({"part": "attention", "variant": name, "shape": list(shape), "tp": tp,
                     "median_s": statistics.median(times[name]), "peak_bytes": meter.peak})
    return rows


def hidden_rows(s: int, b: int, h: int, rounds: int) -> list[dict[str, Any]]:
    """Part 2: one sp rank's [s/tp, b, h] mask, old full draw vs new slice draw."""
    rows = []
    for tp in (1, 2, 4):
        rng, index = RNGTracker(1), (slice(0, s // tp),)
        old, new = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            gen = torch.Generator().manual_seed(1)
            _ = torch.rand((s, b, h), generator=gen)[index] >= P
            old.append(time.perf_counter() - start)
            start = time.perf_counter()
            rng.keep_mask("layers.0.mlp_out", (s, b, h), P, index, torch.device("cpu"))
            new.append(time.perf_counter() - start)
        rows.append({"part": "hidden", "tp": tp, "shape": [s, b, h],
                     "old_s": statistics.median(old), "new_s": statistics.median(new)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" /
                                              "dropout_rng.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for shape, tp in (((1, 8, 512, 64), 1), ((1, 4, 512, 64), 2), ((1, 2, 1024, 64), 4)):
        part = attention_rows(shape, tp, args.rounds)
        base = part[0]
        print(f"attention q {shape} tp{tp} (a_total {shape[1] * tp}):")
        for r in part:
            t, m = r["median_s"] / base["median_s"], r["peak_bytes"] / base["peak_bytes"]
            print(f"  {r['variant']:<22} {r['median_s'] * 1e3:8.1f} ms ({t:.2f}x)  peak "
                  f"{r['peak_bytes'] / 2**20:7.1f} MiB ({m:.2f}x)")
        rows += part
    print("hidden dropout draw, one sp rank of [s, b, h] = [2048, 1, 1024]:")
    for r in hidden_rows(2048, 1, 1024, args.rounds):
        print(f"  tp{r['tp']}: old (full draw) {r['old_s'] * 1e3:6.1f} ms, new (own rows) "
              f"{r['new_s'] * 1e3:6.1f} ms ({r['new_s'] / r['old_s']:.2f}x)")
        rows.append(r)
    Path(args.json).write_text(json.dumps({"rows": rows, "threads": 1}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
