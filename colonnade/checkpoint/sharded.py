"""Model and optimizer tensors <-> logical pieces, for any parallel layout.

Who writes what (each logical element is written exactly once), all from each parameter's
:class:`~colonnade.tensor_parallel.sharding.Sharding` and this rank's coordinates
(:func:`rank_coords`): a piece is written by the ranks that split it (each its box) and, of the
ranks holding identical copies, by index 0 of every replicated axis (``Sharding.owns``: tp rank
0 of a tp-replicated parameter, dp rank 0 of the dp replicas); the last stage's copy of a tied
embedding never (``tied_copy``: it equals the first stage's). With a dp-sharded optimizer
(ZeRO-1) every dp rank writes the flat ranges of the optimizer state it owns.

Loading reads, for each of this rank's parameters, the box of its shard (and the flat range
its optimizer asks for), whatever layout wrote them.
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


def rank_coords(groups: ProcessGroups, dp: bool = False) -> dict[str, tuple[int, int]]:
    """This rank's coordinates on the axes a checkpoint distinguishes: tp (which splits or
    replicates each parameter) and, with ``dp``, the dp x cp replicas (dp rank 0 writes)."""
    coords = tp_coords(groups.tp.rank, groups.tp.size)
    if dp:
        coords["dp"] = (groups.dp_cp.rank, groups.dp_cp.size)
    return coords


def model_entries(chunks: list[nn.Module], groups: ProcessGroups) -> list[Entry]:
    """The model pieces this rank writes (views of the live parameters)."""
    coords = rank_coords(groups, dp=True)
    entries = (shard_entry(model_name(p.sharding.key), p.detach(), p.sharding, coords)
               for p in unique_params(chunks))  # type: ignore[attr-defined]
    return [e for e in entries if e is not None]


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
    coords = rank_coords(groups, dp=not dp_sharded(optimizer))
    out = []
    for key, states in logical_state(optimizer).items():
        for state, sl in states.items():
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


def load_model(reader: CheckpointReader, chunks: list[nn.Module], groups: ProcessGroups) -> None:
    """Copy every parameter of this rank's chunks from the checkpoint (any saved layout)."""
    coords = rank_coords(groups)
    for p in unique_params(chunks):
        s: Sharding = p.sharding  # type: ignore[attr-defined]
        value = read_local(reader, model_name(s.key), s, coords, p.dtype)
        with torch.no_grad():
            p.copy_(value.to(p.device))


def load_optimizer(reader: CheckpointReader | None, optimizer: Any, chunks: list[nn.Module],
                   groups: ProcessGroups, step_count: int) -> None:
    """Fill the optimizer from the checkpoint; ``reader=None`` (or missing state) re-syncs
    masters from the model parameters and zeroes the moments."""
    coords = rank_coords(groups)
    shardings = {p.sharding.key: p.sharding for p in unique_params(chunks)}  # type: ignore[attr-defined]
    optimizer.step_count = step_count

    def read(key: str, state: str, flat: tuple[int, int] | None) -> torch.Tensor | None:
        name = optim_name(key, state)
        if reader is None or not reader.has(name):
            return None
        return read_local(reader, name, shardings[key], coords, flat=flat)

    load_logical_state(optimizer, read)
