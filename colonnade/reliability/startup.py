"""Joining the job and resuming after a restart.

Start-up and steady state need different timeouts. Ranks of one job start seconds (on a busy
machine, tens of seconds; on a large cluster, minutes) apart, and the default group's
construction waits for all of them; a collective in the middle of training should fail fast
when a peer is gone. So the default group is created with ``max(parallel.timeout_s,
STARTUP_TIMEOUT_S)`` and then set to ``parallel.timeout_s`` (groups made later by
:class:`~colonnade.parallel.groups.ProcessGroups` get ``parallel.timeout_s`` directly).

Restarts: the elastic launcher restarts every rank after a failure (``--max-restarts K``) with
``TORCHELASTIC_RESTART_COUNT`` = k. On a restart, :func:`resume_config` points
``checkpoint.load`` at ``checkpoint.save``, whose ``latest`` marker names the last committed
checkpoint, so the job continues from there instead of from scratch.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from colonnade.config.sections import Config
from colonnade.device import backend_for, pick_device
from colonnade.parallel.comm import set_timeout

STARTUP_TIMEOUT_S = 900.0
"""Longest wait for every rank to join the default group (torchrun's rendezvous default)."""


def init_distributed(config: Config) -> bool:
    """Join the default process group when launched with WORLD_SIZE > 1; True if it did.

    The store (env:// rendezvous: MASTER_ADDR / MASTER_PORT) is prefixed with the restart
    count: the elastic agent keeps one store across restarts, and without the prefix a restarted
    rank could read a dead rank's address left by the previous attempt.
    """
    from torch.distributed.rendezvous import rendezvous

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return False
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    device = pick_device(config.training.device, int(os.environ.get("LOCAL_RANK", "0")))
    backend = backend_for(device, config.parallel.backend)
    startup = timedelta(seconds=max(config.parallel.timeout_s, STARTUP_TIMEOUT_S))
    store, rank, world = next(rendezvous("env://", timeout=startup))
    store = dist.PrefixStore(f"colonnade/attempt{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=startup,
                            device_id=device if device.type == "cuda" else None)
    set_timeout(None, config.parallel.timeout_s)
    return True


def latest_checkpoint(root: str | Path | None) -> Path | None:
    """The checkpoint the ``latest`` marker under ``root`` names, or None."""
    if not root or not Path(root).is_dir():
        return None
    from colonnade.checkpoint.commit import read_latest

    return read_latest(Path(root))


def resume_config(config: Config, attempt: int) -> tuple[Config, str]:
    """On a restart, load from ``checkpoint.save``'s latest checkpoint; returns (config, note).

    The first attempt runs the config as given. A restart without any committed checkpoint
    starts again from ``checkpoint.load`` (or from scratch) and says so.
    """
    if attempt == 0:
        return config, ""
    save = config.checkpoint.save
    latest = latest_checkpoint(save)
    if latest is None:
        start = config.checkpoint.load or "scratch"
        return config, (f"restart {attempt}: no committed checkpoint under checkpoint.save="
                        f"{save}; starting again from {start}")
    ckpt = dataclasses.replace(config.checkpoint, load=save)
    return (dataclasses.replace(config, checkpoint=ckpt),
            f"restart {attempt}: resuming from {latest}")
