"""Optimizer state in logical, layout-independent form.

The checkpoint never sees an optimizer's buffers. An optimizer exposes two methods:

``logical_state() -> dict[str, dict[str, OptimSlice]]``
    global parameter key -> state name -> the values this rank owns: its tp shard
    (``flat=None``) or a flat range ``[start, end)`` of the row-major flattening of its
    (padded) local tp shard (a ZeRO-1 rank's part of the bucket). ``master`` may be left out
    when it *is* the model parameter (fp32 / fp64 runs). The state names are the optimizer's:
    each parameter's are those of the update it takes (AdamW: ``master``, ``exp_avg``,
    ``exp_avg_sq``; a Muon matrix: ``master``, ``momentum``), so a checkpoint stores
    ``optim/<key>/<name>`` for exactly those and a loader asks for its own (a state the
    checkpoint lacks starts at zero).
``load_logical_state(read: StateReader) -> list[str] | None``
    ``read(key, name, flat)`` returns the values the optimizer asks for, shaped like its local
    tp shard (``flat=None``, zero padded) or 1-D for a flat range; ``None`` when the checkpoint
    has no such state (a model-only checkpoint: masters are then re-copied from the model
    parameters and moments start at zero). It may return notes for the resume's log line
    (a state cast to another dtype).
plus the attributes ``step_count: int`` and ``dp_sharded: bool`` (True when every dp rank owns
a disjoint part, as with ZeRO-1/2/3; False when dp ranks hold replicas, so dp rank 0 alone
writes; hybrid sharding's replicas of a shard: replicate index 0 writes).

The last stage's copy of a tied embedding has the embedding's key (``Sharding.tied_copy``): it
reads the embedding's state and the checkpoint writer leaves it out (``Sharding.owns``).

:func:`logical_state` / :func:`load_logical_state` call those methods, and adapt
:class:`~colonnade.optim.distributed.DistributedOptimizer` (its ``shard_state()`` ranges of the
flat buffers) when it does not have them: there the names are the keys of the views each
owned piece of ``shard_state()`` carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from colonnade.tensor_parallel.sharding import Sharding

MASTER = "master"
"""The state name of the master weights (left out where they are the model parameters)."""


@dataclass
class OptimSlice:
    """Values of one optimizer state this rank owns (see the module docstring)."""

    tensor: torch.Tensor
    sharding: Sharding
    flat: tuple[int, int] | None = None


StateReader = Callable[[str, str, tuple[int, int] | None], torch.Tensor | None]


def logical_state(optimizer: Any) -> dict[str, dict[str, OptimSlice]]:
    """This rank's optimizer state in logical form (the optimizer's own method if it has one)."""
    if hasattr(optimizer, "logical_state"):
        return optimizer.logical_state()
    return _flat_logical_state(optimizer)


def load_logical_state(optimizer: Any, read: StateReader) -> list[str]:
    """Fill an optimizer from logical state (its own method if it has one); returns notes for
    the run's log (a state cast to another dtype, masters not kept), one per kind."""
    if hasattr(optimizer, "load_logical_state"):
        return optimizer.load_logical_state(read) or []
    return _flat_load_logical_state(optimizer, read)


def state_names(optimizer: Any) -> dict[str, list[str]]:
    """Parameter key -> the names of the state this rank holds of it (sorted; parameters
    with no owned element on this rank are absent): what a checkpoint records."""
    return {key: sorted(states) for key, states in logical_state(optimizer).items()}


def dp_sharded(optimizer: Any) -> bool:
    """Whether dp ranks own disjoint parts of the optimizer state (ZeRO stage >= 1)."""
    if hasattr(optimizer, "dp_sharded"):
        return bool(optimizer.dp_sharded)
    ddp = getattr(optimizer, "ddp", None)
    return bool(getattr(ddp, "sharded", False))


def _flat_params(optimizer: Any) -> dict[str, Any]:
    """key -> parameter of a flat-buffer optimizer (:class:`DistributedOptimizer`)."""
    return {p.sharding.key: p for p in optimizer.ddp.buffers.params}


def _flat_logical_state(opt: Any) -> dict[str, dict[str, OptimSlice]]:
    """Adapter for ``DistributedOptimizer.shard_state()``: (key, lo, hi, views) per owned
    range [lo, hi) of a flattened local tp shard (the whole shard without ZeRO-1)."""
    params = _flat_params(opt)
    out: dict[str, dict[str, OptimSlice]] = {}
    for key, lo, hi, views in opt.shard_state():
        sharding: Sharding = params[key].sharding
        if hi <= lo:
            continue
        if key in out:
            raise AssertionError(f"{key}: two owned ranges on one rank")
        out[key] = {n: OptimSlice(v.detach(), sharding, (lo, hi)) for n, v in views.items()
                    if n != MASTER or opt.own_masters}
    return out


def _model_values(opt: Any) -> dict[tuple[str, int, int], torch.Tensor]:
    """(key, lo, hi) -> the model's values of that owned range (1-D): the persistent storage
    ``ddp.owned_param_segments()`` names (ZeRO-3: the shard; a ZeRO-3 parameter has no full
    local tensor to slice)."""
    segments = getattr(opt.ddp, "owned_param_segments", None)
    if segments is None:
        params = _flat_params(opt)
        return {(key, lo, hi): params[key].detach().reshape(-1)[lo:hi]
                for key, lo, hi, _ in opt.shard_state()}
    return {(p.sharding.key, lo, hi): values for p, lo, hi, values in segments()}


def _flat_load_logical_state(opt: Any, read: StateReader) -> list[str]:
    """Fill the owned ranges; a state stored in another dtype than the optimizer keeps it in
    (a run resumed with another optim.state_dtype / master_dtype) is cast, rounding to
    nearest, with one note per state name (returned)."""
    model: dict[tuple[str, int, int], torch.Tensor] | None = None
    notes: dict[str, str] = {}
    with torch.no_grad():
        for key, lo, hi, views in opt.shard_state():
            for name, view in views.items():
                if name == MASTER and not opt.own_masters:
                    _note_unused_masters(opt, read, key, (lo, hi), notes)
                    continue
                value = read(key, name, (lo, hi))
                if value is None and name == MASTER:
                    model = _model_values(opt) if model is None else model
                    value = model[(key, lo, hi)]
                elif value is None:
                    value = torch.zeros_like(view)
                elif value.dtype != view.dtype and name not in notes:
                    notes[name] = (f"optimizer state '{name}' was saved as {value.dtype} and is "
                                   f"cast to {view.dtype} (optim.state_dtype / "
                                   "master_dtype changed on resume)")
                view.copy_(value.to(view.device))
    return [n for n in notes.values() if n]


def _note_unused_masters(opt: Any, read: StateReader, key: str, flat: tuple[int, int],
                         notes: dict[str, str]) -> None:
    """Note once when a 16-bit model without its own masters (optim.master_dtype='bf16')
    resumes from a checkpoint that has fp32 masters: the parameters it loaded (the masters
    rounded to the model dtype) are the masters from now on."""
    buffers = opt.ddp.buffers
    if "master" in notes or buffers.param_dtype == buffers.grad_dtype:
        return
    notes["master"] = ""
    if read(key, "master", flat) is not None:
        notes["master"] = (f"the checkpoint's {buffers.grad_dtype} master weights are not kept: "
                           f"optim.master_dtype='bf16' makes the {buffers.param_dtype} "
                           "parameters the masters (the saved masters rounded to nearest)")
