"""Model and optimizer tensors <-> logical pieces, for any parallel layout.

Who writes what (each logical element is written exactly once):

* model parameters: dp rank 0 only (dp ranks hold replicas); a tp-sharded parameter by every
  tp rank (its box), a tp-replicated one by tp rank 0; the last stage's copy of a tied
  embedding never (it equals the first stage's);
* optimizer state: the same rule, except that with a dp-sharded optimizer (ZeRO-1) every dp
  rank writes the flat ranges it owns.

Loading reads, for each of this rank's parameters, the box of its tp shard (and the flat range
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
    read_key,
    writes_param,
)
from colonnade.checkpoint.pieces import Piece, flat_piece, pad_to_local, shard_box, valid_part
from colonnade.models.params import unique_params
from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel.sharding import Sharding


def model_name(key: str) -> str:
    """Logical name of a parameter's values."""
    return f"model/{key}"


def optim_name(key: str, state: str) -> str:
    """Logical name of one optimizer state of a parameter."""
    return f"optim/{key}/{state}"


def model_entries(chunks: list[nn.Module], groups: ProcessGroups) -> list[Entry]:
    """The model pieces this rank writes (views of the live parameters)."""
    if groups.dp_cp.rank != 0:
        return []
    tp_rank, tp = groups.tp.rank, groups.tp.size
    out = []
    for p in unique_params(chunks):
        s: Sharding = p.sharding  # type: ignore[attr-defined]
        if not writes_param(s) or (s.dim is None and tp_rank != 0):
            continue
        offsets, shape = shard_box(s, tp_rank, tp)
        if 0 in shape:
            continue
        data = valid_part(p.detach(), s, tp_rank, tp)
        out.append(Entry(model_name(s.key), data, Piece(offsets, shape), s.full_shape))
    return out


def optim_entries(optimizer: Any, groups: ProcessGroups) -> list[Entry]:
    """The optimizer-state pieces this rank writes (views of the live state)."""
    sharded = dp_sharded(optimizer)
    if not sharded and groups.dp_cp.rank != 0:
        return []
    tp_rank, tp = groups.tp.rank, groups.tp.size
    out = []
    for key, states in logical_state(optimizer).items():
        for state, sl in states.items():
            entry = _optim_entry(key, state, sl, tp_rank, tp)
            if entry is not None:
                out.append(entry)
    return out


def _optim_entry(key: str, state: str, sl: OptimSlice, tp_rank: int, tp: int) -> Entry | None:
    s = sl.sharding
    if not writes_param(s) or (s.dim is None and tp_rank != 0):
        return None
    piece, keep = flat_piece(s, tp_rank, tp, sl.flat)
    if keep is None:
        return None
    if sl.flat is None:
        data = valid_part(sl.tensor.detach(), s, tp_rank, tp)
    else:
        data = sl.tensor.detach().reshape(-1)[keep[0]:keep[1]]
        if piece.flat is None:  # the range is the whole shard
            data = data.reshape(piece.shape)
    return Entry(optim_name(key, state), data, piece, s.full_shape)


def read_local(reader: CheckpointReader, name: str, sharding: Sharding, tp_rank: int, tp: int,
               dtype: torch.dtype | None = None,
               flat: tuple[int, int] | None = None) -> torch.Tensor:
    """This tp rank's local shard (zero padded) of a stored tensor, or only the flat range
    ``flat`` of the padded local shard's flattening (1-D): only those elements are read.

    Padding rows lie at the end of dim 0 (vocabulary), so the box's values are a prefix of the
    local shard's flattening and the rest of a range is zeros (see :func:`flat_piece`)."""
    reader.check_shape(name, sharding.full_shape)
    box = shard_box(sharding, tp_rank, tp)
    if flat is None:
        if 0 in box[1]:
            return torch.zeros(sharding.local_shape(tp), dtype=dtype)
        return pad_to_local(reader.read_box(name, box, dtype), sharding, tp)
    flat_piece(sharding, tp_rank, tp, flat)  # rejects ranges over padding along another dim
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
    tp_rank, tp = groups.tp.rank, groups.tp.size
    for p in unique_params(chunks):
        s: Sharding = p.sharding  # type: ignore[attr-defined]
        value = read_local(reader, model_name(read_key(s)), s, tp_rank, tp, p.dtype)
        with torch.no_grad():
            p.copy_(value.to(p.device))


def load_optimizer(reader: CheckpointReader | None, optimizer: Any, chunks: list[nn.Module],
                   groups: ProcessGroups, step_count: int) -> None:
    """Fill the optimizer from the checkpoint; ``reader=None`` (or missing state) re-syncs
    masters from the model parameters and zeroes the moments."""
    tp_rank, tp = groups.tp.rank, groups.tp.size
    shardings = {p.sharding.key: p.sharding for p in unique_params(chunks)}  # type: ignore[attr-defined]
    optimizer.step_count = step_count

    def read(key: str, state: str, flat: tuple[int, int] | None) -> torch.Tensor | None:
        name = optim_name(key, state)
        if reader is None or not reader.has(name):
            return None
        sharding = shardings.get(key)
        if sharding is None:  # a tied copy asks under its tie target
            sharding = next(s for s in shardings.values() if read_key(s) == key)
        return read_local(reader, name, sharding, tp_rank, tp, flat=flat)

    load_logical_state(optimizer, read)
