"""Whole tensors: gather tp shards into full tensors, and load a checkpoint's full model into the
single-process model (``colonnade generate``). Loading never unpickles.

ZeRO-3 (``DataParallel.param_shards``): a parameter has no full local tensor outside a gather;
:func:`full_state` with ``ddp`` rebuilds one tensor at a time: its local tp (ep) shard from the
flat ranges each rank of its shard group keeps (``DataParallel.local_param``: an all-reduce of
the zero-filled shard holding this rank's ranges, exact, every element written by one rank),
then the tp (ep) all-gather. Without ``ddp`` a freed ZeRO-3 parameter is refused, naming both
ways out.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colonnade.config.sections import Config
from colonnade.models.build import build_reference
from colonnade.models.gpt import ModelChunk
from colonnade.parallel.comm import CommGroup
from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel.sharding import Sharding


def gather_full(t: torch.Tensor, sharding: Sharding, group: CommGroup,
                ep: CommGroup | None = None, etp: CommGroup | None = None) -> torch.Tensor:
    """All-gather the tp shards of a tensor and undo padding: the logical full tensor (a
    parameter split over no other axis, or one whose other axes have degree 1). An expert
    weight (split over "ep" on dim 0, [E/ep, ...] here, and over expert tp along
    ``sharding.dim``) is gathered over ``etp`` along that dim, then over ``ep``: [E, ...]."""
    check_materialised(t, sharding)
    if "ep" in sharding.split_axes:
        out = t.detach()
        if sharding.dim is not None:
            out = _cat_over(out, sharding.dim, etp, "gather_full_experts")  # [E/ep, ...]
        return sharding.unshard([_cat_over(out, 0, ep, "gather_full_experts")], {})  # [E, ...]
    if sharding.dim is None or group.size == 1:
        return sharding.unshard([t.detach()], {})
    moved = t.detach().movedim(sharding.dim, 0).contiguous()  # [n/tp, ...]
    out = moved.new_empty((moved.shape[0] * group.size, *moved.shape[1:]))
    group.all_gather_into(out, moved, name="gather_full")
    shards = [c.movedim(0, sharding.dim) for c in out.chunk(group.size, dim=0)]
    return sharding.unshard(shards, {"tp": group.size})


def _cat_over(t: torch.Tensor, dim: int, group: CommGroup | None, name: str) -> torch.Tensor:
    """The group's blocks of ``t`` concatenated along ``dim`` in rank order (all-gather; ``t``
    itself without a group or for a group of one)."""
    if group is None or group.size == 1:
        return t
    moved = t.movedim(dim, 0).contiguous()  # [n/g, ...]
    out = moved.new_empty((moved.shape[0] * group.size, *moved.shape[1:]))  # [n, ...]
    group.all_gather_into(out, moved, name=name)
    return out.movedim(0, dim)


def check_materialised(t: torch.Tensor, sharding: Sharding) -> None:
    """Refuse a ZeRO-3 parameter whose bucket is freed (no values on this rank)."""
    if t.numel() and t.untyped_storage().nbytes() == 0:
        raise ValueError(f"{sharding.key}: the parameter is a freed ZeRO-3 shard "
                         "(parallel.zero_stage=3) with no full values on this rank; call "
                         "full_state(chunks, groups, ddp) (gathers one tensor at a time) or "
                         "read a checkpoint (colonnade convert / --to-hf read it one tensor "
                         "at a time)")


def full_state(chunks: list[nn.Module], groups: ProcessGroups,
               ddp: Any = None) -> dict[str, torch.Tensor]:
    """Full tensors of this pipeline rank's parameters, keyed by global name (a tied head is
    the embedding's Parameter, or on a later stage its copy under the embedding's key).

    With ZeRO-3 pass the run's ``ddp``: each tensor is rebuilt on its own
    (``ddp.local_param``, then the tp gather), so besides the result at most one tensor's
    full local shard is alive at a time."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            sharding: Sharding = p.sharding  # type: ignore[attr-defined]
            local = p if ddp is None else ddp.local_param(p)
            out[sharding.key] = gather_full(local, sharding, groups.tp, groups.ep,
                                            groups.expert_tp).contiguous()
    return out


def load_exported(directory: str | Path, dtype: torch.dtype = torch.float32,
                  device: torch.device | None = None) -> tuple[Config, ModelChunk]:
    """The single-process model of a checkpoint (root with ``latest``, or a step directory)
    written by training or ``colonnade convert``; its model tensors are read whole. Its GEMMs
    run in the model's dtype whatever ``training.fp8`` trained it (float8 is a training
    recipe: generation and export match transformers' full-precision model)."""
    directory = Path(directory)
    if not ((directory / "latest").exists() or (directory / "index.json").exists()):
        raise FileNotFoundError(f"{directory}: not a checkpoint directory (neither index.json "
                                "nor a `latest` marker; train with --checkpoint.save=DIR)")
    from colonnade.checkpoint.commit import resolve_checkpoint
    from colonnade.checkpoint.convert import read_full_model

    config, state = read_full_model(resolve_checkpoint(directory))
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, dp=1, tp=1, pp=1, vp=1, cp=1, sp=False, pipeline_layout=None,
        schedule="1f1b"), training=dataclasses.replace(config.training, fp8="off"))
    model = build_reference(config, dtype=dtype, device=device)
    load_full_state(model, state)
    return config, model


def load_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a single-process model, naming any missing or misshapen tensor."""
    for p in model.parameters():
        sharding: Sharding = p.sharding  # type: ignore[attr-defined]
        if sharding.key not in state:
            raise KeyError(f"tensor '{sharding.key}' missing from the checkpoint")
        value = state[sharding.key]
        if tuple(value.shape) != sharding.full_shape:
            raise ValueError(f"tensor '{sharding.key}': checkpoint shape {tuple(value.shape)} "
                             f"!= model shape {sharding.full_shape}")
        with torch.no_grad():
            p.copy_(sharding.shard(value.to(p.dtype), {}))
