"""One rank's training state as a memory snapshot holds it: tensors plus a small JSON header.

A snapshot is taken at a step boundary (after the optimizer step) and is only ever restored
into the same layout, so it holds this rank's *local* storage as it is, with no resharding:

* ``model.owned.<i>``: the parameter values this rank owns, range i of
  ``DataParallel.owned_ranges()`` (no ZeRO: the whole flat buffer ``[N]``; ZeRO-1/2: this
  rank's dp ranges of it, the other ranges being gathered from their owners on restore;
  ZeRO-3: the persistent shard); model dtype.
* ``optim.exp_avg`` / ``optim.exp_avg_sq`` ``[owned AdamW elements]``, ``optim.momentum``
  ``[owned Muon elements]``, ``optim.master`` ``[shard]`` (only with separate fp32 masters):
  the optimizer's flat state (:meth:`DistributedOptimizer.state_dict`).
* ``param.<chunk>.<name>``: parameters outside the flat buffers (not trained by the optimizer
  but maybe updated in place, e.g. a sigmoid router's ``expert_bias``), and
  ``buffer.<chunk>.<name>``: the chunks' persistent buffers (non-persistent ones, such as the
  RoPE tables, are recomputed at build and not kept);
* ``rng.cpu`` and, on an accelerator, ``rng.device``: the default generators' states.

The header holds the step, the optimizer's step count and state start, the loss scaler, the
sampler position, the dropout RNG tracker, the run's elapsed seconds, and the layout
fingerprint (:func:`layout_fingerprint`): world size and the [parallel], [model], [optim]
sections and training.precision, hashed. Together these decide the continuation exactly
(dropout masks are a pure function of (seed, site, step, micro-batch); the data order of
(seed, consumed samples)), so a restored run's losses equal the uninterrupted run's bit for bit.

Bytes of a snapshot (:func:`state_bytes`), per rank: ``P_owned * b_param + S_optim +
B_other + R_rng``, where ``S_optim = DistributedOptimizer.state_bytes()`` (AdamW: two
moments per owned element, Muon: one, plus fp32 masters when separate), ``B_other`` the
parameters outside the flat buffers and the persistent buffers, ``R_rng`` the generator
states (5,056 bytes for the CPU's).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from colonnade import device as dev
from colonnade.checkpoint.state import TrainState
from colonnade.config.load import config_to_dict
from colonnade.config.sections import Config

SNAPSHOT_FORMAT = 1
"""Version of the snapshot header (bumped when its meaning changes)."""


def layout_fingerprint(config: Config, world: int) -> str:
    """A short hash of what a snapshot's tensors depend on: the world size and the
    [parallel], [model], [optim] sections and training.precision. Equal fingerprints: the
    snapshot's local tensors fit this rank's storage element for element."""
    full = config_to_dict(config)
    what = {"world": world, "parallel": full["parallel"], "model": full["model"],
            "optim": full["optim"], "precision": config.training.precision}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _scaler(trainer: TrainState) -> Any:
    scaler = getattr(trainer, "scaler", None)
    return scaler if scaler is not None else getattr(trainer.optimizer, "scaler", None)


def _device(trainer: TrainState) -> torch.device:
    return torch.device(getattr(trainer.optimizer, "device", "cpu"))


def state_tensors(trainer: TrainState) -> dict[str, torch.Tensor]:
    """The live tensors of this rank's snapshot (views of its storage, not copies): see the
    module docstring for the names and shapes."""
    opt = trainer.optimizer
    out: dict[str, torch.Tensor] = {}
    for i, values in enumerate(opt.ddp.owned_params()):
        out[f"model.owned.{i}"] = values  # [hi - lo] model dtype
    flat = {"exp_avg": opt.exp_avg_flat, "exp_avg_sq": opt.exp_avg_sq_flat,
            "momentum": opt.momentum_flat, "master": opt.master_flat}
    for name, t in flat.items():
        if t is not None and t.numel():
            out[f"optim.{name}"] = t
    out.update(_other_tensors(trainer))
    out["rng.cpu"] = torch.get_rng_state()
    device = _device(trainer)
    if device.type != "cpu":
        out["rng.device"] = dev.get_rng_state(device)
    return out


def _other_tensors(trainer: TrainState) -> dict[str, torch.Tensor]:
    """Parameters outside the flat buffers and persistent buffers, by chunk."""
    slots = trainer.optimizer.ddp.buffers.slots  # id(param) -> its place in the flat buffers
    out: dict[str, torch.Tensor] = {}
    for c, chunk in enumerate(trainer.chunks):
        for name, p in chunk.named_parameters():
            if id(p) not in slots:
                out[f"param.{c}.{name}"] = p.data
        for prefix, module in chunk.named_modules():
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    out[f"buffer.{c}.{prefix}.{name}".replace("..", ".")] = buf
    return out


def state_bytes(trainer: TrainState) -> int:
    """Bytes of this rank's snapshot tensors (the formula of the module docstring)."""
    return sum(t.numel() * t.element_size() for t in state_tensors(trainer).values())


def state_header(trainer: TrainState, fingerprint: str, run_id: str) -> dict[str, Any]:
    """The JSON header of this rank's snapshot at ``trainer.step``."""
    opt = trainer.optimizer
    data = getattr(trainer, "data", None)
    scaler = _scaler(trainer)
    return {"format": SNAPSHOT_FORMAT, "step": int(trainer.step), "run_id": run_id,
            "fingerprint": fingerprint, "rank": trainer.groups.world.rank,
            "step_count": int(opt.step_count), "state_start": int(getattr(opt, "state_start", 0)),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "sampler": data.sampler.state_dict() if data is not None else None,
            "rng": trainer.chunks[0].ctx.rng.state_dict(),
            "elapsed_s": float(getattr(trainer, "elapsed_s", 0.0))}


@torch.no_grad()
def apply_state(trainer: TrainState, tensors: dict[str, torch.Tensor],
                header: dict[str, Any]) -> None:
    """Put a snapshot of this rank (same layout) into ``trainer``: every tensor copied into
    the live storage it came from, the header's counters restored, then the ZeRO-1/2
    parameter ranges gathered from their owners (collective over the dp shard groups, the same
    on every rank since every rank restores)."""
    live = state_tensors(trainer)
    missing = sorted(set(live) ^ set(tensors))
    if missing:
        raise ValueError(f"snapshot of rank {header.get('rank')} does not fit this rank's "
                         f"state: tensors {', '.join(missing[:5])} differ")
    device = _device(trainer)
    for name, t in tensors.items():
        if name == "rng.cpu":
            torch.set_rng_state(t)
        elif name == "rng.device":
            dev.set_rng_state(t, device)
        else:
            live[name].copy_(t)
    opt = trainer.optimizer
    opt.step_count = int(header["step_count"])
    opt.state_start = int(header["state_start"])
    scaler = _scaler(trainer)
    if scaler is not None and header.get("scaler") is not None:
        scaler.load_state_dict(header["scaler"])
    data = getattr(trainer, "data", None)
    if data is not None and header.get("sampler") is not None:
        data.sampler.load_state_dict(header["sampler"])
    trainer.chunks[0].ctx.rng.load_state_dict(header["rng"])
    trainer.step = int(header["step"])
    trainer.elapsed_s = float(header.get("elapsed_s") or 0.0)
    opt.ddp.start_param_gather()  # ZeRO-1/2: the other ranges from their owners
    opt.ddp.finish_param_gather()
