"""Ring attention with a sliding window against a plain masked softmax in float64.

Each rank runs ``ring_attention(..., window=W)`` on its zigzag rows of the same full-sequence
q, k, v (GQA, optionally with document ids); the gathered output and gradients equal
softmax(q k^T / sqrt(d) + mask) v on the whole sequence, mask = causal & (i - j < W) (& same
document), to 1e-10. The (query chunk, key chunk) blocks entirely outside the window are not
computed: the ranks' kernel calls add up to ``block_counts``' computed blocks (15 of 64 for
cp 4, s 32, W 5, against 36 without a window), while k / v still travel the whole ring.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

from colonnade.context_parallel import kernels
from colonnade.context_parallel.layout import take_local, zigzag_order
from colonnade.context_parallel.ring import block_counts, ring_attention
from colonnade.parallel.dims import ParallelDims
from tests.parity import TOL, rank_groups, rel_err

B, HEADS, KV, D = 2, 4, 2, 8


def _inputs(s: int, docs: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(77 + s)
    x = {name: torch.randn(B, heads, s, D, generator=gen, dtype=torch.float64)
         for name, heads in (("q", HEADS), ("k", KV), ("v", KV), ("dout", HEADS))}
    if docs:
        x["doc_ids"] = torch.cumsum((torch.randint(0, 5, (B, s), generator=gen) == 0).long(), 1)
    return x


def _masked_softmax(x: dict[str, torch.Tensor], window: int) -> dict[str, torch.Tensor]:
    """The plain reference: explicit scores, -inf outside the window / causality / document."""
    q, k, v = (x[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    s = q.shape[2]
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    allowed = ((j <= i) & (i - j < window)).expand(B, 1, s, s)  # [b, 1, s, s]
    if "doc_ids" in x:
        d = x["doc_ids"]
        allowed = allowed & (d[:, :, None] == d[:, None, :]).unsqueeze(1)
    ke, ve = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    scores = (q @ ke.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, float("-inf"))
    out = scores.softmax(-1) @ ve  # [b, a, s, d]
    out.backward(x["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _rank(cp: int, s: int, window: int, docs: bool) -> dict[str, Any]:
    group = rank_groups(ParallelDims(cp=cp)).cp
    x = _inputs(s, docs)
    q, k, v = (take_local(x[n], cp, group.rank, 2).requires_grad_(True) for n in ("q", "k", "v"))
    calls = [0]
    fwd = kernels.block_forward

    def counted(*a: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        return fwd(*a, **kw)

    with mock.patch.object(kernels, "block_forward", counted):
        out = ring_attention(q, k, v, group, doc_ids=x.get("doc_ids"), window=window)
    out.backward(take_local(x["dout"], cp, group.rank, 2))
    kv_bytes = group.stats.snapshot()["cp/p2p/cp_ring_kv"]["payload_bytes"]
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "calls": calls[0],
            "kv_sent": kv_bytes // (2 * k.numel() * k.element_size())}


@pytest.mark.parametrize(("cp", "window", "docs", "computed"),
                         [(4, 5, False, 15), (2, 3, True, 7)])
def test_windowed_ring_equals_masked_softmax(run_ranks: Callable[..., list[Any]], cp: int,
                                             window: int, docs: bool, computed: int) -> None:
    """cp 4, W 5 (chunks of 4 rows: each query chunk meets its own chunk and the previous
    one, 8 + 7 blocks); cp 2, W 3 with documents (the window cuts even the diagonal blocks)."""
    s = 8 * cp
    results = run_ranks(cp, _rank, cp, s, window, docs)
    inv = zigzag_order(s, cp).argsort()
    ref = _masked_softmax(_inputs(s, docs), window)
    for name, want in ref.items():
        got = torch.cat([r[name] for r in results], dim=2)[:, :, inv]
        err = rel_err(got, want)
        assert err < TOL, f"{name}: rel err {err:.2e}"
    counts = block_counts(cp, s, True, window)
    assert counts["skip"] + computed == 4 * cp * cp
    assert sum(r["calls"] for r in results) == computed == 4 * cp * cp - counts["skip"]
    assert [r["kv_sent"] for r in results] == [cp - 1] * cp  # every k/v block still travels
