"""Model and optimizer tensors <-> logical pieces, for any parallel layout.

Who writes what (each logical element is written exactly once), all from each parameter's
:class:`~colonnade.tensor_parallel.sharding.Sharding` and this rank's coordinates
(:func:`rank_coords`): a piece is written by the ranks that split it (each its box) and, of the
ranks holding identical copies, by index 0 of every replicated axis (``Sharding.owns``: tp rank
0 of a tp-replicated parameter, dp rank 0 of the dp replicas; an expert weight, split over ep,
has expert-view coordinates: its ep shard is written by expert_dp rank 0 of the ranks holding
it, and with ZeRO each rank of its expert shard group writes its range of the expert
optimizer state); the last stage's copy of a tied embedding never (``tied_copy``: it equals the
first stage's). With a dp-sharded optimizer (ZeRO-1/2/3) every rank of the shard group (expert
weights: the expert shard group) writes the flat ranges of the optimizer state it owns; under
hybrid sharding (``zero_shard_size``) only index 0 of the replicate group (an expert weight's:
the expert replicate group) does (the other replicas hold the same ranges). ZeRO-3 parameters
have no full local tensor: each rank writes, the same way, the flat ranges ``[lo, hi)`` of each
flattened local tp shard it keeps (``DataParallel.owned_param_segments``); stages 0-2 keep one
replicated local shard per tp rank, written by dp rank 0.

Loading reads, for each of this rank's parameters, the box of its shard (ZeRO-3: only the
flat ranges its shard holds), and the flat range its optimizer asks for, whatever layout and
stage wrote them: a stored piece is a box or a flat range of a box, and a request is cut out
of whatever pieces meet it (:mod:`.reads`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from colonnade.checkpoint.format import DTYPES, CheckpointReader, Entry
from colonnade.checkpoint.optim_state import (
    OptimSlice,
    dp_sharded,
    load_logical_state,
    logical_state,
)
from colonnade.checkpoint.pieces import Piece, flat_piece, pad_to_local, valid_part
from colonnade.models.params import unique_params
from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel.sharding import Coords, Sharding, tp_coords


def model_name(key: str) -> str:
    """Logical name of a parameter's values."""
    return f"model/{key}"


def optim_name(key: str, state: str) -> str:
    """Logical name of one optimizer state of a parameter."""
    return f"optim/{key}/{state}"


def is_expert(sharding: Sharding) -> bool:
    """An expert weight (split over ep): it lives in the expert view of the layout."""
    return "ep" in sharding.split_axes


def rank_coords(groups: ProcessGroups, dp: bool = False,
                sharding: Sharding | None = None) -> dict[str, tuple[int, int]]:
    """This rank's coordinates on the axes a checkpoint distinguishes, for ``sharding``'s
    parameter (None: a dense one).

    Dense view: tp (which splits or replicates each parameter) and, with ``dp``, the dp x cp
    replicas (dp rank 0 writes). Expert view (:func:`is_expert`): ep (which experts, block
    ``ep_rank`` of dim 0), the expert tp group as "tp" (degree 1 today) and, with ``dp``, the
    expert_dp replicas (edp rank 0 writes each expert piece, once per ep shard)."""
    if sharding is not None and is_expert(sharding):
        return _expert_coords(groups, dp)
    coords = tp_coords(groups.tp.rank, groups.tp.size)
    if dp:
        coords["dp"] = (groups.dp_cp.rank, groups.dp_cp.size)
    return coords


def _expert_coords(groups: ProcessGroups, dp: bool) -> dict[str, tuple[int, int]]:
    """Expert-view coordinates: {"ep", "tp" (expert tp), "dp" (expert dp, with ``dp``)};
    groups built without the expert groups count as ep = 1, expert_dp = dp x cp."""
    ep, etp = groups.ep, groups.expert_tp
    coords = {"ep": (ep.rank, ep.size) if ep is not None else (0, 1),
              "tp": (etp.rank, etp.size) if etp is not None else (0, 1)}
    if dp:
        edp = groups.expert_dp if groups.expert_dp is not None else groups.dp_cp
        coords["dp"] = (edp.rank, edp.size)
    return coords


def shard_coords(groups: ProcessGroups,
                 sharding: Sharding | None = None) -> dict[str, tuple[int, int]]:
    """Coordinates of a rank writing ZeRO shards (its own flat ranges) of ``sharding``'s
    parameter: tp (expert: ep and expert tp; ZeRO shards expert state over expert_dp, so
    every expert_dp rank writes), and under hybrid sharding the replicate group (an expert
    parameter's: the expert replicate group) as a replicated axis, so only its index 0
    writes."""
    coords = rank_coords(groups, sharding=sharding)
    expert = sharding is not None and is_expert(sharding)
    replicate = groups.expert_zero_replicate if expert else groups.zero_replicate
    if replicate is not None and replicate.size > 1:
        coords["dp"] = (max(replicate.rank, 0), replicate.size)
    return coords


def _param_shards(ddp: Any) -> Any:
    """The ZeRO-3 :class:`ParamShards` of a DataParallel (None: parameters are whole)."""
    return getattr(ddp, "param_shards", None) if ddp is not None else None


def _whole_params(chunks: list[nn.Module], ddp: Any) -> list[nn.Parameter]:
    """The parameters whose full local tensor exists: all of them, or with ZeRO-3 those the
    shards do not hold (not trained, e.g. the sigmoid router's selection bias)."""
    params = unique_params(chunks)
    if _param_shards(ddp) is None:
        return params
    held = {id(p) for p in ddp.buffers.params}
    return [p for p in params if id(p) not in held]


def model_entries(chunks: list[nn.Module], groups: ProcessGroups,
                  ddp: Any = None) -> list[Entry]:
    """The model pieces this rank writes (views of the live parameters, and with ZeRO-3 of
    ``ddp``'s persistent shard: :func:`sharded_model_entries`)."""
    out = sharded_model_entries(ddp, groups) if _param_shards(ddp) is not None else []
    for p in _whole_params(chunks, ddp):
        s: Sharding = p.sharding  # type: ignore[attr-defined]
        entry = shard_entry(model_name(s.key), p.detach(), s, rank_coords(groups, True, s))
        if entry is not None:
            out.append(entry)
    return out


def sharded_model_entries(ddp: Any, groups: ProcessGroups) -> list[Entry]:
    """ZeRO-3: the flat ranges of parameters this rank's shard holds, as pieces.

    ``ddp.owned_param_segments()`` gives (param, lo, hi, values [hi - lo]): elements
    [lo, hi) of the flattened padded local tp shard. Each becomes the piece
    :func:`flat_piece` describes (padding rows cut off; a range of padding only is dropped),
    written by every shard-group rank and, of hybrid replicas, by replicate index 0."""
    out = []
    for p, lo, hi, values in ddp.owned_param_segments():
        s: Sharding = p.sharding
        coords = shard_coords(groups, s)
        if not s.owns(coords):
            continue
        piece, keep = flat_piece(s, coords, (lo, hi))
        if keep is None:
            continue
        data = values.detach()[keep[0]:keep[1]]  # [kept elements]
        if piece.flat is None:  # the range is the whole shard
            data = data.reshape(piece.shape)
        out.append(Entry(model_name(s.key), data, piece, s.full_shape))
    return out


def shard_entry(name: str, local: torch.Tensor, sharding: Sharding,
                coords: Coords) -> Entry | None:
    """The piece a rank at ``coords`` writes of its shard ``local`` [local_shape] of a tensor:
    its box (padding cut off), or None when another rank writes it (a replica) or the box is
    empty (a shard of padding only)."""
    if not sharding.owns(coords):
        return None
    offsets, shape = sharding.box(coords)
    if 0 in shape:
        return None
    return Entry(name, valid_part(local, sharding, coords), Piece(offsets, shape),
                 sharding.full_shape)


def optim_entries(optimizer: Any, groups: ProcessGroups) -> list[Entry]:
    """The optimizer-state pieces this rank writes (views of the live state); with a
    dp-sharded optimizer (ZeRO-1) every dp rank writes the ranges it owns."""
    sharded = dp_sharded(optimizer)
    out = []
    for key, states in logical_state(optimizer).items():
        for state, sl in states.items():
            coords = (shard_coords(groups, sl.sharding) if sharded
                      else rank_coords(groups, True, sl.sharding))
            entry = _optim_entry(key, state, sl, coords)
            if entry is not None:
                out.append(entry)
    return out


def _optim_entry(key: str, state: str, sl: OptimSlice, coords: Coords) -> Entry | None:
    s = sl.sharding
    if not s.owns(coords):
        return None
    piece, keep = flat_piece(s, coords, sl.flat)
    if keep is None:
        return None
    if sl.flat is None:
        data = valid_part(sl.tensor.detach(), s, coords)
    else:
        data = sl.tensor.detach().reshape(-1)[keep[0]:keep[1]]
        if piece.flat is None:  # the range is the whole shard
            data = data.reshape(piece.shape)
    return Entry(optim_name(key, state), data, piece, s.full_shape)


def read_local(reader: CheckpointReader, name: str, sharding: Sharding, coords: Coords,
               dtype: torch.dtype | None = None,
               flat: tuple[int, int] | None = None) -> torch.Tensor:
    """This rank's local shard (zero padded) of a stored tensor, or only the flat range
    ``flat`` of the padded local shard's flattening (1-D): only those elements are read.

    Padding rows lie at the end of dim 0 (vocabulary), so the box's values are a prefix of the
    local shard's flattening and the rest of a range is zeros (see :func:`flat_piece`)."""
    reader.check_shape(name, sharding.full_shape)
    box = sharding.box(coords)
    if flat is None:
        if 0 in box[1]:
            return torch.zeros(sharding.local_shape(coords), dtype=dtype)
        return pad_to_local(reader.read_box(name, box, dtype), sharding, coords)
    flat_piece(sharding, coords, flat)  # rejects ranges over padding along another dim
    lo, hi = flat
    end = min(hi, math.prod(box[1]))
    if end <= lo:
        return torch.zeros(hi - lo, dtype=dtype or _stored_dtype(reader, name))
    values = reader.read(name, box, (lo, end), dtype)
    if end == hi:
        return values
    return torch.cat([values, values.new_zeros(hi - end)])


def _stored_dtype(reader: CheckpointReader, name: str) -> torch.dtype:
    return DTYPES[reader.tensors[name]["dtype"]]


def load_model(reader: CheckpointReader, chunks: list[nn.Module], groups: ProcessGroups,
               ddp: Any = None) -> None:
    """Copy every parameter of this rank's chunks from the checkpoint (any saved layout and
    stage); with ZeRO-3 (``ddp.param_shards``) only the ranges of this rank's shard, and
    whole the parameters the shards do not hold (not trained)."""
    shards = _param_shards(ddp)
    if shards is not None:
        shards.free_all()  # a bucket still gathered would keep the old values
        with torch.no_grad():
            for p, lo, hi, values in ddp.owned_param_segments():
                s = p.sharding
                value = read_local(reader, model_name(s.key), s, rank_coords(groups, sharding=s),
                                   values.dtype, (lo, hi))
                values.copy_(value.to(values.device))  # [hi - lo]
    for p in _whole_params(chunks, ddp):
        s: Sharding = p.sharding  # type: ignore[attr-defined]
        value = read_local(reader, model_name(s.key), s, rank_coords(groups, sharding=s),
                           p.dtype)
        with torch.no_grad():
            p.copy_(value.to(p.device))


def load_optimizer(reader: CheckpointReader | None, optimizer: Any, chunks: list[nn.Module],
                   groups: ProcessGroups, step_count: int) -> list[str]:
    """Fill the optimizer from the checkpoint; ``reader=None`` (or missing state) re-syncs
    masters from the model parameters and zeroes the moments. Returns the loader's notes
    (states cast to another dtype: :func:`load_logical_state`)."""
    shardings = {p.sharding.key: p.sharding for p in unique_params(chunks)}  # type: ignore[attr-defined]
    optimizer.step_count = step_count

    def read(key: str, state: str, flat: tuple[int, int] | None) -> torch.Tensor | None:
        name = optim_name(key, state)
        if reader is None or not reader.has(name):
            return None
        s = shardings[key]
        return read_local(reader, name, s, rank_coords(groups, sharding=s), flat=flat)

    return load_logical_state(optimizer, read)
