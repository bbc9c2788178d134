"""checkpoint.on_existing='overwrite' replaces an earlier run's checkpoints only once the new run
has committed one (issue 35, item 2): a crash at any point of that first commit leaves either
the old set whole (and start-up treats it as not this run's) or the new checkpoint named by
``latest``; ``latest`` never names a missing or half-deleted directory; the next commit finishes
what a crash left."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from colonnade.checkpoint.commit import (
    REPLACING,
    commit,
    committed_steps,
    mark_for_replacement,
    pending_replacement,
    prepare_tmp,
    read_latest,
    step_dirname,
)
from colonnade.reliability.startup import latest_checkpoint

OLD = (4, 8)
"""The earlier run's checkpoints (``latest`` names step 8)."""


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order of renames is what is tested, not durability: fsync is a no-op here (it made
    these 30 cases take 5 s)."""
    monkeypatch.setattr(os, "fsync", lambda _fd: None)


class Crash(Exception):
    """Stands for a kill -9 at a phase of the commit."""


def _save(root: Path, step: int, run: str, hook: object = None) -> None:
    """Commit a checkpoint of ``step`` (no tensors) whose metadata names ``run``."""
    tmp = prepare_tmp(root, step)
    commit(root, tmp, step, [], {"step": step, "run": run}, {}, keep_last=0,
           on_phase=hook)  # type: ignore[arg-type]


def _run_of(path: Path) -> str:
    return json.loads((path / "metadata.json").read_text())["run"]


def _old_set(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    for step in OLD:
        _save(root, step, "old")
    return root


def test_marking_deletes_nothing_and_makes_the_old_set_not_this_runs(tmp_path: Path) -> None:
    root = _old_set(tmp_path)
    names = mark_for_replacement(root)
    assert names == ["step_00000004", "step_00000008"]
    assert json.loads((root / REPLACING).read_text()) == {"replacing": names}
    assert pending_replacement(root) == names
    assert read_latest(root) == root / "step_00000008" and committed_steps(root) == [4, 8]
    # none of them is a run's: start-up neither resumes from nor compares tokenizers with them
    assert latest_checkpoint(root) is None
    assert mark_for_replacement(tmp_path / "missing") == []  # nothing to replace: no marker
    assert not (tmp_path / "missing").exists()


PHASES = ["latest_removed", "replaced_set_aside", "marker_updated", "index_written",
          "files_written", "renamed", "latest_tmp_written", "latest_written", "replaced_moved",
          "replaced_deleted"]


@pytest.mark.parametrize("new_step", [2, 4, 8], ids=["new-name", "old-name", "latest-name"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_crash_in_the_first_commit_leaves_old_or_new(tmp_path: Path, new_step: int,
                                                        phase: str) -> None:
    root = _old_set(tmp_path)
    mark_for_replacement(root)

    crashed = []

    def crash(name: str) -> None:
        if name == phase:
            crashed.append(name)
            raise Crash(name)

    with contextlib.suppress(Crash):
        _save(root, new_step, "new", crash)
    latest = read_latest(root)
    if latest is not None:  # never a missing or half-deleted checkpoint
        assert (latest / "index.json").is_file() and (latest / "metadata.json").is_file()
    pending = pending_replacement(root)
    committed = not crashed or PHASES.index(phase) >= PHASES.index("latest_written")
    assert (pending is None) == committed, (phase, pending)
    if pending is not None:  # the new run has committed nothing: the old set is all there
        assert latest is None or _run_of(latest) == "old"
        for step in OLD:
            name = step_dirname(step)
            kept = [p for p in (root / name, root / f"{name}.replaced")
                    if (p / "index.json").is_file() and _run_of(p) == "old"]
            assert len(kept) == 1, (step, sorted(p.name for p in root.iterdir()))
    else:  # committed: latest names the new checkpoint
        assert latest == root / step_dirname(new_step) and _run_of(latest) == "new"
    # the restarted run marks again (as its start-up does) and saves again (a committed one from
    # its step on): all is finished, also where a crashed commit left its own step_X beside the
    # old step_X.replaced (the rename to .replaced failed on every later save)
    if pending is not None:
        mark_for_replacement(root)
    steps = [new_step] if pending is not None else [new_step, new_step + 1]
    _save(root, steps[-1], "new")
    assert read_latest(root) == root / step_dirname(steps[-1])
    assert committed_steps(root) == steps
    assert all(_run_of(root / step_dirname(s)) == "new" for s in steps)
    assert sorted(p.name for p in root.iterdir()) == ["latest", *map(step_dirname, steps)]


@pytest.mark.parametrize("phase", ["latest_removed", "replaced_set_aside", "marker_updated",
                                   "renamed"])
def test_a_plain_rerun_after_a_crash_in_the_first_save_is_refused_by_name(
        tmp_path: Path, phase: str) -> None:
    """One earlier checkpoint, the overwriting run's first save at the same step crashes after
    ``latest`` is gone: a re-run without overwrite is refused naming what was set aside and
    offering no resume (removing the marker would resume nothing: it raised IndexError on an
    emptied marker, and offered that advice)."""
    from colonnade.checkpoint.format import CheckpointError
    from colonnade.config.sections import CheckpointConfig, Config
    from colonnade.reliability.startup import resume_config

    root = tmp_path / "ck"
    _save(root, 8, "old")
    mark_for_replacement(root)

    def crash(name: str) -> None:
        if name == phase:
            raise Crash(name)

    with contextlib.suppress(Crash):
        _save(root, 8, "new", crash)
    assert read_latest(root) is None and pending_replacement(root) is not None
    config = Config(checkpoint=CheckpointConfig(save=str(root)))
    with pytest.raises(CheckpointError) as info:
        resume_config(config, 0)
    text = str(info.value)
    assert "stopped during its first save" in text and "nothing to resume from" in text
    assert f"remove {root / REPLACING}" not in text
    assert ("step_00000008.replaced set aside" in text) == (phase != "latest_removed")
    fresh, note = resume_config(config, 1)  # a restart starts that run again
    assert fresh.checkpoint.load is None and note.startswith("restart 1: no checkpoint")
