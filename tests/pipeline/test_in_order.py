"""``parallel.p2p_in_order`` on gloo ranks: NCCL's in-order groups, for real.

Each rank posts a step's p2p groups through :class:`PipeComm`. In in-order mode a group is issued
only when the previous one completed. The posting used before issue 20 stalls there, exactly as
the NCCL model predicts, while gloo's free mode completes it (which is how it hid); the
executor's posting (:func:`p2p_program`) completes in both, and every buffer gets its message.
The stalling case runs in two throw-away processes (a stuck gloo op would poison the test pool).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from colonnade.config.choices import schedule_placement
from colonnade.parallel.comm import CommGroup, Handle
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.nccl_model import Group
from colonnade.pipeline.p2p import Message, PipeComm, stage_program
from colonnade.pipeline.schedules import build_schedule
from tests.pipeline.test_nccl_model import legacy_groups

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`

SHAPE = (4, 1, 2)
REPO = Path(__file__).resolve().parents[2]


def _code(msg: Message) -> float:
    """A payload that names its message, so a mismatched receive is seen."""
    return 100.0 * (msg.direction == "B") + 10.0 * msg.microbatch + msg.chunk


def _posted_comm(which: str, in_order: bool, groups: ProcessGroups,
                 schedule: str = "1f1b") -> PipeComm:
    """Post every group of ``schedule`` (1F1B, or ZB-V with vp = 2) pp=2 m=4 (overlap) of this
    stage up front."""
    lists = build_schedule(schedule, 2, 2 if schedule == "zbv" else 1, 4)
    stage = groups.pp_rank
    placement = schedule_placement(schedule)
    mine: list[Group] = (legacy_groups(lists, overlap=True)[stage] if which == "legacy"
                         else stage_program(lists, stage, True, placement).groups)
    comm = PipeComm(groups.pp, stage, lambda k: SHAPE, torch.float32, torch.device("cpu"),
                    in_order=in_order)
    for ops in mine:
        comm.post(ops, [torch.full(SHAPE, _code(op.msg)) for op in ops if op.kind == "send"])
    return comm


def rank_complete(which: str, in_order: bool, schedule: str = "1f1b") -> list[str]:
    """Receive every message and finish; returns the messages whose payload is wrong (and a
    note unless the inbox holds the messages from the peer: 1F1B's 4; ZB-V's 2 x 4,
    activations of one chunk and gradients of the other, its turn's local ones being handed
    over by the executor, never posted)."""
    torch.set_num_threads(1)
    comm = _posted_comm(which, in_order, ProcessGroups.build(ParallelDims(pp=2)), schedule)
    want = {"1f1b": 4, "zbv": 8}[schedule]
    bad = [] if which == "legacy" or len(comm.inbox) == want else [f"inbox {len(comm.inbox)}"]
    bad += [str(msg) for msg in list(comm.inbox)
            if not torch.equal(comm.wait(msg), torch.full(SHAPE, _code(msg)))]
    comm.finish()
    return bad


class _IssueLog:
    """Wraps a pp group's ``p2p``: counts the groups issued and notes which issue's ``wait`` the
    posting thread is blocked in, so the main thread can wait for that state (a condition, not
    a time)."""

    def __init__(self, group: CommGroup) -> None:
        self.real = group.p2p
        self.cond = threading.Condition()
        self.issued = 0
        self.waiting = -1  # the issue whose wait() was entered and has not returned
        group.p2p = self.p2p  # type: ignore[method-assign]

    def p2p(self, sends: list[Any], recvs: list[Any], *, name: str = "") -> _LoggedHandle:
        handle = self.real(sends, recvs, name=name)
        with self.cond:
            index, self.issued = self.issued, self.issued + 1
            self.cond.notify_all()
        return _LoggedHandle(self, index, handle)

    def wait_for(self, issues: int, timeout_s: float) -> tuple[int, int]:
        """Block until the thread waits on issue ``issues - 1``, or issued more than
        ``issues`` (an in-order stream would not have); (issued, waiting) at that point."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.waiting == issues - 1 or
                                      self.issued > issues, timeout_s)
            return self.issued, self.waiting


class _LoggedHandle:
    def __init__(self, log: _IssueLog, index: int, handle: Handle) -> None:
        self.log, self.index, self.handle = log, index, handle

    def wait(self) -> None:
        with self.log.cond:
            self.log.waiting = self.index
            self.log.cond.notify_all()
        self.handle.wait()
        with self.log.cond:
            self.log.waiting = -1

    def is_completed(self) -> bool:
        return self.handle.is_completed()


def stall_main(rank: int, store: str) -> None:
    """A throw-away rank: post the legacy groups in order, report how many were issued and
    completed once the stream is stuck, then exit without waiting for it.

    Ordered by states, not by a window for a wrong completion to show. Rank 0's posting thread
    issues {send F0, recv B0} and blocks in its wait; rank 1's completes {recv F0}, issues
    {recv F1} and blocks in its wait (:meth:`_IssueLog.wait_for`). From that point the counts
    cannot change, whatever the scheduler does: rank 0's wait needs B0, which rank 1 sends in
    its third group; rank 1's needs F1, which rank 0 sends in its second; and each posting
    thread issues its next group only after its current wait returns, so neither ever does.
    A stream that did not keep order (a later group issued before the current one is done)
    shows as more issues than that, and the wait ends at the first extra issue, not at a
    timeout. Neither rank exits before both have counted (store keys): an exiting peer would
    fail the other's pending groups.
    """
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    keys = dist.distributed_c10d._get_default_store()
    groups = ProcessGroups.build(ParallelDims(pp=2))
    log = _IssueLog(groups.pp)
    comm = _posted_comm("legacy", True, groups)
    issued, waiting = log.wait_for(1 + rank, 120.0)
    done = sum(p.done.is_set() for p in comm.pending)
    keys.set(f"counted{rank}", "1")
    keys.wait(["counted0", "counted1"])
    print(json.dumps({"rank": rank, "done": done, "groups": len(comm.pending),
                      "issued": issued, "waiting": waiting}), flush=True)
    os._exit(0)


def test_legacy_posting_stalls_in_order(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = "import sys; from tests.pipeline.test_in_order import stall_main; " \
          "stall_main(int(sys.argv[1]), sys.argv[2])"
    procs = [subprocess.Popen([sys.executable, "-c", cmd, str(r), str(tmp_path / "store")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    out = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    # rank 0 is stuck in its first group {send F0, recv B0}; rank 1 finished {recv F0} only
    assert [(o["done"], o["groups"]) for o in out] == [(0, 6), (1, 8)]
    # ... and each is blocked in the wait of its last issued group, nothing issued beyond it
    assert [(o["issued"], o["waiting"]) for o in out] == [(1, 0), (2, 1)]


def test_legacy_posting_completes_on_free_gloo(run_ranks: Callable[..., list[Any]]) -> None:
    assert run_ranks(2, rank_complete, "legacy", False) == [[], []]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_executor_posting_completes_in_order_and_free(
        run_ranks: Callable[..., list[Any]], schedule: str) -> None:
    assert run_ranks(2, rank_complete, "program", True, schedule) == [[], []]
    assert run_ranks(2, rank_complete, "program", False, schedule) == [[], []]
