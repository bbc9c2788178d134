"""All-to-all (Ulysses) context-parallel attention against full-sequence attention, float64.

Every rank draws the same full-sequence q [b, a, s, d], k/v [b, kv, s, d], takes its zigzag
rows (layout.take_local) and runs ``all_to_all_attention`` with an ``attend`` that is plain
SDPA on the natural-order sequence (causal, or causal within documents, the mask built from doc
ids inside attend); the loss is L = sum(out * w) with a fixed w. Checked per rank:
  out, dq, dk, dv     == the zigzag rows of the single-process full-sequence result and its
                         gradients (kv replicated when kv < cp: the replicas' gradients summed)
  attend's inputs     q heads [off, off + a/cp) of the full q in natural order, k/v the kv
                      heads those query heads read, head_offset = cp_rank x a/cp
  bytes               4 all-to-alls on the cp group, payloads B_qkv = (a + 2 cp h_kv) b s_l d 8
                      (qkv and its gradient), B_o = a b s_l d 8 (out and its gradient), wire
                      (cp - 1) / cp x payload, one call each
and the head-count errors name parallel.cp / model.num_kv_heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from colonnade.context_parallel.all_to_all_attention import (
    all_to_all_attention,
    kv_heads_per_rank,
)
from colonnade.context_parallel.layout import take_local
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups

B, S, D = 2, 16, 8
HEADS = {2: [(4, 4), (4, 2), (4, 1), (2, 1)], 4: [(8, 8), (8, 2), (8, 1), (4, 4), (4, 2)]}
"""(query heads a, kv heads) per cp: kv = a (MHA), kv % cp == 0, cp % kv == 0 (replicated)."""
LAYOUTS = [dict(cp=2), dict(cp=4), dict(tp=2, cp=2)]


def _inputs(a: int, kv: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Full-sequence q [b, a, s, d], k, v [b, kv, s, d], loss weights w [b, a, s, d] and doc
    ids [b, s] (documents of lengths 5, 7, 4 and 3, 13), float64 / int64."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, a, S, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, kv, S, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, kv, S, D, generator=gen, dtype=torch.float64)
    w = torch.randn(B, a, S, D, generator=gen, dtype=torch.float64)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 3 + [1] * 13])  # [b, s]
    return q, k, v, w, docs


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None
          ) -> torch.Tensor:
    """Causal (within documents when ``docs`` [b, s] is given) SDPA on natural-order q
    [b, h, s, d], k/v [b, h_kv, s, d] (GQA: kv heads repeated)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).tril()  # [s, s]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])  # [b, s, s]
    mask = mask.expand(q.shape[0], s, s).unsqueeze(1)  # [b, 1, s, s]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _case(group: CommGroup, a: int, kv: int, doc_mask: bool, seed: int) -> dict[str, Any]:
    """One forward + backward on this rank; returns its outputs, grads and attend's view."""
    cp, r = group.size, group.rank
    q, k, v, w, docs = _inputs(a, kv, seed)
    ql, kl, vl = (take_local(x, cp, r, 2).requires_grad_() for x in (q, k, v))
    seen: dict[str, Any] = {}

    def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, off: int) -> torch.Tensor:
        a_q, h_kv = qh.shape[1], kh.shape[1]
        first_kv = off // (a // kv)  # kv head of the first query head
        seen.update(offset=off, q=torch.equal(qh, q[:, off:off + a_q]),
                    k=torch.equal(kh, k[:, first_kv:first_kv + h_kv]),
                    v=torch.equal(vh, v[:, first_kv:first_kv + h_kv]))
        return _sdpa(qh, kh, vh, docs if doc_mask else None)

    group.stats.reset()
    out = all_to_all_attention(ql, kl, vl, group, attend)  # [b, a, s/cp, d]
    (out * take_local(w, cp, r, 2)).sum().backward()
    grads = [t.grad for t in (ql, kl, vl)]
    assert all(g is not None for g in grads)
    stats = {key: (s["calls"], s["payload_bytes"], s["wire_bytes"])
             for key, s in group.stats.snapshot().items() if key.startswith("cp/")}
    return dict(out=out.detach(), grads=grads, seen=seen, stats=stats)


def _rank_run(layout: dict[str, int]) -> list[dict[str, Any]]:
    groups = ProcessGroups.build(ParallelDims(**layout), timeout_s=60.0)
    group = groups.cp
    assert dist.get_world_size() == ParallelDims(**layout).world_size
    results = []
    for i, (a, kv) in enumerate(HEADS[group.size]):
        for doc_mask in (False, True):
            res = _case(group, a, kv, doc_mask, seed=100 + i)
            res.update(a=a, kv=kv, doc_mask=doc_mask, cp_rank=group.rank)
            results.append(res)
    return results


def _reference(a: int, kv: int, doc_mask: bool, seed: int) -> tuple[torch.Tensor, ...]:
    """Single-process full-sequence output and dq, dk, dv."""
    q, k, v, w, docs = _inputs(a, kv, seed)
    for t in (q, k, v):
        t.requires_grad_()
    out = _sdpa(q, k, v, docs if doc_mask else None)
    (out * w).sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


def _expected_stats(cp: int, a: int, kv: int) -> dict[str, tuple[int, int, float]]:
    """Per-rank (calls, payload bytes, wire bytes) of the four all-to-alls."""
    h_kv = kv // cp if kv % cp == 0 else 1
    row = B * (S // cp) * D * 8  # one head's local rows, float64
    qkv, o = (a + 2 * cp * h_kv) * row, a * row
    frac = (cp - 1) / cp
    return {"cp/all_to_all/cp_qkv": (1, qkv, frac * qkv),
            "cp/all_to_all/cp_qkv_grad": (1, qkv, frac * qkv),
            "cp/all_to_all/cp_out": (1, o, frac * o),
            "cp/all_to_all/cp_out_grad": (1, o, frac * o)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in
                                                                   d.items()))
def test_matches_full_sequence_attention(run_ranks: Callable[..., list[Any]],
                                         layout: dict[str, int]) -> None:
    dims = ParallelDims(**layout)
    cp = dims.cp
    per_rank = run_ranks(dims.world_size, _rank_run, layout)
    assert len(per_rank[0]) == 2 * len(HEADS[cp])
    for results in per_rank:
        for i, res in enumerate(results):
            a, kv, r = res["a"], res["kv"], res["cp_rank"]
            out, dq, dk, dv = _reference(a, kv, res["doc_mask"], seed=100 + i // 2)
            torch.testing.assert_close(res["out"], take_local(out, cp, r, 2), rtol=0, atol=1e-12)
            for got, full in zip(res["grads"], (dq, dk, dv), strict=True):
                torch.testing.assert_close(got, take_local(full, cp, r, 2), rtol=0, atol=1e-12)
            assert res["seen"] == dict(offset=r * a // cp, q=True, k=True, v=True)
            assert res["stats"] == _expected_stats(cp, a, kv)


def test_group_of_one_calls_attend_directly() -> None:
    group = ProcessGroups.single().cp
    q, k, v, _, docs = _inputs(4, 2, seed=5)
    calls: list[int] = []

    def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, off: int) -> torch.Tensor:
        calls.append(off)
        assert qh is q and kh is k and vh is v
        return _sdpa(qh, kh, vh, docs)

    out = all_to_all_attention(q, k, v, group, attend)
    assert calls == [0]
    torch.testing.assert_close(out, _sdpa(q, k, v, docs), rtol=0, atol=0)


@pytest.mark.parametrize(("a", "kv", "cp", "words"), [
    (6, 6, 4, ("parallel.cp", "num_heads")),  # query heads not divisible by cp
    (12, 6, 4, ("parallel.cp", "num_kv_heads")),  # 6 % 4 and 4 % 6 both nonzero
    (8, 3, 2, ("num_kv_heads",)),  # query heads do not share kv heads evenly
])
def test_head_count_errors(a: int, kv: int, cp: int, words: tuple[str, ...]) -> None:
    group = CommGroup("cp", list(range(cp)), None, CommStats(), 0)  # never communicates here
    q, k = torch.zeros(1, a, 4, 2), torch.zeros(1, kv, 4, 2)
    with pytest.raises(ValueError) as err:
        all_to_all_attention(q, k, k, group, lambda *_: q)
    assert all(word in str(err.value) for word in words)


def test_kv_heads_per_rank() -> None:
    assert [kv_heads_per_rank(8, kv, 4) for kv in (8, 4, 2, 1)] == [2, 1, 1, 1]
    assert kv_heads_per_rank(16, 8, 2) == 4
