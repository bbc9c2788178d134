"""Atomic commit of a checkpoint directory and the ``latest`` marker.

Protocol (the root holds ``step_XXXXXXXX/`` directories and a ``latest`` text file):

1. rank 0 removes stale ``*.tmp`` directories and creates ``step_XXXXXXXX.tmp/``;
2. every rank that owns pieces (a *writer*; dp replicas own none) writes its shard, fsyncs it,
   then writes its index fragment (fsync, rename); the others write nothing;
3. rank 0, once all writers' fragments exist (it learns who writes from one small all-gather
   at the start of the save, and then polls with backoff), merges them into ``index.json``,
   writes ``metadata.json`` and ``config.toml``, fsyncs every file and the directory, renames
   ``.tmp`` to the final name and fsyncs the root;
4. rank 0 writes ``latest.tmp`` (fsync) and renames it onto ``latest`` (fsync root);
5. checkpoints beyond the last K are deleted (never the one ``latest`` names).

The directory ``latest`` names is never overwritten. Another step directory of the same name
(left by an earlier attempt that a resumed run re-does) is moved aside first, so what the log
says was saved is what is on disk.

A crash before 3's rename leaves only a ``.tmp`` directory (ignored, removed next time); a crash
between 3 and 4 leaves a complete directory that ``latest`` does not name yet; ``latest`` is
replaced by a rename, so it always names a complete checkpoint.

Replacing an earlier run's checkpoints (``checkpoint.on_existing='overwrite'``) deletes nothing
at start-up: rank 0 names them in ``replacing.json`` (written atomically,
:func:`mark_for_replacement`). While the marker exists and ``latest`` is absent or names one
of them, the new run has committed nothing (:func:`pending_replacement`): start-up never resumes
from them (a restart starts the new run again, a re-run that does not overwrite is refused),
and they stay whole, so a crash leaves them as they were. The new run's first commit then

a. if ``latest`` names the directory it is about to write (the same step), removes ``latest``
   (for a moment there is none, never one naming a missing directory);
b. moves a marked directory of that name to ``<name>.replaced`` and drops the name from the
   marker (atomically), so the marker never names the new checkpoint;
c. commits as above (1-4): ``latest`` now names a checkpoint the marker does not;
d. moves each marked directory to ``<name>.replaced``, deletes every ``*.replaced`` directory,
   then the marker (:func:`finish_replacement`; a crash in between is finished by the next
   commit).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from colonnade.checkpoint.format import (
    INDEX,
    CheckpointError,
    fragment_name,
    fsync_path,
    merge_fragments,
    write_json,
)

LATEST = "latest"
METADATA = "metadata.json"
REPLACING = "replacing.json"
"""The marker naming the checkpoints an ``on_existing='overwrite'`` run replaces."""
REPLACED = ".replaced"
"""Suffix of a replaced checkpoint directory awaiting deletion (kept by :func:`prepare_tmp`)."""
_STEP_RE = re.compile(r"^step_(\d{8})$")

PhaseHook = Callable[[str], None]


def step_dirname(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step_{step:08d}"


def prepare_tmp(root: Path, step: int, in_flight: Collection[str] = ()) -> Path:
    """(rank 0) Create an empty ``step_XXXXXXXX.tmp`` directory, removing stale ones (but not
    the ``in_flight`` names: asynchronous saves still being written)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp"):
        if stale.name in in_flight:
            continue
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    tmp = root / (step_dirname(step) + ".tmp")
    tmp.mkdir()
    return tmp


POLL_FIRST_S = 0.005
POLL_MAX_S = 0.5


def wait_for_fragments(tmp: Path, writers: list[int], timeout_s: float) -> int:
    """Poll until the index fragment of every rank in ``writers`` exists; returns the polls.

    The async commit runs no collective, so rank 0 looks: one directory listing per poll (not
    one stat per rank), the interval doubling from 5 ms up to 0.5 s, so a wait of T seconds
    costs about log2(100) + 2 T listings whatever the number of ranks.
    """
    want = {fragment_name(r) for r in writers}
    deadline = time.monotonic() + timeout_s
    delay, polls = POLL_FIRST_S, 0
    while True:
        polls += 1
        missing = want - set(os.listdir(tmp))
        if not missing:
            return polls
        if time.monotonic() > deadline:
            ranks = sorted(int(n[5:10]) for n in missing)
            raise CheckpointError(f"{tmp}: ranks {ranks} did not finish writing within "
                                  f"{timeout_s:.0f} s; the checkpoint is not committed")
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)


def commit(root: Path, tmp: Path, step: int, writers: list[int], metadata: dict[str, Any],
           files: dict[str, bytes], keep_last: int, on_phase: PhaseHook | None = None) -> Path:
    """(rank 0) Steps 3-5 of the protocol for the fragments of ``writers`` (the ranks that
    own pieces); returns the committed directory."""
    hook = on_phase or (lambda _p: None)
    write_json(tmp / INDEX, merge_fragments(tmp, writers))
    hook("index_written")
    write_json(tmp / METADATA, metadata)
    for name, data in files.items():
        with open(tmp / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    fsync_path(tmp)
    hook("files_written")
    final = root / step_dirname(step)
    replacing = read_replacing(root)
    if replacing is not None and final.name in replacing:
        _make_room(root, final, replacing, hook)
    aside = _set_aside(root, final) if final.exists() else None
    os.replace(tmp, final)
    fsync_path(root)
    hook("renamed")
    marker = root / (LATEST + ".tmp")
    with open(marker, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    hook("latest_tmp_written")
    os.replace(marker, root / LATEST)
    fsync_path(root)
    hook("latest_written")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    finish_replacement(root, hook)
    prune(root, keep_last)
    return final


def _set_aside(root: Path, final: Path) -> Path:
    """A step directory left by an earlier attempt that ``latest`` does not name (a crash between
    rename and marker, or a run re-done after resuming from an earlier step) is replaced: moved
    to a ``.tmp`` name, deleted once ``latest`` names the new one (or by the next save after a
    crash). The one
    ``latest`` names is never replaced (it would name nothing for a moment)."""
    latest = read_latest(root)
    if latest is not None and latest.name == final.name:
        raise CheckpointError(f"{final} is the checkpoint {root / LATEST} names; a run never "
                              "saves the step it resumed from again")
    aside = root / (final.name + ".old.tmp")
    os.replace(final, aside)
    fsync_path(root)
    return aside


def mark_for_replacement(root: Path) -> list[str]:
    """(rank 0, ``checkpoint.on_existing='overwrite'`` on a fresh start) Name every committed
    checkpoint under ``root`` (and those an earlier, unfinished replacement named) in
    ``replacing.json``, written atomically; deletes nothing (the first commit does). Returns the
    names, ascending; none: no marker is written."""
    names = sorted({step_dirname(s) for s in committed_steps(root)}
                   | set(read_replacing(root) or ()))
    if names:
        _write_replacing(root, names)
    return names


def read_replacing(root: Path) -> list[str] | None:
    """The names ``replacing.json`` lists, or None when there is no marker."""
    path = Path(root) / REPLACING
    try:
        return [str(n) for n in json.loads(path.read_text())["replacing"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} cannot be read ({err!r}); it lists the checkpoints that "
                              "a run with checkpoint.on_existing=overwrite replaces") from None


def pending_replacement(root: str | Path | None) -> list[str] | None:
    """The checkpoints under ``root`` that an ``on_existing='overwrite'`` run is replacing while
    it has committed none of its own (the marker exists and ``latest`` is absent or names one
    of them), else None. While pending, no checkpoint under ``root`` is that run's."""
    if not root or not Path(root).is_dir():
        return None
    names = read_replacing(Path(root))
    if names is None:
        return None
    latest = read_latest(Path(root))
    return names if latest is None or latest.name in names else None


def finish_replacement(root: Path, on_phase: PhaseHook | None = None) -> list[str]:
    """Step d: once ``latest`` names a checkpoint of the new run, delete the replaced ones and
    the marker (each directory is renamed to ``*.replaced`` first, so none is ever half
    deleted under a checkpoint's name). Returns the names deleted; none while pending."""
    hook = on_phase or (lambda _p: None)
    names = read_replacing(root)
    if names is None or pending_replacement(root) is not None:
        return []
    for name in names:
        if (root / name).is_dir():
            _move_to_replaced(root, name)
    fsync_path(root)
    hook("replaced_moved")
    for old in root.glob("*" + REPLACED):
        shutil.rmtree(old, ignore_errors=True)
    hook("replaced_deleted")
    (root / REPLACING).unlink()
    fsync_path(root)
    return names


def _make_room(root: Path, final: Path, replacing: list[str], hook: PhaseHook) -> None:
    """Steps a and b: ``final``'s name is a checkpoint being replaced."""
    latest = read_latest(root)
    if latest is not None and latest.name == final.name:
        (root / LATEST).unlink()
        fsync_path(root)
        hook("latest_removed")
    if final.exists():
        _move_to_replaced(root, final.name)
        fsync_path(root)
        hook("replaced_set_aside")
    _write_replacing(root, [n for n in replacing if n != final.name])
    hook("marker_updated")


def _move_to_replaced(root: Path, name: str) -> None:
    """Rename ``root/name`` to ``name.replaced``; one of that name left by a crashed replacement
    (already on its way out) is deleted first, or the rename fails on every later save."""
    target = root / (name + REPLACED)
    if target.exists():
        shutil.rmtree(target)
    os.replace(root / name, target)


def _write_replacing(root: Path, names: list[str]) -> None:
    """Write ``replacing.json`` atomically (temporary file, fsync, rename, fsync root)."""
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / REPLACING, {"replacing": names})
    fsync_path(root)


def committed_steps(root: Path) -> list[int]:
    """Steps of the committed checkpoints under ``root``, ascending."""
    out = []
    for p in root.iterdir() if root.exists() else []:
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / INDEX).exists():
            out.append(int(m.group(1)))
    return sorted(out)


def prune(root: Path, keep_last: int) -> None:
    """Delete committed checkpoints older than the last ``keep_last`` (0 keeps all)."""
    if keep_last <= 0:
        return
    latest = read_latest(root)
    for step in committed_steps(root)[:-keep_last]:
        path = root / step_dirname(step)
        if latest is None or path.resolve() != latest.resolve():
            shutil.rmtree(path, ignore_errors=True)


def read_latest(root: Path) -> Path | None:
    """The directory ``latest`` names, or None when there is no marker."""
    marker = root / LATEST
    if not marker.exists():
        return None
    name = marker.read_text().strip()
    if not _STEP_RE.match(name):
        raise CheckpointError(f"{marker} holds '{name}', not a step_XXXXXXXX name")
    return root / name


def resolve_checkpoint(path: str | Path) -> Path:
    """A committed checkpoint directory from a root (through ``latest``), a step directory or
    a run's logging.dir (:func:`run_save_dir`)."""
    path = Path(path)
    if (path / INDEX).exists():
        return path
    latest = read_latest(path)
    if latest is not None:
        if not (latest / INDEX).exists():
            raise CheckpointError(f"{path}/{LATEST} names {latest.name}, which has no {INDEX}")
        return latest
    if (path / RUN_CONFIG).is_file():
        return resolve_checkpoint(run_save_dir(path))  # it has a `latest` marker
    raise CheckpointError(f"{path}: neither a checkpoint ({INDEX}) nor a checkpoint root "
                          f"({LATEST} marker) nor a run's logging.dir; nothing to load")


RUN_CONFIG = "config.toml"
"""The config a run writes into its logging.dir (and every checkpoint holds)."""


def run_save_dir(run_dir: str | Path) -> Path:
    """The checkpoint root of the run whose logging.dir is ``run_dir`` (its config.toml):
    ``run_dir/checkpoints`` when it saved under the default (checkpoint.save 'auto', or the
    ``<logging.dir>/checkpoints`` it became; found wherever run_dir now is), else the
    checkpoint.save it names. Raises :class:`CheckpointError` when that run saved nothing or
    the directory it names is not there."""
    from colonnade.config.load import load_config
    from colonnade.config.validate import SAVE_AUTO, default_save_dir

    run_dir = Path(run_dir)
    config = load_config(run_dir / RUN_CONFIG)
    save = config.checkpoint.save
    if save is None:
        raise CheckpointError(f"{run_dir}/{RUN_CONFIG} is a run's config with checkpoint.save="
                              "none: that run saved no model")
    found = Path(save)
    if save == SAVE_AUTO or found == default_save_dir(config.logging.dir):
        found = default_save_dir(run_dir)
    elif not found.is_dir():
        raise CheckpointError(f"{run_dir}/{RUN_CONFIG} names checkpoint.save={save}, which "
                              "does not exist here (run from the directory you trained in, or "
                              "pass the checkpoint directory itself)")
    if not (found / LATEST).is_file():
        raise CheckpointError(f"{run_dir} is a run's logging.dir whose checkpoint.save ({found}) "
                              f"holds no committed checkpoint (no {LATEST} marker): that run "
                              "saved no model")
    return found
