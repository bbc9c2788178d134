"""Joining the job, and where it starts: resuming after a restart or a re-run.

Start-up and steady state need different timeouts. Ranks of one job start seconds (on a busy
machine, tens of seconds; on a large cluster, minutes) apart; a collective in the middle of
training should fail fast when a peer is gone. So every rank first waits in a store barrier
(:func:`join_barrier`) for all the others under ``max(parallel.timeout_s, STARTUP_TIMEOUT_S)``,
and only then creates the default group, with ``parallel.timeout_s`` given at creation (as
:class:`~colonnade.parallel.groups.ProcessGroups` gives it to every later group). No timeout is
changed afterwards (torch has no public API for that).

NCCL's failure handling is torch's own, set up by :func:`torch_nccl_env` before any group
exists (the launcher exports it to its ranks; a rank started by torchrun sets it itself).

Restarts: the elastic launcher restarts every rank after a failure (``--max-restarts K``) with
``TORCHELASTIC_RESTART_COUNT`` = k. On a restart, :func:`resume_config` points
``checkpoint.load`` at ``checkpoint.save``, whose ``latest`` marker names the last committed
checkpoint, so the job continues from there instead of from scratch.

Re-runs take the same path: a command re-run into a ``checkpoint.save`` that holds its own
checkpoints resumes from the latest (same [model], data and seed; ``checkpoint.on_existing``
decides for another run's), keeping the checkpoint's global batch when the run does not set
one, so a new layout re-derives its micro-batches and the data order stays exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from colonnade.config.sections import Config
from colonnade.device import backend_for, pick_device

STARTUP_TIMEOUT_S = 900.0
"""Longest wait for every rank to join the default group (torchrun's rendezvous default)."""
NCCL_TRACE_ENTRIES = 2000
"""Collectives kept per rank by torch's flight recorder (TORCH_FR_BUFFER_SIZE)."""


def torch_nccl_env(run_dir: str | Path) -> dict[str, str]:
    """Torch's own NCCL failure handling (environment variables that torch reads when it makes
    an NCCL group; not Colonnade switches):

    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: when a collective fails or exceeds
      ``parallel.timeout_s``, torch's NCCL watchdog thread ends the process (SIGABRT) instead
      of leaving it waiting forever (``wait()`` only orders streams, so no Python call could
      raise); 3 skips aborting the communicators first, which can itself hang when a peer is
      gone. It is torch's default; the elastic agent would otherwise set 1.
    * ``TORCH_FR_BUFFER_SIZE`` (formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``, which torch 2.13
      warns about): the flight recorder keeps the last :data:`NCCL_TRACE_ENTRIES` collectives
      of every group (sequence numbers, sizes, state).
    * ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: on a timeout the watchdog writes that record before
      ending the process ...
    * ``TORCH_FR_DUMP_TEMP_FILE`` (formerly ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``): ... to
      ``logging.dir/failures/nccl_trace_rank_<r>`` (torch appends the rank), next to
      Colonnade's own failure records; read them with ``python -m
      torch.distributed.flight_recorder.fr_trace`` to see which rank did not join.
    """
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
            "TORCH_FR_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(Path(run_dir).resolve() / "failures"
                                           / "nccl_trace_rank_")}


def set_torch_nccl_env(run_dir: str | Path) -> dict[str, str]:
    """Put :func:`torch_nccl_env` into this process's environment (and so its children's),
    keeping any value the user set; returns what was set."""
    added = {k: v for k, v in torch_nccl_env(run_dir).items() if k not in os.environ}
    os.environ.update(added)
    return added


def join_barrier(store: dist.Store, rank: int, world: int, timeout: timedelta) -> None:
    """Wait until all ``world`` ranks have reached this point (a store barrier, O(world) keys:
    each rank counts itself in, the last one opens the barrier)."""
    if store.add("joined", 1) == world:
        store.set("all_joined", str(rank))
    store.wait(["all_joined"], timeout)


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
    if backend == "nccl":
        set_torch_nccl_env(config.logging.dir)  # torchrun: no launcher of ours set it
    store, rank, world = next(rendezvous("env://", timeout=startup))
    store = dist.PrefixStore(f"colonnade/attempt{attempt}", store)
    join_barrier(store, rank, world, startup)  # every rank is here: creation is quick
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=config.parallel.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return True


def latest_checkpoint(root: str | Path | None) -> Path | None:
    """The checkpoint the ``latest`` marker under ``root`` names, or None; None too while a run
    with checkpoint.on_existing=overwrite is replacing the checkpoints there and has committed
    none of its own (none of them is a run's to resume or to compare with)."""
    from colonnade.checkpoint.commit import pending_replacement, read_latest

    if not root or not Path(root).is_dir() or pending_replacement(root) is not None:
        return None
    return read_latest(Path(root))


def _run_differences(config: Config, ckpt: Path) -> list[str]:
    """How the run that wrote ``ckpt`` differs from ``config``: the tensor-deciding [model]
    fields and the data (input, prepared_dir, blend, tokenizer, seed)."""
    from colonnade.checkpoint.finetune import model_mismatch
    from colonnade.config.load import ConfigError, load_config

    meta = json.loads((ckpt / "metadata.json").read_text())
    out = model_mismatch(meta.get("model", {}), config.model)
    try:
        saved = load_config(ckpt / "config.toml")
    except (ConfigError, OSError):
        return out  # an older checkpoint: the model is all that can be compared
    pairs = [(f"data.{n}", getattr(saved.data, n), getattr(config.data, n))
             for n in ("input", "prepared_dir", "blend", "tokenizer")]
    pairs.append(("training.seed", saved.training.seed, config.training.seed))
    for name, theirs, ours in pairs:
        same = theirs == ours
        if isinstance(theirs, str) and isinstance(ours, str):
            same = Path(theirs).resolve() == Path(ours).resolve()
        if not same:
            out.append(f"{name}={ours!r} (checkpoint: {theirs!r})")
    return out


def _keep_global_batch(config: Config, ckpt: Path) -> tuple[Config, str]:
    """Resuming: keep the checkpoint's global batch when the run does not set one (a new layout
    re-derives the micro-batches from it; the sampler's data order depends only on it).

    A micro-batch count set in the config (``training.microbatches``) is re-derived too when
    it would change the global batch in this layout (a config file's count was written for
    the layout that saved); the note names it. Only ``training.global_batch_size`` changes the
    global batch of a resumed run."""
    from colonnade.config.load import ConfigError, load_config

    tr = config.training
    try:
        saved = load_config(ckpt / "config.toml").training.global_batch_size
    except (ConfigError, OSError):
        return config, ""
    if saved is None or tr.global_batch_size is not None:
        note = "" if saved in (None, tr.global_batch_size) else (
            f"; training.global_batch_size {saved} -> {tr.global_batch_size} as set")
        return config, note
    training = dataclasses.replace(tr, global_batch_size=saved, microbatches=None)
    config = dataclasses.replace(config, training=training)
    note = f"; keeping its global batch {saved}"
    if tr.microbatches is not None:  # re-derived: resolve() checks that the layout divides it
        note += (f" (training.microbatches={tr.microbatches} is re-derived from it for this "
                 "layout; set --training.global_batch_size to change the global batch)")
    return config, note


def resume_config(config: Config, attempt: int) -> tuple[Config, str]:
    """Where the run starts; returns (config, note). One path for the first start, a re-run of
    the same command and a restart (``--max-restarts``, ``attempt`` > 0).

    When ``checkpoint.save`` holds committed checkpoints, ``checkpoint.on_existing`` decides:
    'auto' resumes from the latest when it is this run's (same model and data) and refuses
    another run's; 'resume' resumes from it (same model and seed needed, other data paths
    allowed); 'overwrite' starts fresh (they are deleted once its first checkpoint is
    committed); 'refuse' stops. A restart always resumes from the latest. Checkpoints that an
    'overwrite' run is replacing before its first commit are never resumed
    (:func:`_replacing_start`). Raises :class:`CheckpointError` naming the fix; reads files,
    writes none.
    """
    from colonnade.checkpoint.commit import pending_replacement
    from colonnade.checkpoint.format import CheckpointError

    ck = config.checkpoint
    save = ck.save
    latest = latest_checkpoint(save)
    replacing = pending_replacement(save)
    if replacing is not None:
        return _replacing_start(config, attempt, replacing)
    memory = ", unless the memory snapshots hold a newer step" if ck.memory_interval else ""
    if latest is None:
        if attempt > 0:
            start = ck.load or ck.init_from or "scratch"
            return config, (f"restart {attempt}: no committed checkpoint under checkpoint.save="
                            f"{save}; starting again from {start}{memory}")
        return _with_load(config, ck.load, "") if ck.load else (config, "")
    if attempt == 0 and ck.on_existing == "overwrite":
        return _with_load(config, ck.load, "") if ck.load else (config, "")
    if attempt == 0 and ck.on_existing == "refuse":
        raise CheckpointError(
            f"checkpoint.save={save} already holds checkpoints (latest {latest.name}) and "
            f"checkpoint.on_existing='refuse'. Pick a new {new_save_option(config)}, or set "
            "--checkpoint.on_existing=resume to continue from it or =overwrite to replace it.")
    diff = _run_differences(config, latest)
    resumable = not any(d.startswith(("model.", "training.seed")) for d in diff)
    if attempt == 0 and diff and (ck.on_existing == "auto" or not resumable):
        raise CheckpointError(
            f"checkpoint.save={save} holds another run's checkpoints (latest {latest.name}): "
            f"{'; '.join(diff)}. Pick a new {new_save_option(config)} for this run, or set "
            "--checkpoint.on_existing=overwrite to start fresh and replace them (deleted once "
            "it saves)"
            + (" or =resume to continue from them on this data" if resumable else "") + ".")
    prefix = f"restart {attempt}: resuming" if attempt > 0 else "resuming"
    return _with_load(config, save, f"{prefix} from {latest}{memory if attempt else ''}")


def _replacing_start(config: Config, attempt: int, names: list[str]) -> tuple[Config, str]:
    """Start of a run whose checkpoint.save holds checkpoints ``names`` that a run with
    checkpoint.on_existing='overwrite' began replacing and has not yet replaced (it committed
    nothing): a restart of that run and a re-run that overwrites start fresh; any other re-run
    is refused, so none resumes from them by mistake."""
    from colonnade.checkpoint.commit import LATEST, REPLACED, REPLACING, read_latest
    from colonnade.checkpoint.format import CheckpointError

    ck = config.checkpoint
    if attempt > 0:
        start = ck.load or ck.init_from or "scratch"
        return config, (f"restart {attempt}: no checkpoint of this run under checkpoint.save="
                        f"{ck.save} yet (the {len(names)} earlier one(s) it replaces are kept "
                        f"until its first save); starting again from {start}")
    if ck.on_existing == "overwrite":
        return _with_load(config, ck.load, "") if ck.load else (config, "")
    root = Path(ck.save or "")
    marker, held = root / REPLACING, f"{len(names)} checkpoint(s)"
    if names:
        held += f" ({names[0]} .. {names[-1]})"
    start_again = ("Re-run with --checkpoint.on_existing=overwrite to start that run again (they "
                   f"are deleted once it saves), or pick a new {new_save_option(config)}")
    if read_latest(root) is None:  # its first save was under way: `latest` is already gone
        aside = sorted(p.name for p in root.glob("*" + REPLACED))
        raise CheckpointError(
            f"checkpoint.save={ck.save} holds {held} that a run with "
            "checkpoint.on_existing=overwrite began replacing; it stopped during its first save, "
            f"after the earlier {LATEST} marker was removed"
            + (f" and {', '.join(aside)} set aside" if aside else "")
            + f" ({marker} lists what it replaces), so there is nothing to resume from. "
            f"{start_again}.")
    raise CheckpointError(
        f"checkpoint.save={ck.save} holds {held} that a run with "
        "checkpoint.on_existing=overwrite began replacing; it stopped before its first save, so "
        f"they are kept as they were ({marker} lists them). {start_again}; to resume from them "
        f"instead, remove {marker}.")


def new_save_option(config: Config) -> str:
    """The option that gives a run another checkpoint.save, for a message's fix: --logging.dir
    when it is the default (<logging.dir>/checkpoints), else --checkpoint.save."""
    from colonnade.config.validate import default_save_dir

    save = config.checkpoint.save
    if save and Path(save) == default_save_dir(config.logging.dir):
        return "--logging.dir (checkpoints go to its checkpoints/) or --checkpoint.save"
    return "--checkpoint.save"


def _with_load(config: Config, load: str | None, note: str) -> tuple[Config, str]:
    """``config`` resuming from ``load`` with the checkpoint's global batch kept."""
    from colonnade.checkpoint.commit import resolve_checkpoint
    from colonnade.checkpoint.format import CheckpointError

    ckpt = dataclasses.replace(config.checkpoint, load=load)
    config = dataclasses.replace(config, checkpoint=ckpt)
    try:
        path = resolve_checkpoint(load) if load else None
    except CheckpointError:
        return config, note  # not a Colonnade checkpoint: the loader reports it in full
    if path is None or not (path / "config.toml").is_file():
        return config, note
    config, batch = _keep_global_batch(config, path)
    return config, (note + batch if note or not batch else f"checkpoint.load={load}{batch}")
