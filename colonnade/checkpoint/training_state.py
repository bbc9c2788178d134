"""Save and resume a whole training run: tensors, step, data position, LR, scaler, RNG.

``metadata.json`` of a checkpoint::

    format_version, step, consumed_samples, sampler {...}, optimizer {step_count, lr,
    total_steps, schedule {total_steps, lr, min_lr, warmup_steps, decay, decay_fraction,
    decay_shape}, name, state_dtype, master_dtype, state_start, states {param key: [state
    names]}}, scaler {...} | null, rng {seed, step, microbatch}, layout {tp, pp, vp, dp,
    cp, cp_attention, cp_a2a_size, sp, zero, zero_shard_size, bucket_size, world_size},
    model {...the [model] section...}, elapsed_s (seconds of training of the whole run at the
    save, so a resume's clock goes on from it)
(cp is not part of the weights: every tensor is replicated over cp, written by cp index 0 of
the dp x cp replicas, and ZeRO shards over dp x cp reshard like dp's; the layout records it
for the reader only.)
(``zero`` is the effective ZeRO stage; checkpoints written before it carry ``zero1``, a bool,
read by :func:`zero_stage_of`).

Everything that decides the continuation is here or in the tensors: dropout masks are a pure
function of (seed, site, step, micro-batch) and the data order of (seed, consumed samples), so
resuming reproduces the uninterrupted run exactly, in the same or in another layout.
The LR is a pure function of the optimizer's ``step_count`` (stored) and the schedule, which
is stored too: resuming under another schedule is refused unless ``checkpoint.lr_schedule``
says which one to follow (:func:`schedule_change`).

Which optimizer wrote the state is stored too (``optimizer.name``, the precision fields of
``[optim]`` that shape its state, and the state names of every parameter: ``master``,
``exp_avg``, ``exp_avg_sq`` for AdamW, ``momentum`` for a Muon matrix; checkpoints older than
the field were written by AdamW). Resuming under another ``optim.name`` is refused unless
``checkpoint.optimizer_switch='reset'`` starts the new optimizer's state fresh
(:func:`optimizer_change`); ``state_start`` is the step count at which the state started
(AdamW's bias correction counts its steps from there).
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from colonnade.checkpoint.commit import (
    METADATA,
    PhaseHook,
    commit,
    prepare_tmp,
    resolve_checkpoint,
    step_dirname,
    wait_for_fragments,
)
from colonnade.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointReader,
    tokenizer_files,
    write_rank_shard,
)
from colonnade.checkpoint.optim_state import state_names
from colonnade.checkpoint.sharded import load_model, load_optimizer, model_entries, optim_entries
from colonnade.checkpoint.staging import HostStager, Staged
from colonnade.checkpoint.state import TrainState
from colonnade.config.load import config_to_dict, config_to_toml
from colonnade.config.sections import OptimConfig
from colonnade.optim.lr import SCHEDULE_FIELDS, lr_at, schedule_of, with_schedule


@dataclass
class PendingSave:
    """A save in progress (asynchronous) or done; :meth:`wait` re-raises its error."""

    path: Path
    thread: threading.Thread | None = None
    errors: list[BaseException] = field(default_factory=list)
    before: PendingSave | None = None
    """The asynchronous save still in flight when this one was staged: this one's writer
    waits for it before committing (commits stay in step order), takes over its errors and
    drops it."""
    stall_s: float = 0.0
    """Seconds the training thread spent inside :func:`save_training` for this save."""

    def done(self) -> bool:
        """Whether its writer (if any) has finished (never blocks)."""
        return self.thread is None or not self.thread.is_alive()

    def wait(self) -> Path:
        """Block until this rank's part (and, on rank 0, the commit) is done, and the saves
        in flight before it; re-raises the first error of any of them."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.join_before()
        if self.errors:
            raise self.errors[0]
        return self.path

    def join_before(self) -> None:
        """Wait for :attr:`before`, keep its errors, drop it."""
        before, self.before = self.before, None
        if before is not None:
            try:
                before.wait()
            except BaseException as err:  # an earlier save failed: reported by this one
                self.errors.append(err)


def _scaler(trainer: TrainState) -> Any:
    """The loss scaler (the trainer's or its optimizer's), if any."""
    scaler = getattr(trainer, "scaler", None)
    return scaler if scaler is not None else getattr(trainer.optimizer, "scaler", None)


def _finish_gathers(trainer: TrainState) -> None:
    """ZeRO-1 with overlapped param gathers: wait so parameters are complete."""
    ddp = getattr(trainer, "ddp", None)
    if ddp is not None and hasattr(ddp, "finish_param_gather"):
        ddp.finish_param_gather()


def _metadata(trainer: TrainState) -> dict[str, Any]:
    cfg, groups, opt = trainer.config, trainer.groups, trainer.optimizer
    data = getattr(trainer, "data", None)
    sampler = data.sampler.state_dict() if data is not None else None
    scaler = _scaler(trainer)
    step_count = int(opt.step_count)
    par = cfg.parallel
    return {
        "format_version": FORMAT_VERSION,
        "step": int(trainer.step),
        "consumed_samples": sampler["consumed_samples"] if sampler else None,
        "sampler": sampler,
        "optimizer": {"step_count": step_count, "total_steps": opt.total_steps,
                      "schedule": schedule_of(opt.total_steps, opt.cfg),
                      "lr": lr_at(max(0, step_count - 1), opt.total_steps, opt.cfg),
                      **optimizer_identity(opt.cfg),
                      "state_start": int(getattr(opt, "state_start", 0))},
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": trainer.chunks[0].ctx.rng.state_dict(),
        "layout": {"tp": groups.tp.size, "pp": groups.pp.size, "vp": par.vp,
                   "dp": groups.dp.size, "cp": groups.cp.size,
                   "cp_attention": par.cp_attention, "cp_a2a_size": par.cp_a2a_size,
                   "sp": par.sp,
                   "zero": par.zero, "zero_shard_size": par.zero_shard_size,
                   "bucket_size": par.bucket_size,
                   "world_size": groups.world.size},
        "model": config_to_dict(cfg)["model"],
        "elapsed_s": float(getattr(trainer, "elapsed_s", 0.0)),
    }


STATE_FIELDS: tuple[str, ...] = ("state_dtype", "master_dtype")
"""Fields of ``[optim]`` besides ``name`` that decide the form of the stored state (recorded,
not compared: a resume casts the stored values to this run's dtypes)."""


def optimizer_identity(cfg: OptimConfig) -> dict[str, Any]:
    """The optimizer a checkpoint's state belongs to: {"name", and each of
    :data:`STATE_FIELDS` this config has}."""
    out: dict[str, Any] = {"name": cfg.name}
    out.update({f: getattr(cfg, f) for f in STATE_FIELDS if hasattr(cfg, f)})
    return out


def saved_optimizer(meta: dict[str, Any]) -> str:
    """``optim.name`` of the run that wrote a checkpoint ('adamw' before it was recorded)."""
    return str((meta.get("optimizer") or {}).get("name") or "adamw")


def optimizer_change(meta: dict[str, Any], cfg: OptimConfig, ckpt: Path, mode: str) -> str:
    """Whether a resume loads the checkpoint's optimizer state: "" when it does (the same
    optimizer), else the line to log when ``mode`` is 'reset' (the state starts fresh);
    'check' raises :class:`CheckpointError` naming both optimizers and both fixes."""
    saved, now = saved_optimizer(meta), cfg.name
    if saved == now:
        return ""
    if mode == "reset":
        return (f"optimizer switched from {saved} (the checkpoint's) to {now}: weights, step "
                f"and data position loaded, {now}'s state starts fresh "
                "(checkpoint.optimizer_switch=reset)")
    raise CheckpointError(
        f"{ckpt} was written by the {saved} optimizer but this run sets optim.name={now}: "
        f"{saved}'s state cannot continue as {now}'s. Set --checkpoint.optimizer_switch=reset "
        f"to load the weights, step, LR schedule and data position and start {now}'s state "
        f"fresh, or --optim.name={saved} to resume exactly.")


def zero_stage_of(meta: dict[str, Any]) -> int:
    """The ZeRO stage a checkpoint was written under: layout "zero", or the older "zero1"."""
    layout = meta.get("layout") or {}
    if "zero" in layout:
        return int(layout["zero"])
    return 1 if layout.get("zero1") else 0


def stager_of(trainer: TrainState) -> HostStager:
    """The trainer's :class:`HostStager` (made by :func:`reserve_async_save` or at the first
    async save; its two host buffer sets are reused by every later save), kept as
    ``trainer.checkpoint_stager``."""
    stager = getattr(trainer, "checkpoint_stager", None)
    if stager is None:
        log = trainer.groups.world.rank == 0
        stager = HostStager(note=(lambda line: print(f"colonnade: {line}", flush=True))
                            if log else None)
        trainer.checkpoint_stager = stager
    return stager


def reserve_async_save(trainer: TrainState) -> None:
    """At start-up of a run that saves asynchronously: allocate the host (pinned) buffers of
    both sets in a background thread, so no save allocates them on the training thread."""
    ddp = getattr(trainer, "ddp", None)
    entries = (model_entries(trainer.chunks, trainer.groups, ddp)
               + optim_entries(trainer.optimizer, trainer.groups))
    stager = stager_of(trainer)
    stager.reserve([stager.spec(e.tensor) for e in entries])


def _settle(stager: HostStager) -> list[PendingSave]:
    """The stager's saves still in flight; a finished one's error is raised here (training
    thread), as waiting for it would."""
    live = []
    for pending in stager.in_flight:
        if pending.done():
            pending.wait()
        else:
            live.append(pending)
    stager.in_flight = live
    return live


def _files(trainer: TrainState, tokenizer: str | Path | None) -> dict[str, bytes]:
    """The small files a checkpoint carries: config.toml and the tokenizer's files."""
    files = {"config.toml": config_to_toml(trainer.config).encode()}
    if tokenizer is not None and Path(tokenizer).exists():  # with its config, chat template
        files.update(tokenizer_files(Path(tokenizer).parent))
        files["tokenizer.json"] = Path(tokenizer).read_bytes()
    return files


def save_training(trainer: TrainState, root: str | Path, *, keep_last: int = 3,
                  async_save: bool = False, tokenizer: str | Path | None = None,
                  on_phase: PhaseHook | None = None, timeout_s: float = 600.0) -> PendingSave:
    """Write a checkpoint of ``trainer`` after ``trainer.step`` steps (collective: all ranks).

    Only ranks that own pieces write (dp replicas write nothing); one all-gather of a flag
    tells rank 0 who does. Synchronous: returns once committed. Asynchronous: the training
    thread only stages host copies (:mod:`.staging`: two reused buffer sets, non-blocking
    copies on a side stream) and returns; a thread waits for the copies and writes (rank 0's
    thread also commits, polling for the writers' index fragments, so the thread runs no
    collective, and after the save before it: commits stay in step order). A save may start
    while the previous one is being written; the caller must :meth:`PendingSave.wait` on the
    last one before exiting (it waits for the earlier ones too).
    """
    t0 = time.perf_counter()
    root = Path(root)
    groups = trainer.groups
    _finish_gathers(trainer)
    rank, step = groups.world.rank, int(trainer.step)
    stager = stager_of(trainer) if async_save else None
    earlier = getattr(trainer, "checkpoint_stager", None)
    in_flight = _settle(earlier) if earlier is not None else []
    if stager is None:  # a synchronous save commits after every asynchronous one in flight
        for before in in_flight:
            before.wait()
        in_flight = []
    if rank == 0:
        prepare_tmp(root, step, {p.path.name + ".tmp" for p in in_flight})
    tmp = root / (step_dirname(step) + ".tmp")
    ddp = getattr(trainer, "ddp", None)  # ZeRO-3: the model pieces are its shard's ranges
    entries = (model_entries(trainer.chunks, groups, ddp)
               + optim_entries(trainer.optimizer, groups))
    # who writes, and every rank's state names; also the barrier that orders rank 0's
    # prepare_tmp before every write
    told = groups.world.all_gather_object((bool(entries), state_names(trainer.optimizer)))
    writers = [r for r, (w, _) in enumerate(told) if w]
    meta = _metadata(trainer) if rank == 0 else {}
    if rank == 0:
        states = meta["optimizer"]["states"] = {}
        for _, names in told:
            for key, got in names.items():
                states[key] = sorted(set(states.get(key, [])) | set(got))
    pending = PendingSave(root / step_dirname(step), before=in_flight[-1] if in_flight else None)
    hook = on_phase or (lambda _p: None)
    staged = (stager.stage(entries, step) if stager is not None
              else Staged([replace(e, tensor=e.tensor.cpu()) for e in entries]))

    def write() -> None:
        try:
            try:
                mine = stager.ready(staged) if stager is not None else staged.entries
                write_rank_shard(tmp, rank, mine)
            finally:
                if stager is not None:
                    stager.release(staged)
            hook("shard_written")
            pending.join_before()
            if rank == 0:
                files = _files(trainer, tokenizer)
                wait_for_fragments(tmp, writers, timeout_s)
                commit(root, tmp, step, writers, meta, files, keep_last, on_phase)
                if stager is not None:
                    stager.note(f"saved checkpoint {pending.path} asynchronously: training "
                                f"stalled {pending.stall_s:.3f} s, written in "
                                f"{time.perf_counter() - t0:.2f} s")
        except BaseException as err:  # surfaced by wait()
            pending.errors.append(err)

    if stager is not None:
        pending.thread = threading.Thread(target=write, name="colonnade-ckpt", daemon=False)
        stager.in_flight.append(pending)
        pending.stall_s = time.perf_counter() - t0
        pending.thread.start()
        return pending
    write()
    groups.world.barrier()
    pending.wait()
    return pending


def read_metadata(path: str | Path) -> dict[str, Any]:
    """metadata.json of a checkpoint (root or step directory)."""
    ckpt = resolve_checkpoint(path)
    return json.loads((ckpt / METADATA).read_text())


def load_training(trainer: TrainState, path: str | Path, *, load_optimizer_state: bool = True,
                  verify: bool = True) -> dict[str, Any]:
    """Restore ``trainer`` from a checkpoint written under any layout; returns its metadata.

    Restores parameters, optimizer state (masters, moments, step count hence the LR), the
    step, the sampler position, the RNG tracker, the loss scaler and the run's elapsed time
    (``trainer.elapsed_s``; 0 for a checkpoint older than it). A checkpoint of another
    optimizer is refused, or with ``checkpoint.optimizer_switch='reset'`` restored without its
    optimizer state (:func:`optimizer_change`; the line to log is ``meta["optimizer_note"]``).
    """
    from colonnade.checkpoint.finetune import is_weights_only, model_mismatch, weights_only_error

    ckpt = resolve_checkpoint(path)
    meta = json.loads((ckpt / METADATA).read_text())
    if load_optimizer_state and is_weights_only(meta):
        raise weights_only_error(path)
    bad = model_mismatch(meta["model"], trainer.config.model) if "model" in meta else []
    if bad:
        raise CheckpointError(f"{ckpt} holds another model than this run's: {', '.join(bad)}; "
                              "set those model fields to the checkpoint's values")
    ck = trainer.config.checkpoint
    meta["optimizer_note"] = (optimizer_change(meta, trainer.config.optim, ckpt,
                                               ck.optimizer_switch)
                              if load_optimizer_state else "")
    reader = CheckpointReader(ckpt, verify=verify)
    _finish_gathers(trainer)
    load_model(reader, trainer.chunks, trainer.groups, getattr(trainer, "ddp", None))
    step_count = int(meta["optimizer"]["step_count"]) if load_optimizer_state else 0
    fresh = not load_optimizer_state or bool(meta["optimizer_note"])
    cast = load_optimizer(None if fresh else reader, trainer.optimizer, trainer.chunks,
                          trainer.groups, step_count)
    trainer.optimizer.state_start = (step_count if fresh else
                                     int(meta["optimizer"].get("state_start") or 0))
    reader.close()
    if not load_optimizer_state:
        return meta
    meta["schedule_note"] = schedule_change(meta, trainer.optimizer, ckpt,
                                            trainer.config.checkpoint.lr_schedule)
    meta["optim_notes"] = cast  # optimizer states cast to this run's dtypes
    trainer.step = int(meta["step"])
    trainer.elapsed_s = float(meta.get("elapsed_s") or 0.0)
    data = getattr(trainer, "data", None)
    if data is not None and meta.get("sampler") is not None:
        data.sampler.load_state_dict(meta["sampler"])
    if meta.get("rng") is not None:
        trainer.chunks[0].ctx.rng.load_state_dict(meta["rng"])
    scaler = _scaler(trainer)
    if scaler is not None and meta.get("scaler") is not None:
        scaler.load_state_dict(meta["scaler"])
    return meta


def start_from(trainer: TrainState, path: str | Path) -> str:
    """``checkpoint.load``: resume a Colonnade checkpoint exactly (an HF directory or a
    weights-only checkpoint is refused, pointing at ``--init-from``). Returns a log line."""
    from colonnade.checkpoint.finetune import hf_load_error
    from colonnade.checkpoint.hf import is_hf_dir

    if is_hf_dir(path) and not (Path(path) / "latest").exists():
        raise hf_load_error(path)
    meta = load_training(trainer, path)
    notes = [meta["optimizer_note"], meta["schedule_note"], *meta["optim_notes"]]
    note = "".join(f"; {n}" for n in notes if n)
    return f"resumed from {resolve_checkpoint(path)} at step {meta['step']}{note}"


def preflight_resume(config: Any) -> None:
    """Before any rank starts: refuse, as the ranks would, a ``checkpoint.load`` that is an HF
    directory, holds weights only, another model shape, another optimizer
    (``checkpoint.optimizer_switch='check'``) or is resumed under another LR schedule
    (``checkpoint.lr_schedule='check'``), and tokenizers that disagree with the data's (the
    checkpoint's, data.blend's; :func:`~colonnade.checkpoint.finetune.check_tokenizers`)."""
    from colonnade.checkpoint.finetune import (
        check_tokenizers,
        hf_load_error,
        is_weights_only,
        model_mismatch,
        weights_only_error,
    )
    from colonnade.checkpoint.hf import is_hf_dir

    load = config.checkpoint.load
    if load and is_hf_dir(load) and not (Path(load) / "latest").exists():
        raise hf_load_error(load)
    check_tokenizers(config)
    if not load:
        return
    try:
        ckpt = resolve_checkpoint(load)
        meta = json.loads((ckpt / METADATA).read_text())
    except (CheckpointError, OSError, ValueError):
        return  # a broken path: the ranks' loader reports it in full
    if is_weights_only(meta):
        raise weights_only_error(load)
    bad = model_mismatch(meta["model"], config.model) if "model" in meta else []
    if bad:
        raise CheckpointError(f"{ckpt} holds another model than this run's: {', '.join(bad)}; "
                              "set those model fields to the checkpoint's values")
    optimizer_change(meta, config.optim, ckpt, config.checkpoint.optimizer_switch)
    probe = SimpleNamespace(total_steps=config.training.steps, cfg=config.optim,
                            step_count=meta["optimizer"]["step_count"])
    schedule_change(meta, probe, ckpt, config.checkpoint.lr_schedule)


def schedule_change(meta: dict[str, Any], optimizer: Any, ckpt: Path, mode: str) -> str:
    """Reconcile the checkpoint's LR schedule with ``optimizer``'s (this run's config).

    Equal: "". Different: ``mode`` 'check' raises :class:`CheckpointError` naming each changed
    field and both fixes; 'checkpoint' puts the saved schedule into ``optimizer``; 'config'
    keeps this run's.  Returns the line to log.  Checkpoints older than the stored schedule
    record only its total steps, which is all that is compared then."""
    saved = meta["optimizer"].get("schedule") or {"total_steps": meta["optimizer"]["total_steps"]}
    now = schedule_of(optimizer.total_steps, optimizer.cfg)
    changed = [k for k in saved if saved[k] != now[k]]
    if not changed:
        return ""
    step = int(optimizer.step_count)
    old_total, old_cfg = with_schedule(optimizer.cfg, saved)
    at = next((t for t in range(step, max(old_total, optimizer.total_steps) + 1)
               if not math.isclose(lr_at(t, old_total, old_cfg),
                                   lr_at(t, optimizer.total_steps, optimizer.cfg),
                                   rel_tol=1e-12)), None)
    if at is None:  # e.g. both totals inside the warmup: every step left gets the same LR
        return ""
    old, new = (lr_at(at, old_total, old_cfg),
                lr_at(at, optimizer.total_steps, optimizer.cfg))
    diff = ", ".join(f"{SCHEDULE_FIELDS[k]} {saved[k]} -> {now[k]}" for k in changed)
    if mode == "checkpoint":
        optimizer.total_steps, optimizer.cfg = old_total, old_cfg
        return f"kept the checkpoint's LR schedule (ignoring {diff})"
    if mode == "config":
        return f"switched to this run's LR schedule ({diff}): LR {old:.3g} -> {new:.3g}"
    raise CheckpointError(
        f"{ckpt} was trained under another LR schedule ({diff}); resuming would move the LR "
        f"at step {at} from {old:.3g} to {new:.3g}. Set --checkpoint.lr_schedule=checkpoint "
        "to keep the saved schedule (training.steps then only says when to stop) or "
        "--checkpoint.lr_schedule=config to switch to this run's.")
