"""Hierarchical context parallelism ("USP", Megatron's hierarchical_context_parallel_sizes):
all-to-all attention inside groups of a ranks, ring attention across the r = cp / a groups.

The cp group's c = a r ranks hold the zigzag rows of the sequence
(:mod:`~colonnade.context_parallel.layout`): rank i holds chunks i and 2c - 1 - i of 2c chunks
of n = s / (2c) rows. cp rank i = g a + j sits at index j of its inner (all-to-all) group g
(``cp_a2a``: ranks g a .. g a + a - 1) and at index g of its outer (ring) group j
(``cp_ring``: ranks j, a + j, .., (r - 1) a + j); :mod:`colonnade.parallel.groups` makes both.

Step 1, the inner all-to-all (:func:`~colonnade.context_parallel.all_to_all_attention.
all_to_all_attention` over ``cp_a2a``) trades the sequence split for a head split: rank j of
group g receives heads [j a_l/a, (j + 1) a_l/a) of the chunks its group holds, which are
chunks g a .. g a + a - 1 and their mirrors 2c - 1 - (g a + a - 1) .. 2c - 1 - g a, put in
ascending order (the all-to-all's chunk permutation depends on a alone). In units of
N = a n = s / (2r) rows these are the super-chunks g and 2r - 1 - g, in that order::

    [g a n, (g + 1) a n)  followed by  [(2r - 1 - g) a n, (2r - g) a n)

which is exactly the zigzag layout of a cp group of r ranks (rank g). So

Step 2 is ordinary ring attention (:mod:`~colonnade.context_parallel.ring`) over ``cp_ring`` on
those heads: its causal block skipping, zigzag load balance, document masks (the full
[b, s] document ids), sliding window, sinks and dropout keyed by global positions all hold
unchanged, with the ring's chunks N rows long. Step 3, the all-to-all back, returns the
output to the sequence split. At a = c this is all_to_all attention (the ring has one rank),
at a = 1 ring attention (the all-to-all has one rank).

Heads (per tp rank): a_l query heads divisible by a; kv_l kv heads divisible by a (split like
q) or dividing it (one kv head per rank, replicated; gradients summed), as all_to_all's rule
with cp replaced by a. The ring has no head condition, so c may exceed the head count.

Bytes sent per rank and layer (E element bytes, A the log-sum-exp's, s_l = s / c rows,
h_kv = max(kv_l / a, 1) the kv heads a rank holds after the all-to-all, head size d):
  all-to-all, forward  (a - 1)/a x (q + k + v + out) = (a - 1)/a b s_l d E (2 a_l + 2 a h_kv)
                       (k and v pass as a h_kv heads), backward the same for the gradients;
  ring (r ranks, on the a_l / a query heads and h_kv kv heads of N-row chunks):
                       forward (r - 1) K, backward (r - 1) K + r K A / E,
                       K = 2 b (a s_l) h_kv d E the kv block of a ring rank (a s_l = s / r rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from colonnade.context_parallel.all_to_all_attention import all_to_all_attention
from colonnade.parallel.comm import CommGroup

RingAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, CommGroup], torch.Tensor]
"""``ring(q [b, a_q, s_r, d], k / v [b, h_kv, s_r, d], head_offset, group) -> [b, a_q, s_r, d]``:
ring attention over ``group`` of the heads starting at ``head_offset`` among the tp rank's
query heads, rows in the ring's zigzag local order (s_r = s / r)."""


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           a2a: CommGroup, ring: CommGroup, attend: RingAttend
                           ) -> torch.Tensor:
    """Context-parallel attention by a head split inside ``a2a`` and a ring across ``ring``
    (module doc). q [b, a_l, s_l, d], k / v [b, kv_l, s_l, d]: this cp rank's zigzag local
    rows (s = a r s_l); ``attend`` runs the ring (:data:`RingAttend`). Returns
    [b, a_l, s_l, d] in the same layout. Differentiable (the all-to-alls' inverses around the
    ring's backward)."""
    if q.shape[2] % 2:
        raise ValueError(f"local sequence {q.shape[2]} must hold two equal zigzag chunks; "
                         "training.seq_len must be divisible by 2 x parallel.cp")

    def inner(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
              head_offset: int) -> torch.Tensor:
        return attend(qh, kh, vh, head_offset, ring)  # [b, a_l/a, s/r, d]

    return all_to_all_attention(q, k, v, a2a, inner)
