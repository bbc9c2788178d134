"""Hierarchical cp attention on its own, float64: cp 4 = all-to-all 2 x ring 2 with a sliding
window, document ids, attention sinks and GQA against a plain masked softmax over the whole
sequence, and with attention dropout too against the single-process dropout kernel
(:func:`colonnade.models.dropout_attention.dropout_attention`: the same keep-mask per
(query, key) position) (output and the gradients of q, k, v and the sinks, 1e-10); and the
group partitions that :mod:`colonnade.parallel.groups` makes for it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.context_parallel.block_dropout import BlockDropout
from colonnade.context_parallel.hierarchical import hierarchical_attention
from colonnade.context_parallel.layout import take_local, zigzag_order
from colonnade.context_parallel.ring import ring_attention
from colonnade.models.dropout_attention import DropoutSpec, dropout_attention
from colonnade.parallel.comm import CommGroup
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import plan_groups
from colonnade.parallel.rng import RNGTracker
from tests.parity import TOL, rank_groups, rel_err

B, HEADS, KV, D, S, W = 1, 4, 2, 8, 32, 7
SITE = "layers.0.attn.attn_dropout"


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(41)
    x = {name: torch.randn(B, heads, S, D, generator=gen, dtype=torch.float64)
         for name, heads in (("q", HEADS), ("k", KV), ("v", KV), ("dout", HEADS))}
    x["sinks"] = torch.randn(HEADS, generator=gen, dtype=torch.float64)
    x["doc_ids"] = torch.cumsum((torch.randint(0, 6, (B, S), generator=gen) == 0).long(), 1)
    return x


def _reference(x: dict[str, torch.Tensor], p: float) -> dict[str, torch.Tensor]:
    """softmax over [scores | sink logit] with causal, window and document masks (p = 0),
    or the single-process dropout kernel with the same masks and sinks."""
    q, k, v, sinks = (x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "sinks"))
    i, j = torch.arange(S).unsqueeze(1), torch.arange(S).unsqueeze(0)
    d = x["doc_ids"]
    allowed = ((j <= i) & (i - j < W)) & (d[:, :, None] == d[:, None, :])  # [b, s, s]
    if p > 0:
        spec = DropoutSpec(RNGTracker(5), SITE, p, HEADS, 0)
        out = dropout_attention(q, k, v, spec, allowed[:, None], sinks=sinks)
    else:
        ke, ve = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
        scores = (q @ ke.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed[:, None],
                                                                        float("-inf"))
        sink = sinks.view(1, HEADS, 1, 1).expand(B, HEADS, S, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :S]  # [b, a, s, s]
        out = probs @ ve
    out.backward(x["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dsinks": sinks.grad}


def _rank(a2a_size: int, p: float) -> dict[str, Any]:
    groups = rank_groups(ParallelDims(cp=4), a2a_size)
    cp = groups.cp
    x = _inputs()
    q, k, v = (take_local(x[n], 4, cp.rank, 2).requires_grad_(True) for n in ("q", "k", "v"))
    sinks = x["sinks"].clone().requires_grad_(True)

    def ring(qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, head_offset: int,
             group: CommGroup) -> torch.Tensor:
        drop = BlockDropout(RNGTracker(5).stream(SITE, p), HEADS, head_offset, S) if p else None
        return ring_attention(qr, kr, vr, group, doc_ids=x["doc_ids"], window=W,
                              sinks=sinks[head_offset:head_offset + qr.shape[1]], dropout=drop)

    assert groups.cp_a2a is not None and groups.cp_ring is not None
    out = hierarchical_attention(q, k, v, groups.cp_a2a, groups.cp_ring, ring)
    out.backward(take_local(x["dout"], 4, cp.rank, 2))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dsinks": sinks.grad, "a2a": groups.cp_a2a.ranks, "ring": groups.cp_ring.ranks}


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_hierarchical_window_docs_sinks_gqa(run_ranks: Callable[..., list[Any]],
                                            p: float) -> None:
    results = run_ranks(4, _rank, 2, p)
    assert [r["a2a"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ring"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    inv = zigzag_order(S, 4).argsort()
    ref = _reference(_inputs(), p)
    for name, want in ref.items():
        if name == "dsinks":  # each rank's rows' share, summed over cp like a replicated weight
            got = torch.stack([r[name] for r in results]).sum(0)
        else:
            got = torch.cat([r[name] for r in results], dim=2)[:, :, inv]
        err = rel_err(got, want)
        assert err < TOL, f"{name}: rel err {err:.2e}"


@pytest.mark.parametrize(("degrees", "a2a", "inner", "outer"), [
    ({"cp": 4}, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    ({"cp": 4, "tp": 2}, 2, [[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
])
def test_cp_sub_groups(degrees: dict[str, int], a2a: int, inner: list[list[int]],
                       outer: list[list[int]]) -> None:
    """Inner groups: consecutive cp ranks; outer: one per inner index; degenerate splits
    share the cp group's process group (no new creation call)."""
    plan = plan_groups(ParallelDims(**degrees), cp_a2a_size=a2a)
    assert plan["cp_a2a"].partition == inner and plan["cp_ring"].partition == outer
    assert plan["cp_a2a"].creates and plan["cp_ring"].creates
    whole = plan_groups(ParallelDims(cp=2), cp_a2a_size=2)
    assert whole["cp_a2a"].source == whole["cp"].source  # the cp group's pg, shared
    assert whole["cp_ring"].source == "single"
    ring = plan_groups(ParallelDims(cp=2), cp_a2a_size=1)
    assert ring["cp_a2a"].source == "single" and ring["cp_ring"].source == ring["cp"].source
    assert not whole["cp_a2a"].creates and not ring["cp_ring"].creates
    assert "cp_a2a" not in plan_groups(ParallelDims(cp=4))  # made only when asked
