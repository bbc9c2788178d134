"""Gradient reductions that complete a step's gradients after backward (Megatron's
``finalize_model_grads``), in one place.

The data-parallel reduction (bucketed, overlapped with backward) lives in
:mod:`colonnade.data_parallel.ddp`. After it two partial-sum cases remain:
* sequence parallelism: tp-replicated parameters (norms, row-parallel biases, gpt2 positions)
  saw only this rank's sequence chunk, so their gradients are summed across tp;
* norms over tp-split heads (``tp_partial_grad``, Qwen3's q/k norm weights [d]): each rank
  applied them to its own heads only, so their gradients are summed across tp whether or not
  sp is on (the sum over every rank's heads is the single-process gradient);
* expert weights (an "ep" split) live in the expert view, where "tp" is the expert tp group:
  a partial one (the routed experts' down bias under expert tp, added to this rank's own rows
  only) is summed across expert_tp, never across the dense tp group (a different group unless
  expert_tp = tp in Megatron's default folding);
* tied embeddings with pp > 1: the first stage's embedding and the last stage's head (its
  ``tied_copy``, under the same key) hold the same logical weight; their gradients are summed
  across the embedding group.
Both are sums over disjoint groups, so their order does not matter.

ZeRO-2/3 (``ddp`` given, its stage >= 2): there is no full gradient; the sums run on this
rank's owned shard pieces of those parameters. The buffer layout is the same on every tp rank
(same parameter shapes) and the tied weight has a bucket of its own on both pp ends, so the
owned pieces coincide across the group being summed over.
"""

from __future__ import annotations

import torch
from torch import nn

from colonnade.data_parallel.ddp import TIED_KEYS, DataParallel
from colonnade.models.params import grad_of, unique_params
from colonnade.parallel.comm import CommGroup
from colonnade.parallel.groups import ProcessGroups


def _is_partial(p: nn.Parameter) -> bool:
    """A gradient that is a partial sum over tp (:attr:`Sharding.partial_over_tp`)."""
    return bool(getattr(getattr(p, "sharding", None), "partial_over_tp", False))


def _is_expert(p: nn.Parameter) -> bool:
    """An expert weight (its Sharding splits over "ep"): "tp" means expert tp for it."""
    sharding = getattr(p, "sharding", None)
    return sharding is not None and "ep" in sharding.split_axes


def _tp_of(p: nn.Parameter, groups: ProcessGroups) -> CommGroup | None:
    """The group a partial gradient of ``p`` is summed over (None: not partial, or the group
    has one rank): tp for a dense parameter, expert_tp for an expert one."""
    if not _is_partial(p):
        return None
    group = groups.expert_tp if _is_expert(p) else groups.tp
    return group if group is not None and group.size > 1 else None


def _is_tied(p: nn.Parameter) -> bool:
    return getattr(getattr(p, "sharding", None), "key", None) in TIED_KEYS


def reduce_sp_and_tied(chunks: list[nn.Module], groups: ProcessGroups, tied: bool,
                       ddp: DataParallel | None = None) -> None:
    """All-reduce tp-partial gradients (sp-partial ones and those of norms over tp-split
    heads) over tp, partial expert gradients over expert_tp, and tied-embedding gradients
    over pp ends
    (nothing is looked at when neither group has more than one rank). ZeRO-2/3 (``ddp``):
    on the owned shard pieces of those parameters."""
    tied = tied and groups.pp.size > 1 and groups.embedding.size > 1
    etp = groups.expert_tp.size if groups.expert_tp is not None else 1
    if groups.tp.size == 1 and etp == 1 and not tied:
        return
    if ddp is not None and ddp.grad_shards is not None:
        _reduce_shards(ddp, groups, tied)
        return
    params = unique_params(chunks)
    for group in _partial_groups(groups):
        grads = [grad_of(p) for p in params if _tp_of(p, groups) is group]
        _all_reduce_flat([g for g in grads if g is not None], group.all_reduce,
                         "sp_grads" if group is groups.tp else "expert_tp_grads")
    if tied:
        grads = [grad_of(p) for p in params if _is_tied(p)]
        _all_reduce_flat([g for g in grads if g is not None], groups.embedding.all_reduce,
                         "tied_embedding")


def _partial_groups(groups: ProcessGroups) -> list[CommGroup]:
    """The groups partial gradients are summed over, those with more than one rank: tp, then
    expert_tp (its own CommGroup even where its ranks equal tp's: each sums its own
    parameters)."""
    out = [groups.tp]
    if groups.expert_tp is not None and groups.expert_tp is not groups.tp:
        out.append(groups.expert_tp)
    return [g for g in out if g.size > 1]


def _reduce_shards(ddp: DataParallel, groups: ProcessGroups, tied: bool) -> None:
    """The same sums on the owned pieces [a, b) of each parameter's shard gradient."""
    partial: dict[int, list[torch.Tensor]] = {id(g): [] for g in _partial_groups(groups)}
    tied_grads = []
    buffers = ddp.buffers
    for (lo, hi), grad in zip(ddp.owned_ranges(), ddp.owned_grads(), strict=True):
        for p, a, b in buffers.segments(lo, hi):
            piece = grad[a - lo:b - lo]  # [b - a]
            group = _tp_of(p, groups)
            if group is not None:
                partial[id(group)].append(piece)
            if tied and _is_tied(p):
                tied_grads.append(piece)
    for group in _partial_groups(groups):
        _all_reduce_flat(partial[id(group)], group.all_reduce,
                         "sp_grads" if group is groups.tp else "expert_tp_grads")
    _all_reduce_flat(tied_grads, groups.embedding.all_reduce, "tied_embedding")


def _all_reduce_flat(grads: list[torch.Tensor], reduce: object, name: str) -> None:
    """Fuse ``grads`` into one buffer, all-reduce it, scatter the result back (one contiguous
    gradient, e.g. the tied embedding's on a stage, is reduced in place: no copies)."""
    if not grads:
        return
    if len(grads) == 1 and grads[0].is_contiguous():
        reduce(grads[0], name=name)  # type: ignore[operator]
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduce(flat, name=name)  # type: ignore[operator]
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
