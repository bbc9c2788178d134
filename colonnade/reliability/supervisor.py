"""In-process restart, the launcher's side: a small local supervisor that replaces a dead rank.

``colonnade train --nproc N --max-restarts R --checkpoint.restart=in-process`` runs the ranks
under :func:`supervise` instead of torch's elastic agent (which would stop every rank when one
dies). The supervisor

* hosts the job's store (a TCPStore on a free local port; the ranks are clients, as under the
  agent: ``TORCHELASTIC_USE_AGENT_STORE``), so it outlives any rank, rank 0 included;
* spawns the N ranks itself (``spawn`` start method, the usual RANK / WORLD_SIZE / LOCAL_RANK /
  MASTER_ADDR / MASTER_PORT / TORCHELASTIC_RESTART_COUNT / TORCHELASTIC_RUN_ID environment);
* when a rank dies and restarts are left, bumps the generation in the store
  (:func:`colonnade.reliability.rejoin.generation_key`) and spawns one replacement with the same
  RANK: the survivors leave their broken groups and rejoin generation g with it
  (:mod:`colonnade.reliability.rejoin`), then every rank restores the state and goes on;
* falls back to a whole-job restart (every rank stopped and started again with the next
  TORCHELASTIC_RESTART_COUNT, resuming from the latest checkpoint as under the agent) when a
  rank fails while a generation is still rejoining (fewer than N ranks have marked it ready),
  or a rank says it could not rejoin;
* counts both kinds against ``--max-restarts``; when none is left it stops every rank and
  prints the failure report, exit status 1. Bad input (a rank exits 2) is never restarted.

A hang is ended as before: a rank's watchdog records it, the collective timeout ends the rank
(a death, replaced as above), and :class:`~colonnade.reliability.watch.HeartbeatWatch` SIGKILLs
a rank frozen as a whole. Ctrl-C / SIGTERM are forwarded to the ranks, which save and stop.
One node only (a multi-node job would need one supervisor per node agreeing on generations).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colonnade.reliability.rejoin import (
    REJOIN_FAILED,
    SUPERVISOR_KEY,
    generation_key,
    ready_key,
)

IN_PROCESS_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
"""Torch's NCCL watchdog, on a failed or timed-out collective, aborts the communicators and
lets the process live (2, 'clean up only'; the job-restart path's 3 ends the process): the
host call then raises and the rank rejoins. A hang is still ended by ``parallel.timeout_s``."""
POLL_S = 0.05
"""How often the supervisor looks at its ranks (seconds)."""
BAD_INPUT = 2
"""Exit status of a rank that found bad input (never restarted)."""


def _rank_process(env: dict[str, str], entrypoint: Callable[..., Any],
                  entry_args: tuple[Any, ...]) -> None:
    """The body of a spawned rank: its environment, then ``entrypoint(*entry_args)``."""
    os.environ.update(env)
    entrypoint(*entry_args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Supervisor:
    """The ranks of one node and the store they rejoin through."""

    nproc: int
    max_restarts: int
    entrypoint: Callable[..., Any]
    entry_args: tuple[Any, ...]
    run_id: str
    say: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr,
                                                                    flush=True))
    attempt: int = 0
    generation: int = 0
    restarts: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    """Each restart: kind ('in-process' | 'job'), rank, exit code, time (``time.time()``)."""
    stopped: int = 0
    """The stop signal (Ctrl-C / SIGTERM) forwarded to the ranks; 0: none. A stopped job is
    never restarted."""

    def __post_init__(self) -> None:
        import torch.distributed as dist

        self.port = _free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, None, True, wait_for_workers=False)
        self.store.set(SUPERVISOR_KEY, "in-process")
        self._ctx = mp.get_context("spawn")
        self.procs: dict[int, Any] = {}

    def _env(self, rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.nproc),
                "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
                "TORCHELASTIC_RUN_ID": self.run_id, "TORCHELASTIC_MAX_RESTARTS":
                str(self.max_restarts), **IN_PROCESS_NCCL_ENV}

    def spawn(self, rank: int) -> None:
        """Start rank ``rank`` (of the current attempt and generation)."""
        proc = self._ctx.Process(target=_rank_process, name=f"colonnade-rank{rank}",
                                 args=(self._env(rank), self.entrypoint, self.entry_args))
        proc.start()
        self.procs[rank] = proc

    def stop_all(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every live rank and wait for them."""
        for proc in self.procs.values():
            if proc.exitcode is None and proc.pid is not None:
                os.kill(proc.pid, sig)
        for proc in self.procs.values():
            proc.join()

    def generation_ready(self) -> bool:
        """Every rank has rejoined and restored the current generation (generation 0, the
        first start, counts as ready)."""
        if self.generation == 0:
            return True
        return int(self.store.add(ready_key(self.attempt, self.generation), 0)) >= self.nproc

    def on_failure(self, rank: int, code: int) -> bool:
        """Rank ``rank`` ended with ``code``: replace it in process, or restart the job;
        False when no restart is left (or bad input)."""
        if code == BAD_INPUT or self.restarts >= self.max_restarts:
            return False
        self.restarts += 1
        in_process = code != REJOIN_FAILED and self.generation_ready()
        self.events.append({"kind": "in-process" if in_process else "job", "rank": rank,
                            "code": code, "time": time.time()})
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        if in_process:
            self.generation += 1
            self.store.set(generation_key(self.attempt), str(self.generation))
            self.say(f"colonnade: rank {rank} died ({how}); in-process restart "
                     f"{self.restarts}/{self.max_restarts}: replacing it, the other ranks "
                     f"rejoin as generation {self.generation}")
            self.spawn(rank)
            return True
        self.say(f"colonnade: rank {rank} failed ({how}) while generation {self.generation} "
                 f"was rejoining; restarting the whole job ({self.restarts}/"
                 f"{self.max_restarts}) from the latest checkpoint")
        self.stop_all()
        self.attempt, self.generation = self.attempt + 1, 0
        for r in range(self.nproc):
            self.spawn(r)
        return True

    def run(self) -> int:
        """Start the ranks and supervise them; the job's exit status: 0 when every rank ended
        with 0, 2 for bad input, 1 for a failure with no restart left."""
        for r in range(self.nproc):
            self.spawn(r)
        while True:
            time.sleep(POLL_S)
            codes = {r: p.exitcode for r, p in self.procs.items()}
            if self.stopped and all(c is not None for c in codes.values()):
                return 0
            failed = [(r, c) for r, c in codes.items() if c not in (None, 0)]
            if not failed and all(c == 0 for c in codes.values()):
                return 0
            for rank, code in failed if not self.stopped else []:
                if not self.on_failure(rank, code):
                    self.stop_all()
                    return BAD_INPUT if code == BAD_INPUT else 1
                if self.generation == 0:  # the whole job restarted: the other codes are old
                    break


def supervise(nproc: int, max_restarts: int, entrypoint: Callable[..., Any],
              entry_args: tuple[Any, ...], run_id: str) -> tuple[int, Supervisor]:
    """Run ``entrypoint(*entry_args)`` in ``nproc`` supervised ranks (see the module); returns
    the exit status and the supervisor (its restart events)."""
    sup = Supervisor(nproc, max_restarts, entrypoint, entry_args, run_id)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def forward(signum: int, _frame: Any) -> None:  # the ranks save and stop
        for proc in sup.procs.values():
            if proc.exitcode is None and proc.pid is not None:
                os.kill(proc.pid, signum)
        sup.stopped = signum

    for s in previous:
        signal.signal(s, forward)
    try:
        status = sup.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sup.stop_all()
    return (128 + sup.stopped if sup.stopped and status == 0 else status), sup
