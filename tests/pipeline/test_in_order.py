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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from colonnade.config.choices import schedule_placement
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.nccl_model import Group
from colonnade.pipeline.p2p import Message, PipeComm, stage_program
from colonnade.pipeline.schedules import build_schedule
from tests.pipeline.test_nccl_model import legacy_groups

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


def stall_main(rank: int, store: str) -> None:
    """A throw-away rank: post the legacy groups in order, report how many completed, then
    exit without waiting for the stuck stream.

    Ordered by store keys, not by racing sleeps: rank 1 counts once its first group ({recv F0})
    is done (up to 60 s on a loaded machine) and 1.5 s more passed for a wrong second completion
    to show; rank 0 (whose first group can never complete) counts after rank 1 has; neither
    exits before both have counted (an exiting peer would fail the other's pending groups).
    """
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    keys = dist.distributed_c10d._get_default_store()
    comm = _posted_comm("legacy", True, ProcessGroups.build(ParallelDims(pp=2)))
    deadline = time.monotonic() + 60.0
    while rank == 1 and not comm.pending[0].done.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)
    if rank == 0:
        keys.wait(["counted1"])
    done = sum(p.done.is_set() for p in comm.pending)
    keys.set(f"counted{rank}", "1")
    keys.wait(["counted0", "counted1"])
    print(json.dumps({"rank": rank, "done": done, "groups": len(comm.pending)}), flush=True)
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


def test_legacy_posting_completes_on_free_gloo(run_ranks: Callable[..., list[Any]]) -> None:
    assert run_ranks(2, rank_complete, "legacy", False) == [[], []]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_executor_posting_completes_in_order_and_free(
        run_ranks: Callable[..., list[Any]], schedule: str) -> None:
    assert run_ranks(2, rank_complete, "program", True, schedule) == [[], []]
    assert run_ranks(2, rank_complete, "program", False, schedule) == [[], []]
