"""Both cp attentions against an independent plain-PyTorch reference, float64.

The reference uses no Colonnade code: explicit softmax(Q K^T * scale + M) V on the full
natural-order sequence, GQA by indexing kv head h // (a / kv) for query head h, and the mask M
(0 or -inf) from global positions: key j is visible to query i iff doc[i] == doc[j] (when doc
ids are given) and j <= i (when causal). The zigzag rows of cp rank r are written out here too:
with n = s / (2 cp), rows [r n, (r + 1) n) then [(2 cp - 1 - r) n, (2 cp - r) n).

Each rank feeds its rows of q, k, v (kv heads NOT expanded) to
  ring_attention(q, k, v, cp, causal=, doc_ids=, overlap=, scale=)     (helper A's)
  all_to_all_attention(q, k, v, cp, attend)  with attend = torch SDPA on its heads (mask from
                                             the same doc ids), i.e. the head-split plumbing
and backpropagates L = sum(out * w). Checked: out, dq, dk, dv on every rank equal the
reference's rows of the rank (and their gradients) to 1e-12, for causal, causal + documents
and non-causal documents (with a non-default scale), MHA, GQA and one kv head, cp 2 and 4;
the documents are cut so that many (query chunk, key chunk) blocks are fully masked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from colonnade.context_parallel.all_to_all_attention import all_to_all_attention
from colonnade.context_parallel.ring import ring_attention
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups

B, S, D = 2, 16, 4
DOC_LENGTHS = ([1, 4, 3, 8], [6, 2, 1, 7])
"""Document lengths of the two sequences (boundaries inside and at chunk edges)."""
HEADS = {2: [(4, 4), (4, 2), (4, 1)], 4: [(8, 8), (8, 2), (8, 1)]}
"""(query heads a, kv heads) per cp."""
MASKS: list[tuple[bool, bool, float | None]] = [(True, False, None), (True, True, None),
                                                 (False, True, 0.3)]
"""(causal, documents, scale)."""


def _doc_ids() -> torch.Tensor:
    """int64 [b, s]: document index of every position."""
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in DOC_LENGTHS]
    return torch.stack(rows)


def _rows_of(cp: int, r: int) -> list[int]:
    """Global positions of cp rank r's local rows (zigzag), written out independently."""
    n = S // (2 * cp)
    return list(range(r * n, (r + 1) * n)) + list(range((2 * cp - 1 - r) * n, (2 * cp - r) * n))


def _inputs(a: int, kv: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Full q [b, a, s, d], k, v [b, kv, s, d], loss weights w [b, a, s, d]."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, a, S, D), (B, kv, S, D), (B, kv, S, D), (B, a, S, D)]
    return tuple(torch.randn(*sh, generator=gen, dtype=torch.float64) for sh in shapes)


def _allowed(causal: bool, docs: torch.Tensor | None) -> torch.Tensor:
    """bool [b, 1, s, s]: key j visible to query i."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    ok = (j <= i) if causal else torch.ones(S, S, dtype=torch.bool)
    ok = ok.expand(B, S, S)
    if docs is not None:
        ok = ok & (docs[:, :, None] == docs[:, None, :])
    return ok.unsqueeze(1)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              docs: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """Explicit softmax(Q K^T scale + M) V: q [b, a, s, d], k/v [b, kv, s, d] -> [b, a, s, d]."""
    a, kv = q.shape[1], k.shape[1]
    group = torch.arange(a) // (a // kv)  # kv head read by each query head
    kx, vx = k[:, group], v[:, group]  # [b, a, s, d]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bhid,bhjd->bhij", q, kx) * scale  # [b, a, s, s]
    scores = scores.masked_fill(~_allowed(causal, docs), float("-inf"))
    return torch.einsum("bhij,bhjd->bhid", scores.softmax(dim=-1), vx)


def _sdpa_attend(causal: bool, docs: torch.Tensor | None, scale: float | None
                 ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """all_to_all's ``attend``: torch SDPA on natural-order heads (kv repeated for GQA)."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _off: int) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_allowed(causal, docs),
                                              scale=scale)
    return attend


def _run_one(fn: Callable[..., torch.Tensor], qkv: list[torch.Tensor], w: torch.Tensor
             ) -> list[torch.Tensor]:
    """out and dq, dk, dv of L = sum(out * w) for local inputs ``qkv``."""
    leaves = [t.clone().requires_grad_() for t in qkv]
    out = fn(*leaves)
    (out * w).sum().backward()
    return [out.detach()] + [t.grad for t in leaves if t.grad is not None]


def _rank_run(layout: dict[str, int]) -> list[dict[str, Any]]:
    groups = ProcessGroups.build(ParallelDims(**layout), timeout_s=60.0)
    group, results = groups.cp, []
    assert dist.get_world_size() == ParallelDims(**layout).world_size
    rows = _rows_of(group.size, group.rank)
    for h, (a, kv) in enumerate(HEADS[group.size]):
        q, k, v, w = _inputs(a, kv, seed=7 + h)
        local = [x[:, :, rows] for x in (q, k, v)]  # [b, heads, s/cp, d]
        for m, (causal, with_docs, scale) in enumerate(MASKS):
            docs = _doc_ids() if with_docs else None
            overlap = (h + m) % 2 == 0

            def ring(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, causal: bool = causal,
                     docs: torch.Tensor | None = docs, scale: float | None = scale,
                     overlap: bool = overlap) -> torch.Tensor:
                return ring_attention(ql, kl, vl, group, causal=causal, doc_ids=docs,
                                      overlap=overlap, scale=scale)

            def a2a(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, causal: bool = causal,
                    docs: torch.Tensor | None = docs, scale: float | None = scale
                    ) -> torch.Tensor:
                return all_to_all_attention(ql, kl, vl, group, _sdpa_attend(causal, docs, scale))

            results.append(dict(a=a, kv=kv, seed=7 + h, mask=m, cp_rank=group.rank,
                                ring=_run_one(ring, local, w[:, :, rows]),
                                a2a=_run_one(a2a, local, w[:, :, rows])))
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_all_to_all_equal_plain_reference(run_ranks: Callable[..., list[Any]],
                                                   cp: int) -> None:
    per_rank = run_ranks(cp, _rank_run, dict(cp=cp))
    for results in per_rank:
        assert len(results) == len(HEADS[cp]) * len(MASKS)
        for res in results:
            a, kv = res["a"], res["kv"]
            causal, with_docs, scale = MASKS[res["mask"]]
            q, k, v, w = _inputs(a, kv, seed=res["seed"])
            for t in (q, k, v):
                t.requires_grad_()
            out = reference(q, k, v, causal, _doc_ids() if with_docs else None, scale)
            dq, dk, dv = torch.autograd.grad((out * w).sum(), (q, k, v))
            rows = _rows_of(cp, res["cp_rank"])
            want = [x.detach()[:, :, rows] for x in (out, dq, dk, dv)]
            for kind in ("ring", "a2a"):
                assert len(res[kind]) == 4, f"{kind}: missing gradients"
                for got, exp, what in zip(res[kind], want, ("out", "dq", "dk", "dv"),
                                          strict=True):
                    torch.testing.assert_close(got, exp, rtol=0, atol=1e-12,
                                               msg=lambda m, kind=kind, what=what, res=res:
                                               f"{kind} {what} a={res['a']} kv={res['kv']} "
                                               f"mask={MASKS[res['mask']]}: {m}")
