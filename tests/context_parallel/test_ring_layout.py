"""Ring attention inside a larger layout, and its p2p posting under NCCL's semantics.

* tp 2 x cp 2 (cp groups [0, 2] and [1, 3]: the ring's peers are global ranks): every cp
  group's result equals single-process float64 attention (rel_err < 1e-10).
* The batched groups each rank really posts (recorded from ``CommGroup.p2p`` on cp 4, forward
  and backward, overlap on) replay to completion in the NCCL model of
  :mod:`colonnade.pipeline.nccl_model` (in-order stream per rank, k-th send on a channel
  matches the k-th receive): each op is named (name, group index, bytes), so a send and the
  receive it would match must agree on all three; forward posts cp-1 groups, backward cp+1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

from colonnade.context_parallel.layout import take_local
from colonnade.context_parallel.ring import ring_attention
from colonnade.parallel.comm import CommGroup, Handle
from colonnade.parallel.dims import ParallelDims
from colonnade.pipeline.nccl_model import run_groups
from colonnade.pipeline.p2p import Message, Op
from tests.context_parallel.test_ring import _gathered, _inputs, _reference
from tests.parity import TOL, rank_groups, rel_err


def _tp_cp_rank() -> dict[str, Any]:
    dims = ParallelDims(tp=2, cp=2)
    group = rank_groups(dims).cp
    x = _inputs(2, 2, True)
    q, k, v = (take_local(x[n], 2, group.rank, 2).requires_grad_(True)
               for n in ("q", "k", "v"))
    out = ring_attention(q, k, v, group, doc_ids=x["doc_ids"])
    out.backward(take_local(x["dout"], 2, group.rank, 2))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "cp_ranks": group.ranks, "tp": dims.coords(group.ranks[group.rank])["tp"]}


def test_ring_in_tp2_cp2_layout(run_ranks: Callable[..., list[Any]]) -> None:
    results = run_ranks(4, _tp_cp_rank)
    assert [r["cp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    ref = _reference(_inputs(2, 2, True), causal=True)
    for tp in (0, 1):
        got = _gathered([r for r in results if r["tp"] == tp], 2)
        for name, want in ref.items():
            assert rel_err(got[name], want) < TOL, (tp, name)


def _recording_rank(cp: int) -> list[list[tuple[str, int, str, int]]]:
    """The rank's posted groups: (kind, global peer, name, bytes) per op, in posting order."""
    group = rank_groups(ParallelDims(cp=cp)).cp
    posted: list[list[tuple[str, int, str, int]]] = []
    real = CommGroup.p2p

    def record(self: CommGroup, sends: list[tuple[torch.Tensor, int]],
               recvs: list[tuple[torch.Tensor, int]], *, name: str = "") -> Handle:
        posted.append([("send", p, name, t.numel() * t.element_size()) for t, p in sends]
                      + [("recv", p, name, t.numel() * t.element_size()) for t, p in recvs])
        return real(self, sends, recvs, name=name)

    x = _inputs(cp, 2, False)
    q, k, v = (take_local(x[n], cp, group.rank, 2).requires_grad_(True)
               for n in ("q", "k", "v"))
    with mock.patch.object(CommGroup, "p2p", record):
        ring_attention(q, k, v, group).backward(take_local(x["dout"], cp, group.rank, 2))
    return posted


def test_ring_posting_completes_under_nccl(run_ranks: Callable[..., list[Any]]) -> None:
    cp = 4
    posted = run_ranks(cp, _recording_rank, cp)
    names = {"cp_ring_kv": "F", "cp_ring_bwd": "B"}
    groups = []
    for rank_posts in posted:
        assert [g[0][2] for g in rank_posts] == ["cp_ring_kv"] * (cp - 1) + \
            ["cp_ring_bwd"] * (cp + 1)
        groups.append([tuple(Op(kind, peer, Message(names[name], i, nbytes))
                             for kind, peer, name, nbytes in g)
                       for i, g in enumerate(rank_posts)])
    assert run_groups(groups) == 2 * cp  # every group completes in one round: no stall
