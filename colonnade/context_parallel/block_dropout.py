"""Attention dropout of one (query block, key block) pair, keyed by global positions.

The single-process model drops the probabilities of attention with the keep-mask of the site's
full [b, a_total, s, S] mask (:mod:`colonnade.models.dropout_attention`; S = s in training,
a_total = every query head of the model), element (batch, head, query i, key j) a pure function
of those coordinates (:class:`colonnade.parallel.rng.MaskStream`). Ring attention (and the ring
inside hierarchical cp) computes a query chunk's attention one key chunk at a time, so a block
of query rows [q0, q0 + n_q) over keys [k0, k0 + n_k) of the rank's heads
[head_offset, head_offset + a) draws exactly that box of the full mask: every (query, key) pair
gets the single-process run's decision whichever rank and ring step computes it, and backward
redraws the same box from the same stream (a value saved at forward, immune to later changes
of the tracker's context).

The kernels take Z = keep / (1 - p) ([b, a, n_q, n_k], the lse dtype) and apply it after the
softmax (:mod:`colonnade.context_parallel.kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colonnade.parallel.rng import MaskStream


@dataclass(frozen=True)
class BlockDropout:
    """The dropout of one attention call: ``stream`` (its site's mask in the current step and
    micro-batch, drop probability ``stream.p``), ``heads_total`` query heads of the model,
    ``head_offset`` the index of the call's first query head among them, ``seq`` the full
    sequence length s (queries and keys)."""

    stream: MaskStream
    heads_total: int
    head_offset: int
    seq: int

    def __post_init__(self) -> None:
        if not 0.0 < self.stream.p < 1.0:
            raise ValueError(f"attention dropout p={self.stream.p} must be in (0, 1)")

    def scaled_keep(self, batch: int, heads: int, q0: int, n_q: int, k0: int, n_k: int,
                    dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Z = keep / (1 - p) of queries q0 .. q0 + n_q - 1 over keys k0 .. k0 + n_k - 1 (global
        positions) for the call's ``heads`` heads: [b, heads, n_q, n_k] in ``dtype``."""
        full = (batch, self.heads_total, self.seq, self.seq)
        index = (slice(None), slice(self.head_offset, self.head_offset + heads),
                 slice(q0, q0 + n_q), slice(k0, k0 + n_k))
        keep = self.stream.keep(full, index, device)  # [b, heads, n_q, n_k] bool
        return keep.to(dtype) * (1.0 / (1.0 - self.stream.p))
