"""MuonClip's per-head q/k logit clipping (Kimi K2, arXiv 2507.20534), after the update.

optim.qk_clip_threshold = tau > 0 installs a recorder on every attention layer
(:attr:`~colonnade.models.blocks.Attention.logit_max`, [a/tp]): each training forward keeps the
running maximum of the step's pre-softmax logits S_h of every local query head h
(:mod:`colonnade.models.qk_logits`). After the optimizer's update, before the masters are cast
to the parameters and gathered (:meth:`QKClip.apply`):

    S_h  <- max over dp of S_h                          (one MAX all-reduce of every layer's S)
    gamma_h = tau / S_h  if S_h > tau  else 1
    W_q[h rows], b_q[h]   *= gamma_h ^ alpha                              (alpha = qk_clip_alpha)
    W_k[g rows], b_k[g]   *= (min_{h in group g} gamma_h) ^ (1 - alpha)   (tau / max S of g)

with the rows of head h the d consecutive output rows h d .. (h + 1) d - 1 of the local
(column-parallel) projection [heads/tp d, hidden] and group g the a / kv query heads sharing key
head g (grouped-query attention). q/k norms, v, o and attention sinks are untouched.

Distribution: tp splits the heads, so each tp rank scales the rows of its own heads (the local
maxima are complete: a tp rank sees every token of its heads, sp gathers the sequence before
the projections); pp stages hold whole layers and clip independently; the dp ranks see
different data, hence the MAX over dp, after which every dp rank computes the same factors.
The scaling is applied to the optimizer's masters on its owned ranges of the flat buffers
(DDP: the whole buffer; ZeRO-1/2/3: the rank's shard), each owned element multiplied by its
head's factor (flat offset o of a parameter with e elements per head belongs to head o // e),
so the next cast / gather publishes the clipped weights. Refused layouts and attention
classes: :mod:`colonnade.config.rules_qk_clip`. A step skipped for inf / NaN (fp16) applies
nothing and keeps the maxima, which then also cover the next step.

Logged per step as ``qk_clipped``: the query heads clipped, summed over the model (tp, pp).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from colonnade.config.sections import OptimConfig
from colonnade.data_parallel.buffer import FlatBuffers
from colonnade.models.blocks import Attention
from colonnade.parallel.comm import CommGroup
from colonnade.parallel.groups import ProcessGroups

Piece = tuple[int, int, int, int]
"""(owned range index, lo, hi) of a master view and the flat offset of ``lo`` in the local
parameter."""


@dataclass
class _Rows:
    """One q or k weight or bias of one layer: ``heads`` equal blocks of rows."""

    param: nn.Parameter
    heads: int
    """Heads the local parameter holds (its first dim is heads x d)."""
    query: bool
    """W_q / b_q (scaled by gamma^alpha), else W_k / b_k (by the group's gamma^(1 - alpha))."""
    pieces: list[Piece] = field(default_factory=list)
    """Where this rank's optimizer owns its elements (filled on the first :meth:`QKClip.
    apply`)."""

    def scale(self, masters: list[torch.Tensor], factor: torch.Tensor) -> None:
        """Multiply every owned element of head h by ``factor[h]`` (factor [heads])."""
        per = self.param.numel() // self.heads  # elements of one head: d x cols
        for i, lo, hi, off in self.pieces:
            h0, h1 = off // per, (off + hi - lo - 1) // per + 1  # heads the piece touches
            view = masters[i][lo:hi]
            rows = factor[h0:h1].to(view.dtype).repeat_interleave(per)  # [(h1 - h0) per]
            view.mul_(rows[off - h0 * per:off - h0 * per + hi - lo])


class QKClip:
    """The clipping of every attention layer of one rank's model chunks (module docstring)."""

    def __init__(self, layers: Sequence[Attention], cfg: OptimConfig,
                 groups: ProcessGroups) -> None:
        self.layers = list(layers)
        self.tau, self.alpha = cfg.qk_clip_threshold, cfg.qk_clip_alpha
        self.dp = groups.dp
        """Ranks seeing other data for the same heads: S is their maximum."""
        self.count_groups: list[CommGroup] = [groups.tp, groups.pp]
        """Groups the clipped-head count is summed over (other heads, other layers)."""
        self.rows: list[tuple[_Rows, ...]] = []
        """Per layer: W_q (and b_q) by query heads, then W_k (and b_k) by key heads."""
        for attn in self.layers:
            weight = attn.q.weight
            attn.logit_max = torch.full((attn.heads,), -math.inf, device=weight.device,
                                        dtype=torch.promote_types(weight.dtype, torch.float32))
            q = [_Rows(p, attn.heads, True) for p in (attn.q.weight, attn.q.bias)
                 if p is not None]
            k = [_Rows(p, attn.kv_heads, False) for p in (attn.k.weight, attn.k.bias)
                 if p is not None]
            self.rows.append((*q, *k))
        self._placed = False

    def _place(self, buffers: FlatBuffers, ranges: list[tuple[int, int]]) -> None:
        """Find the owned pieces of every clipped parameter (once: the ranges are fixed)."""
        index = {id(r.param): r for rows in self.rows for r in rows}
        for i, (lo, hi) in enumerate(ranges):
            for p, a, b in buffers.segments(lo, hi):
                if id(p) in index:
                    index[id(p)].pieces.append((i, a - lo, b - lo, a - buffers.slot(p).start))
        self._placed = True

    @torch.no_grad()
    def apply(self, buffers: FlatBuffers, ranges: list[tuple[int, int]],
              masters: list[torch.Tensor]) -> float:
        """Clip the masters (``masters[i]`` the view of owned range ``ranges[i]``) by this
        step's maxima, reset the maxima; returns the query heads clipped in the whole model
        (collective over dp, tp and pp, in that order)."""
        if not self._placed:
            self._place(buffers, ranges)
        clipped = torch.zeros(1, dtype=torch.float64, device=buffers.device)
        if self.layers:
            logits = torch.cat([a.logit_max for a in self.layers])  # [sum of heads/tp]
            self.dp.all_reduce(logits, op=dist.ReduceOp.MAX, name="qk_logit_max")
            start = 0
            for attn, rows in zip(self.layers, self.rows, strict=True):
                s = logits[start:start + attn.heads].double()  # [a/tp]
                start += attn.heads
                assert attn.logit_max is not None
                attn.logit_max.fill_(-math.inf)
                over = s > self.tau
                if not bool(over.any()):
                    continue
                clipped += over.sum()
                gamma = torch.where(over, self.tau / s, torch.ones_like(s))  # [a/tp]
                group_gamma = gamma.view(attn.kv_heads, -1).amin(dim=1)  # [kv/tp]
                q_factor, k_factor = gamma.pow(self.alpha), group_gamma.pow(1.0 - self.alpha)
                for r in rows:
                    r.scale(masters, q_factor if r.query else k_factor)
        for group in self.count_groups:
            group.all_reduce(clipped, name="qk_clipped")
        return float(clipped[0])


def qk_clip_of(chunks: Sequence[nn.Module], cfg: OptimConfig,
               groups: ProcessGroups) -> QKClip | None:
    """The :class:`QKClip` of this rank's model chunks (recorders installed on every
    attention layer, in module order: the same on every dp rank), or None when
    optim.qk_clip_threshold is 0."""
    if not cfg.qk_clip_threshold > 0:
        return None
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, Attention)]
    return QKClip(layers, cfg, groups)
