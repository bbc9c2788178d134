"""The run's life cycle around the loop: a save directory whose checkpoints it replaces, a run
already finished, and the line printed when Ctrl-C / SIGTERM stopped it
(:mod:`colonnade.reliability.interrupt`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from colonnade.checkpoint.commit import mark_for_replacement
from colonnade.checkpoint.training_state import PendingSave, save_training
from colonnade.config.sections import Config
from colonnade.reliability.interrupt import signal_name
from colonnade.reliability.monitor import RankMonitor
from colonnade.reliability.startup import new_save_option


def mark_for_overwrite(config: Config, groups: Any) -> str:
    """``checkpoint.on_existing='overwrite'`` on a fresh start: rank 0 names the checkpoints
    under ``checkpoint.save`` in its ``replacing.json`` marker; they are deleted once this run's
    first checkpoint is committed (:mod:`colonnade.checkpoint.commit`), not before, so a crash
    until then leaves them as they were. Returns a line for the log ("" on other ranks)."""
    ck = config.checkpoint
    if groups.rank != 0 or not ck.save or ck.on_existing != "overwrite" or ck.load == ck.save:
        return ""
    names = mark_for_replacement(Path(ck.save))
    if not names:
        return ""
    return (f"checkpoint.on_existing=overwrite: the {len(names)} earlier checkpoint(s) under "
            f"{ck.save} ({names[0]} .. {names[-1]}) are kept until this run's first checkpoint "
            "is committed, then deleted")


def write_run_config(directory: str | Path, text: str) -> str:
    """Write ``directory/config.toml``; an earlier run's different one is kept as
    ``config.previous-N.toml`` (N counting up), never replaced. Returns a line for the log."""
    path = Path(directory) / "config.toml"
    note = ""
    if path.is_file() and path.read_text() != text:
        n = 1
        while (kept := path.with_name(f"config.previous-{n}.toml")).exists():
            n += 1
        path.rename(kept)
        note = f"kept the earlier config.toml of {directory} as {kept.name}"
    path.write_text(text)
    return note


def begin_run(config: Config, step: int, groups: Any) -> bool:
    """After loading: False (and a line) when the resumed checkpoint already reached
    training.steps; else marks the save dir's checkpoints for replacement when told to
    overwrite (rank 0) and True."""
    log = groups.rank == 0
    if config.checkpoint.load and step >= config.training.steps:
        if log:
            print(finished_note(config, step))
        return False
    marked = mark_for_overwrite(config, groups)
    if marked:
        print(f"colonnade: {marked}")
    return True


def end_run(trainer: Any, pending: PendingSave | None, stop: int, tokenizer: Path | None,
            monitor: RankMonitor | None) -> Path | None:
    """The final save (collective; also after Ctrl-C / SIGTERM) and its line; returns it."""
    ck, log = trainer.config.checkpoint, trainer.groups.rank == 0
    if pending is not None:
        pending.wait()
    final = None
    if ck.save:
        if monitor is not None:
            monitor.beat(trainer.step, trainer.groups.stats, phase="save")
        final = save_training(trainer, ck.save, keep_last=ck.keep_last,
                              tokenizer=tokenizer).path
        if log and not stop:
            print(f"saved checkpoint {final}")
    if stop and log:
        print(interrupted_line(stop, trainer.step, final), flush=True)
    return final


def finished_note(config: Config, step: int) -> str:
    """The line of a re-run whose resumed checkpoint already reached training.steps."""
    return (f"colonnade: {config.checkpoint.load} already holds step {step} >= training.steps="
            f"{config.training.steps}; nothing to train (raise --training.steps to continue, "
            f"pick a new {new_save_option(config)} to start over, or set "
            "--checkpoint.on_existing=overwrite to train it again from the start (its "
            "checkpoints are deleted once the new run saves))")


def interrupted_line(signum: int, step: int, saved: Path | None) -> str:
    """What a stopped run tells the user: where it stopped, what is on disk, how to go on."""
    if saved is not None:
        what = f"saved checkpoint {saved}; re-run the same command to resume"
    else:
        what = ("nothing was saved: checkpoint.save=none (leave it unset, or give "
                "--checkpoint.save=DIR, to save on Ctrl-C / SIGTERM and resume by re-running)")
    return f"colonnade: interrupted by {signal_name(signum)} at step {step}; {what}"
