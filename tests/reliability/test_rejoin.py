"""In-process restart without processes: the supervisor's decisions (replace one rank, fall
back to a whole-job restart, stop), the NCCL generation watch, and the validator's rule. The
real jobs are in test_launch.py (test_in_process_restart_replaces_only_the_dead_rank)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colonnade.config.load import load_config
from colonnade.config.validate import problems
from colonnade.reliability.rejoin import (
    REJOIN_FAILED,
    GenerationWatch,
    Membership,
    generation_key,
    ready_key,
)
from colonnade.reliability.supervisor import Supervisor


def test_supervisor_replaces_one_rank_then_restarts_the_job_then_stops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A death in a healthy job: one replacement, generation 1 in the store. A death while
    generation 1 is not ready (3 of 4 ranks marked it): the whole job restarts (attempt 1,
    every rank spawned). A rank that could not rejoin: a job restart too. No restart left, or
    bad input: stop."""
    lines: list[str] = []
    sup = Supervisor(4, 3, print, (), "run-x", say=lines.append)
    spawned: list[int] = []
    monkeypatch.setattr(sup, "spawn", spawned.append)
    monkeypatch.setattr(sup, "stop_all", lambda *a: None)
    assert sup.on_failure(2, -9)
    assert (sup.attempt, sup.generation, spawned) == (0, 1, [2])
    assert sup.store.get(generation_key(0)) == b"1"
    assert "rank 2 died (signal 9); in-process restart 1/3" in lines[-1]
    for _ in range(3):
        sup.store.add(ready_key(0, 1), 1)
    assert not sup.generation_ready()
    assert sup.on_failure(1, 1)  # while generation 1 is rejoining: the whole job
    assert (sup.attempt, sup.generation, spawned) == (1, 0, [2, 0, 1, 2, 3])
    assert "restarting the whole job (2/3)" in lines[-1]
    assert sup.on_failure(3, REJOIN_FAILED) and sup.attempt == 2  # could not rejoin: job
    assert not sup.on_failure(0, -9)  # no restart left
    fresh = Supervisor(4, 3, print, (), "run-y", say=lines.append)
    assert not fresh.on_failure(1, 2)  # bad input is never restarted
    assert [e["kind"] for e in sup.events] == ["in-process", "job", "job"]


def test_generation_watch_aborts_once_per_new_generation() -> None:
    """NCCL's detection: the watch calls its abort once when the store's generation passes
    the rank's, not again for the same generation, and again for the next one after the rank
    has rejoined the first."""
    store = dist.HashStore()
    member = Membership(store, 0, 4, 0, 0, "nccl", torch.device("cpu"), 1.0)
    fired: list[int] = []
    watch = GenerationWatch(store, member, lambda: fired.append(1))
    assert not watch.check()
    store.set(generation_key(0), "1")
    assert watch.check() and not watch.check() and fired == [1]
    member.generation = 1  # rejoined
    assert not watch.check()
    store.set(generation_key(0), "2")
    assert watch.check() and fired == [1, 1]


def test_in_process_restart_needs_a_state_to_restore() -> None:
    """checkpoint.restart='in-process' without memory snapshots nor periodic checkpoints is
    refused, naming the fields and the fix; an unknown mode is refused too."""
    bad = problems(load_config(None, ["--checkpoint.restart=in-process"]), 4)
    assert any("checkpoint.restart='in-process' needs a state to restore" in p
               and "--checkpoint.memory_interval=1" in p for p in bad), bad
    ok = ["--checkpoint.restart=in-process", "--checkpoint.memory_interval=1"]
    assert not [p for p in problems(load_config(None, ok), 4) if "restart" in p]
    odd = problems(load_config(None, ["--checkpoint.restart=sometimes"]), 4)
    assert any("checkpoint.restart='sometimes' is unknown" in p for p in odd), odd
