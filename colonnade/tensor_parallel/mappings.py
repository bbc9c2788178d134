"""Autograd operators that move activations between tensor-parallel regions.

Named after the operators of the papers (Shoeybi et al. 2019, Korthikanti et al. 2022):

  f      (:class:`OpF`)      forward identity,           backward all-reduce over tp
  g      (:class:`OpG`)      forward all-reduce over tp, backward identity
  g_sp   (:class:`OpGSeq`)   forward all-gather along the sequence dim 0, backward reduce-scatter
  gbar   (:class:`OpGBarSeq`) forward reduce-scatter along dim 0, backward all-gather
  split  (:class:`OpSplitSeq`) forward keep this rank's sequence chunk, backward all-gather
  gather_last (:class:`OpGatherLast`) forward all-gather along the last dim, backward split
  split_last  (:class:`OpSplitLast`)  forward keep this rank's slice of the last dim, backward
                                      all-gather along it

Activations are [s, b, h]; the sequence is dim 0 so the sp collectives work on contiguous
blocks. Every collective goes through :class:`~colonnade.parallel.comm.CommGroup`.

With one tp rank every operator is the identity, and the functions below return their input
itself: no autograd node is made and no CommGroup method is called (degree 1 costs nothing).
"""

from __future__ import annotations

from typing import Any

import torch

from colonnade.parallel.comm import CommGroup


def seq_all_gather(x: torch.Tensor, group: CommGroup, name: str = "sp_gather") -> torch.Tensor:
    """[s/tp, ...] on each rank -> [s, ...] (rank order)."""
    if group.size == 1:
        return x
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))  # [s, b, h]
    group.all_gather_into(out, x.contiguous(), name=name)
    return out


def seq_reduce_scatter(x: torch.Tensor, group: CommGroup,
                       name: str = "sp_reduce_scatter") -> torch.Tensor:
    """[s, ...] partial sums -> this rank's [s/tp, ...] chunk of the sum."""
    if group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by tp={group.size}")
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))  # [s/tp, b, h]
    group.reduce_scatter_into(out, x.contiguous(), name=name)
    return out


def seq_split(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """[s, ...] -> this rank's [s/tp, ...] chunk (no communication)."""
    if group.size == 1:
        return x
    return x.chunk(group.size, dim=0)[group.rank].contiguous()


def last_all_gather(x: torch.Tensor, group: CommGroup, name: str) -> torch.Tensor:
    """[..., n/tp] on each rank -> [..., n] (rank order along the last dim)."""
    if group.size == 1:
        return x
    moved = x.movedim(-1, 0).contiguous()  # [n/tp, ...]
    out = seq_all_gather(moved, group, name)  # [n, ...]
    return out.movedim(0, -1).contiguous()


def all_reduce_sum(x: torch.Tensor, group: CommGroup, name: str) -> torch.Tensor:
    """Sum over the group (returns a new tensor; the input is not modified)."""
    if group.size == 1:
        return x
    out = x.clone()
    group.all_reduce(out, name=name)
    return out


class OpF(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad, ctx.group, "f_bwd"), None


class OpG(torch.autograd.Function):
    """g: all-reduce forward, identity backward.

    The forward sums a contiguous input in place (marked dirty), as Megatron's _reduce does:
    its callers pass the fresh partial product of a row-parallel matmul (or of the vocab-
    parallel embedding), which nothing else reads, so no [s, b, h] copy is made per layer.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        if not x.is_contiguous():
            return all_reduce_sum(x, group, "g_fwd")
        group.all_reduce(x, name="g_fwd")
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class OpGSeq(torch.autograd.Function):
    """g (sequence parallel): all-gather along dim 0 forward, reduce-scatter backward (also
    the MoE all-gather dispatcher's token gather, under its own names)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, name: str,
                grad_name: str) -> torch.Tensor:
        ctx.group, ctx.grad_name = group, grad_name
        return seq_all_gather(x, group, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return seq_reduce_scatter(grad, ctx.group, ctx.grad_name), None, None, None


class OpGBarSeq(torch.autograd.Function):
    """g-bar (sequence parallel): reduce-scatter along dim 0 forward, all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, name: str,
                grad_name: str) -> torch.Tensor:
        ctx.group, ctx.grad_name = group, grad_name
        return seq_reduce_scatter(x, group, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return seq_all_gather(grad, ctx.group, ctx.grad_name), None, None, None


class OpSplitSeq(torch.autograd.Function):
    """Keep this rank's sequence chunk forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        return seq_split(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return seq_all_gather(grad, ctx.group, "sp_split_bwd"), None


class OpGatherLast(torch.autograd.Function):
    """All-gather along the last dim forward ([..., n/tp] -> [..., n]); split it backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        return last_all_gather(x, group, "gather_last")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        if group.size == 1:
            return grad, None
        return grad.chunk(group.size, dim=-1)[group.rank].contiguous(), None


class OpSplitLast(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward ([..., n] -> [..., n/tp]); all-gather
    the gradient along it backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        if group.size == 1:
            return x
        if x.shape[-1] % group.size:
            raise ValueError(f"last dim {x.shape[-1]} not divisible by tp={group.size}")
        return x.chunk(group.size, dim=-1)[group.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return last_all_gather(grad, ctx.group, "split_last_bwd"), None


def copy_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """f (the identity, no autograd node, when tp = 1)."""
    return x if group.size == 1 else OpF.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """g (the identity, no autograd node, when tp = 1); ``x`` (a fresh partial sum that no
    one else reads) is summed in place."""
    return x if group.size == 1 else OpG.apply(x, group)


def gather_seq(x: torch.Tensor, group: CommGroup, name: str = "sp_gather",
               grad_name: str = "sp_gather_bwd") -> torch.Tensor:
    """g of sequence parallelism (the identity for a group of one); ``name`` / ``grad_name``
    label the forward all-gather and the backward reduce-scatter in the comm stats."""
    return x if group.size == 1 else OpGSeq.apply(x, group, name, grad_name)


def reduce_scatter_seq(x: torch.Tensor, group: CommGroup, name: str = "sp_reduce_scatter",
                       grad_name: str = "sp_reduce_scatter_bwd") -> torch.Tensor:
    """g-bar of sequence parallelism (the identity for a group of one); names as in
    :func:`gather_seq`."""
    return x if group.size == 1 else OpGBarSeq.apply(x, group, name, grad_name)


def split_seq(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Enter a sequence-parallel region from a replicated one (the identity when tp = 1)."""
    return x if group.size == 1 else OpSplitSeq.apply(x, group)


def gather_last(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Leave a tp region along the last dim (e.g. gather_output of a column layer); the
    identity when tp = 1."""
    return x if group.size == 1 else OpGatherLast.apply(x, group)


def split_last(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Enter a tp region along the last dim (a row layer whose input is not yet parallel);
    the identity when tp = 1."""
    return x if group.size == 1 else OpSplitLast.apply(x, group)
