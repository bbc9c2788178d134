"""Ring attention: exact attention over a sequence split across the cp ranks (zigzag layout).

cp rank r holds the query, key and value rows of zigzag chunks r and 2cp-1-r (see
:mod:`colonnade.context_parallel.layout`; n = s / (2 cp) rows each). The key/value block of
every rank visits every rank once around the ring r -> r+1:

Forward, step t = 0 .. cp-1: rank r holds the k/v block of source rank (r - t) mod cp. Before
computing on it, it posts ONE batched p2p (k and v packed in one buffer, double-buffered):
send the block to r+1, receive the next one from r-1 (none at the last step); with
``overlap`` the transfer runs under the compute, else it is waited first (same numbers). For
each (query chunk cq, key chunk ck) pair of the step::

    causal and ck > cq : every key is in the future      -> skipped (never computed)
    causal and ck == cq: the diagonal block              -> causal block kernel
    otherwise          : the whole block is visible      -> full block kernel

With a sliding window of W keys (``window``, :mod:`colonnade.context_parallel.masks`) a pair
whose keys are all at least W positions behind all its queries is skipped too (the k/v block
still travels: later ranks need it), and a pair the window cuts runs with the band mask
i - W < j <= i of its rows' global positions (:func:`~colonnade.context_parallel.masks.
block_kind`); :func:`block_counts` counts the computed and skipped pairs.

``doc_ids`` adds a boolean mask per pair, doc[q rows] == doc[k rows] (on top of causality).
``dropout`` (attention dropout, :mod:`colonnade.context_parallel.block_dropout`) multiplies
each computed pair's probabilities by the box of the single-process keep-mask at the pair's
global (query, key) positions, forward and backward (eager block kernels then).
Each query chunk's partials are merged by the online softmax
(:func:`colonnade.context_parallel.kernels.merge`); q, k, v, out and lse are saved.

Backward: the k/v blocks travel the ring again, and with them the gradient accumulators of
each block: at step t rank r computes the block gradients c_t of source (r - t) (dq summed
locally) while its batched group G_t moves the next k/v block and receives the accumulator of
source (r - t) from r-1 (the sum of the contributions of the ranks it visited before). After
G_t, ``acc_t = received + c_t`` is sent on in G_{t+1}; one last group G_cp hands every block's
dk/dv back to its owner. The fused backward gets the FINAL out and lse, which makes its
result the exact per-block contribution (kernels module doc).

Bytes sent per rank: forward (cp-1) bytes(k+v); backward (cp-1) bytes(k+v) + cp numel(k+v)
x itemsize(acc), acc the log-sum-exp dtype (fp32 for half inputs, fp64 for fp64: the
gradient accumulators travel at full precision).

NCCL semantics: every rank posts the same sequence of batched groups (cp-1 forward, cp+1
backward), each holding a send to r+1 and a receive from r-1 in the same order (k/v first,
then the gradient accumulator); each group is waited before any of its buffers is reused.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from colonnade.context_parallel import kernels, masks
from colonnade.context_parallel.block_dropout import BlockDropout
from colonnade.context_parallel.sinks import merge_sinks, sinks_grad
from colonnade.eager import eager
from colonnade.parallel.comm import CommGroup, Handle

Piece = tuple[int, int, int]
"""(chunk id among the 2 cp zigzag chunks, first local row, stop local row) of a rank."""


def pieces(cp: int, rank: int, s_local: int) -> list[Piece]:
    """The rank's zigzag chunks in local order; one piece (chunk 0) when cp = 1."""
    if cp == 1:
        return [(0, 0, s_local)]
    n = s_local // 2
    return [(rank, 0, n), (2 * cp - 1 - rank, n, s_local)]


def pair_kind(qp: Piece, kp: Piece, n: int, causal: bool, window: int | None) -> str:
    """:func:`~colonnade.context_parallel.masks.block_kind` of a (query piece, kv piece) pair
    (chunk c covers global rows c n .. c n + n - 1): 'skip', 'full', 'diag' or 'band'."""
    return masks.block_kind(qp[0] * n, qp[2] - qp[1], kp[0] * n, kp[2] - kp[1], causal, window)


def block_counts(cp: int, s: int, causal: bool = True, window: int | None = None
                 ) -> dict[str, int]:
    """Block pairs of one ring attention call over all cp ranks and steps, by kind ('skip',
    'full', 'diag', 'band'): 4 cp^2 pairs in all (cp = 1: one), sequence length s."""
    out = dict.fromkeys((masks.SKIP, masks.FULL, masks.DIAG, masks.BAND), 0)
    s_local = s // cp
    n = s_local // 2 if cp > 1 else s_local
    for rank in range(cp):
        for source in range(cp):
            for qp in pieces(cp, rank, s_local):
                for kp in pieces(cp, source, s_local):
                    out[pair_kind(qp, kp, n, causal, window)] += 1
    return out


def pair_mask(doc_ids: torch.Tensor | None, qp: Piece, kp: Piece, n: int
              ) -> torch.Tensor | None:
    """Document mask of a (query chunk, key chunk) pair: bool [b, 1, n_q, n_k], True where
    both rows are in the same document; None without ``doc_ids`` ([b, s], natural order)."""
    if doc_ids is None:
        return None
    dq = doc_ids[:, qp[0] * n:qp[0] * n + qp[2] - qp[1]]  # [b, n_q]
    dk = doc_ids[:, kp[0] * n:kp[0] * n + kp[2] - kp[1]]  # [b, n_k]
    return (dq[:, :, None] == dk[:, None, :]).unsqueeze(1)  # [b, 1, n_q, n_k]


class _Ring:
    """The ring's geometry for one call: sizes, peers, chunks and masks."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, group: CommGroup, causal: bool,
                 doc_ids: torch.Tensor | None, scale: float, window: int | None,
                 dropout: BlockDropout | None = None) -> None:
        self.group, self.causal, self.doc_ids, self.scale = group, causal, doc_ids, scale
        self.window, self.device, self.dropout = window, q.device, dropout
        self.cp, self.rank = group.size, max(group.rank, 0)
        s_local = q.shape[2]
        self.n = s_local // 2 if self.cp > 1 else s_local
        self.next = group.ranks[(self.rank + 1) % self.cp]
        self.prev = group.ranks[(self.rank - 1) % self.cp]
        self.q_pieces = pieces(self.cp, self.rank, s_local)
        self.kv_heads = k.shape[1]

    def source(self, t: int) -> int:
        """cp rank whose k/v block this rank holds at ring step t."""
        return (self.rank - t) % self.cp

    def pairs(self, t: int) -> list[tuple[Piece, Piece, bool, torch.Tensor | None]]:
        """(q piece, kv piece, causal, mask) of the blocks computed at step t."""
        out = []
        kv_pieces = pieces(self.cp, self.source(t), self.q_pieces[-1][2])
        for qp in self.q_pieces:
            for kp in kv_pieces:
                kind = pair_kind(qp, kp, self.n, self.causal, self.window)
                if kind == masks.SKIP:
                    continue
                mask = pair_mask(self.doc_ids, qp, kp, self.n)  # [b, 1, n_q, n_k] or None
                if kind == masks.BAND:
                    cut = masks.block_band(qp[0] * self.n, qp[2] - qp[1], kp[0] * self.n,
                                           kp[2] - kp[1], self.window, self.device)[None, None]
                    mask = cut if mask is None else mask & cut  # [1 | b, 1, n_q, n_k]
                out.append((qp, kp, kind == masks.DIAG, mask))
        return out

    def drop(self, qp: Piece, kp: Piece, q: torch.Tensor, dtype: torch.dtype
             ) -> torch.Tensor | None:
        """keep / (1 - p) of a pair's block, [b, a, n_q, n_k] in ``dtype`` (q [b, a, s_l, d]
        the local queries), or None without dropout."""
        if self.dropout is None:
            return None
        return self.dropout.scaled_keep(q.shape[0], q.shape[1], qp[0] * self.n, qp[2] - qp[1],
                                        kp[0] * self.n, kp[2] - kp[1], dtype, self.device)

    def post(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], name: str) -> Handle:
        """One batched group: every send to the next rank, every receive from the previous."""
        return self.group.p2p([(x, self.next) for x in sends],
                              [(x, self.prev) for x in recvs], name=name)


def _rows(x: torch.Tensor, p: Piece) -> torch.Tensor:
    return x[:, :, p[1]:p[2]]


def _split_kv(buf: torch.Tensor, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    return buf[:, :kv], buf[:, kv:]


def ring_forward(ring: _Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, a, s_l, d], k / v [b, kv, s_l, d] -> (out [b, a, s_l, d] in q's dtype,
    lse [b, a, s_l] fp32 / fp64)."""
    bufs = [torch.cat([k, v], dim=1).contiguous()]  # [b, 2kv, s_l, d]
    if ring.cp > 1:
        bufs.append(torch.empty_like(bufs[0]))
    acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in range(ring.cp):
        cur = bufs[t % 2]
        handle = None
        if t < ring.cp - 1:
            handle = ring.post([cur], [bufs[(t + 1) % 2]], "cp_ring_kv")
            if not overlap:
                handle.wait()
        kb, vb = _split_kv(cur, ring.kv_heads)
        for qp, kp, diag, mask in ring.pairs(t):
            o, lse = kernels.block_forward(_rows(q, qp), _rows(kb, kp), _rows(vb, kp),
                                           causal=diag, mask=mask, scale=ring.scale,
                                           drop=ring.drop(qp, kp, q, kernels.lse_dtype(q.dtype)))
            prev = acc.get(qp[0])
            acc[qp[0]] = (o.to(lse.dtype), lse) if prev is None else kernels.merge(
                prev[0], prev[1], o, lse)
        if handle is not None:
            handle.wait()
    # every query chunk meets its own chunk at step 0 (the diagonal), so each has a partial
    outs = [acc[qp[0]][0] for qp in ring.q_pieces]
    lses = [acc[qp[0]][1] for qp in ring.q_pieces]
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def _block_grads(ring: _Ring, t: int, dout: torch.Tensor, q: torch.Tensor, kb: torch.Tensor,
                 vb: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor
                 ) -> torch.Tensor:
    """Gradients of step t's blocks: dq accumulated in place (acc dtype), returns this rank's
    contribution to the visiting block's [dk, dv]: [b, 2kv, s_l, d] in acc dtype."""
    dkv = torch.zeros(kb.shape[0], 2 * ring.kv_heads, *kb.shape[2:], dtype=dq.dtype,
                      device=dq.device)  # [b, 2kv, s_l, d]
    dk_all, dv_all = _split_kv(dkv, ring.kv_heads)
    for qp, kp, diag, mask in ring.pairs(t):
        gq, gk, gv = kernels.block_backward(
            _rows(dout, qp), _rows(q, qp), _rows(kb, kp), _rows(vb, kp), _rows(out, qp),
            lse[:, :, qp[1]:qp[2]], causal=diag, mask=mask, scale=ring.scale,
            drop=ring.drop(qp, kp, q, dq.dtype))
        _rows(dq, qp).add_(gq)
        _rows(dk_all, kp).add_(gk)
        _rows(dv_all, kp).add_(gv)
    return dkv


def ring_backward(ring: _Ring, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, overlap: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [b, a, s_l, d], dk, dv [b, kv, s_l, d]) in the input dtypes (module doc)."""
    acc_dt = lse.dtype
    dq = torch.zeros(q.shape, dtype=acc_dt, device=q.device)
    kv_bufs = [torch.cat([k, v], dim=1).contiguous()]  # [b, 2kv, s_l, d]
    if ring.cp > 1:
        kv_bufs.append(torch.empty_like(kv_bufs[0]))
    shape = (k.shape[0], 2 * ring.kv_heads, *k.shape[2:])
    g_bufs = [torch.empty(shape, dtype=acc_dt, device=q.device) for _ in range(2)]
    sent: torch.Tensor | None = None  # accumulator finished at the previous step
    for t in range(ring.cp):
        cur = kv_bufs[t % 2]
        sends, recvs = [], []
        if t < ring.cp - 1:
            sends.append(cur)
            recvs.append(kv_bufs[(t + 1) % 2])
        incoming = g_bufs[t % 2]
        if sent is not None:
            sends.append(sent)
            recvs.append(incoming)
        handle = ring.post(sends, recvs, "cp_ring_bwd") if sends else None
        if handle is not None and not overlap:
            handle.wait()
        kb, vb = _split_kv(cur, ring.kv_heads)
        mine = _block_grads(ring, t, dout, q, kb, vb, out, lse, dq)
        if handle is not None:
            handle.wait()
        if sent is None:
            incoming.copy_(mine)
        else:
            incoming.add_(mine)
        sent = incoming
    assert sent is not None
    if ring.cp > 1:  # the last hop: every accumulator back to its owner
        final = g_bufs[ring.cp % 2]
        ring.post([sent], [final], "cp_ring_bwd").wait()
        sent = final
    dk, dv = _split_kv(sent, ring.kv_heads)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class OpRingAttention(torch.autograd.Function):
    """Autograd of :func:`ring_attention`: saves q, k, v (local), out and lse only."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: CommGroup, causal: bool, doc_ids: torch.Tensor | None, overlap: bool,
                scale: float, window: int | None, sinks: torch.Tensor | None = None,
                dropout: BlockDropout | None = None) -> torch.Tensor:
        """Ring forward (module doc); ``sinks`` merged once with the final lse
        (:mod:`~colonnade.context_parallel.sinks`)."""
        ring = _Ring(q, k, group, causal, doc_ids, scale, window, dropout)
        out, lse = ring_forward(ring, q, k, v, overlap)
        if sinks is not None:
            out, lse = merge_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.overlap = ring, overlap
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        """Ring backward (module doc)."""
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ring_backward(ctx.ring, dout, q, k, v, out, lse, ctx.overlap)
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)  # local rows
        return dq, dk, dv, None, None, None, None, None, None, dsinks, None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int,
           doc_ids: torch.Tensor | None, causal: bool, window: int | None) -> None:
    if window is not None and (window < 1 or not causal):
        raise ValueError(f"ring_attention: window={window} needs causal attention and a "
                         "window >= 1 (model.sliding_window)")
    if q.dim() != 4 or k.shape != v.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"ring_attention wants q [b, a, s_l, d] and k, v [b, kv, s_l, d]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads "
                         f"{k.shape[1]}")
    if cp > 1 and q.shape[2] % 2:
        raise ValueError(f"local sequence {q.shape[2]} must hold two equal zigzag chunks; "
                         f"training.seq_len must be divisible by 2 x parallel.cp")
    if doc_ids is not None and tuple(doc_ids.shape) != (q.shape[0], q.shape[2] * cp):
        raise ValueError(f"doc_ids must be [b, s] = [{q.shape[0]}, {q.shape[2] * cp}] (full "
                         f"sequence, natural order); got {tuple(doc_ids.shape)}")


@eager
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup, *,
                   causal: bool = True, doc_ids: torch.Tensor | None = None,
                   overlap: bool = True, scale: float | None = None,
                   window: int | None = None, sinks: torch.Tensor | None = None,
                   dropout: BlockDropout | None = None) -> torch.Tensor:
    """Exact softmax attention of the cp rank's local query rows over the whole sequence.

    q [b, a, s_l, d], k / v [b, kv, s_l, d] (GQA: a % kv == 0, kv not expanded), the rank's
    rows in zigzag local order (s = s_l cp); ``doc_ids`` int64 [b, s] over the full sequence
    in natural order (query i attends key j iff doc_ids[i] == doc_ids[j], and j <= i when
    ``causal``); ``scale`` defaults to 1 / sqrt(d); ``window``: a causal sliding window of W
    keys, query i also needs i - j < W (:mod:`~colonnade.context_parallel.masks`); ``sinks``
    [a]: per-head sink logits joining every row's softmax denominator, merged after the ring
    with the final lse (:mod:`~colonnade.context_parallel.sinks`; their gradient covers this
    rank's rows, summed over cp like any replicated weight's); ``dropout``: attention dropout
    keyed by global positions (:mod:`~colonnade.context_parallel.block_dropout`, its
    ``head_offset`` placing q's heads). Returns out [b, a, s_l, d],
    same layout as q. A group of size 1 computes plain local attention. Not traced by
    torch.compile (a graph break).
    """
    _check(q, k, v, group.size, doc_ids, causal, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out: torch.Tensor = OpRingAttention.apply(q, k, v, group, causal, doc_ids, overlap, scale,
                                              window, sinks, dropout)
    return out
