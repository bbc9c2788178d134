"""All-to-all over a :class:`~colonnade.parallel.comm.CommGroup`, plain and differentiable.

The exchange that mixture-of-experts layers use to send tokens to the ranks that hold their
experts (dispatch) and back (combine), and all-to-all context parallelism uses to trade a
sequence split for a head split. Rows are dim 0: rank i's input ``x`` [t_i, ...] is cut into
n consecutive blocks of ``in_splits[0..n-1]`` rows; block j goes to rank j, and rank i's output
[sum_j out_splits[j], ...] holds the blocks received from ranks 0..n-1 in rank order, where
``out_splits[j]`` on rank i equals ``in_splits[i]`` on rank j.

Operator (named after the papers' dispatch/combine all-to-all, GShard, Lepikhin et al. 2020):

  a2a  (:class:`OpAllToAll`)  forward all-to-all with splits (s_in, s_out), backward the
                              all-to-all of the output gradient with the splits swapped
                              (s_out, s_in): the exchange is a permutation of rows, and the
                              adjoint of a permutation is its inverse.

Gloo (torch 2.13) and NCCL both implement ``all_to_all_single`` with equal and with variable
splits, synchronously and asynchronously, so there is no fallback path.
"""

from __future__ import annotations

from typing import Any

import torch

from colonnade.parallel.comm import CommGroup


def exchange_splits(in_splits: list[int], group: CommGroup, name: str = "splits",
                    device: torch.device | None = None) -> list[int]:
    """Every rank's ``in_splits`` -> this rank's ``out_splits``: ``out[j]`` = the rows rank j
    sends here. One equal-split all-to-all of n int64 counts (8 (n-1) wire bytes), on
    ``device`` (NCCL moves only device tensors: pass the data's device there)."""
    if len(in_splits) != group.size:
        raise ValueError(f"{len(in_splits)} split sizes for group '{group.name}' of "
                         f"{group.size} ranks; give one per rank")
    send = torch.tensor(in_splits, dtype=torch.int64, device=device)  # [n]
    recv = torch.empty_like(send)  # [n]
    group.all_to_all(recv, send, name=name)
    return [int(v) for v in recv.tolist()]


def all_to_all_rows(x: torch.Tensor, group: CommGroup, in_splits: list[int] | None = None,
                    out_splits: list[int] | None = None, name: str = "a2a") -> torch.Tensor:
    """[t_in, ...] -> [t_out, ...] (no autograd). Splits None: t_in / n rows to every rank
    (t_out = t_in); else both split lists are needed (see :func:`exchange_splits`)."""
    if (in_splits is None) != (out_splits is None):
        raise ValueError("give both in_splits and out_splits, or neither (equal splits)")
    if in_splits is None:
        if x.shape[0] % group.size:
            raise ValueError(f"all_to_all({name}) of {x.shape[0]} rows over group "
                             f"'{group.name}' of {group.size} ranks: rows must divide evenly "
                             "for equal splits; pass in_splits/out_splits")
        rows = x.shape[0]
    else:
        assert out_splits is not None
        if sum(in_splits) != x.shape[0] or len(in_splits) != group.size:
            raise ValueError(f"all_to_all({name}): in_splits {in_splits} must have "
                             f"{group.size} entries summing to the {x.shape[0]} rows of x")
        rows = sum(out_splits)
    out = x.new_empty((rows, *x.shape[1:]))  # [t_out, ...]
    group.all_to_all(out, x.contiguous(), in_splits=in_splits, out_splits=out_splits, name=name)
    return out


class OpAllToAll(torch.autograd.Function):
    """a2a: forward all-to-all (s_in, s_out), backward all-to-all (s_out, s_in)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, in_splits: list[int] | None,
                out_splits: list[int] | None, name: str) -> torch.Tensor:
        ctx.group, ctx.splits, ctx.name = group, (in_splits, out_splits), name
        return all_to_all_rows(x, group, in_splits, out_splits, name)  # [t_out, ...]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = grads  # [t_out, ...]
        in_splits, out_splits = ctx.splits
        dx = all_to_all_rows(grad, ctx.group, out_splits, in_splits, f"{ctx.name}_grad")
        return dx, None, None, None, None  # dx: [t_in, ...]


def all_to_all(x: torch.Tensor, group: CommGroup, in_splits: list[int] | None = None,
               out_splits: list[int] | None = None, name: str = "a2a") -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` [t_in, ...] -> [t_out, ...].

    ``in_splits`` None: equal splits. ``in_splits`` without ``out_splits``: the output splits
    are exchanged first (:func:`exchange_splits`, one small all-to-all). A group of one rank
    returns ``x`` itself.
    """
    if group.size == 1:
        return x
    if in_splits is not None and out_splits is None:
        out_splits = exchange_splits(in_splits, group, f"{name}_splits", x.device)
    out: torch.Tensor = OpAllToAll.apply(x, group, in_splits, out_splits, name)
    return out
