"""Fault injection for the reliability tests: ranks that misbehave on purpose.

A :class:`Fault` hits one rank at one training step (1-based, the step being taken) of one
attempt:
  'hang'   the rank sleeps in Python (blocked outside any collective) for an hour;
  'kill'   the rank SIGKILLs itself in the middle of the step's backward pass;
  'lose'   as 'kill', and its node's memory is lost with it: once its snapshot in flight is
           written, every memory snapshot file it holds (its own, the copies it keeps for its
           source) is deleted first; the time of the kill goes to logging.dir/killed_at;
  'lose-both' as 'lose', and its partner's copy of its state is deleted too (both holders of
           its shard are gone: the recovery must fall back to the disk);
  'nan'    the gradient of parameter ``param`` becomes NaN on that step;
  'raise'  the rank raises RuntimeError at the start of the step;
  'stop'   the rank freezes itself with SIGSTOP at the start of the step (every thread stops,
           its monitor too: a hang that no in-rank watchdog can report);
  'slow'   the rank sleeps :data:`SLOW_S` seconds at the start of this step and of every later
           one (after its batches are fetched: its compute looks slow; a straggler).

Run a job with a fault (same arguments as ``colonnade train``)::

    python -m tests.reliability.faults --fault hang:1:3 --nproc 4 --parallel.tp=2 ...

``install`` patches ``Trainer.train_step`` in the current process (used inside the spawned
ranks and by in-process tests).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from colonnade.config.sections import Config

SLOW_S = 0.1
"""Seconds a 'slow' rank sleeps per step (a tiny model's step on 2 cores takes ~20-50 ms)."""


@dataclass(frozen=True)
class Fault:
    """What goes wrong, where and when."""

    kind: str
    rank: int
    step: int
    attempt: int = 0
    param: str = "layers.1.mlp.down.weight"

    @classmethod
    def parse(cls, text: str) -> Fault:
        """'kind:rank:step[:attempt[:param]]'."""
        kind, rank, step, *rest = text.split(":")
        attempt = int(rest[0]) if rest else 0
        param = rest[1] if len(rest) > 1 else cls.param
        return cls(kind, int(rank), int(step), attempt, param)


def _find(trainer: Any, key: str) -> torch.nn.Parameter | None:
    for chunk in trainer.chunks:
        for p in chunk.parameters():
            if p.sharding.key == key:
                return p
    return None


def install(fault: Fault, *more: Fault) -> None:
    """Patch ``Trainer.train_step`` so that ``fault`` (and ``more``) happen (idempotent per
    process: a later install replaces the faults)."""
    from colonnade.training.loop import Trainer

    first = fault
    original = getattr(Trainer, "_unfaulted_train_step", Trainer.train_step)
    Trainer._unfaulted_train_step = original  # type: ignore[attr-defined]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + _generation()

    def train_step(self: Any, batches: list[Any], signum: int = 0) -> dict[str, float]:
        hits = [f for f in (first, *more) if self.groups.rank == f.rank
                and self.step + 1 == f.step and attempt == f.attempt]
        fault, hit = (hits[0], True) if hits else (first, False)
        handles = []
        if (fault.kind == "slow" and self.groups.rank == fault.rank and self.step + 1 >= fault.step
                and attempt == fault.attempt):
            time.sleep(SLOW_S)
        if hit and fault.kind == "hang":
            time.sleep(3600)
        if hit and fault.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if hit and fault.kind == "raise":
            raise RuntimeError(f"injected failure on rank {fault.rank} at step {fault.step}")
        if hit and fault.kind in ("lose", "lose-both"):
            _lose_memory(self, both=fault.kind == "lose-both")
        if hit and fault.kind in ("nan", "kill", "lose", "lose-both"):
            p = _find(self, fault.param)
            if p is None:  # this pp stage does not hold it: use its first parameter
                p = next(iter(self.chunks[0].parameters()))
            if fault.kind == "nan":
                handles.append(p.register_hook(lambda g: torch.full_like(g, float("nan"))))
            else:
                handles.append(p.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL)))
        try:
            return original(self, batches, signum)
        finally:
            for h in handles:
                h.remove()

    Trainer.train_step = train_step  # type: ignore[method-assign]


def _lose_memory(trainer: Any, both: bool) -> None:
    """Delete the memory snapshot files this rank holds (and, ``both``, its partner's copy
    of its state), then note the time: what a lost node takes with it."""
    from pathlib import Path

    snaps = trainer.snapshots
    snaps.wait()
    for held in snaps.holdings(check=False):
        held.path.unlink()
    if both:  # once the partner holds the newest copy (its thread writes it after the send)
        from colonnade.checkpoint.memory import peer_name

        newest = snaps.dir / peer_name(snaps.rank, snaps.last_step, snaps.partner)
        deadline = time.monotonic() + 60.0  # a backstop: the file comes, or the test broke
        while not newest.exists():
            assert time.monotonic() < deadline, f"{newest} never appeared"
            time.sleep(0.01)
        for path in snaps.dir.glob(f"rank{snaps.rank:05d}.*.peer-on*"):
            path.unlink(missing_ok=True)
    Path(trainer.config.logging.dir, "killed_at").write_text(repr(time.time()))


def _generation() -> int:
    """The in-process restart generation this process started in (0: an original rank; g: the
    replacement started by the g-th in-process restart), read from the supervisor's store, so
    a fault hits only the process it was meant for, not its replacement."""
    from colonnade.reliability.rejoin import SUPERVISOR_KEY, read_generation

    if "MASTER_PORT" not in os.environ or "TORCHELASTIC_USE_AGENT_STORE" not in os.environ:
        return 0
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    if not store.check([SUPERVISOR_KEY]):
        return 0
    return read_generation(store, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def uninstall() -> None:
    """Undo :func:`install` (ranks of a persistent pool run later tests)."""
    from colonnade.training.loop import Trainer

    original = getattr(Trainer, "_unfaulted_train_step", None)
    if original is not None:
        Trainer.train_step = original  # type: ignore[method-assign]


def faulty_rank(config: Config, fault: Fault, *more: Fault) -> dict[str, Any]:
    """A rank entry point: install the fault(s), then run the ordinary rank body."""
    from colonnade.launch import run_rank

    install(fault, *more)
    return run_rank(config)


def main(argv: list[str]) -> int:
    """``colonnade train`` with ``--fault kind:rank:step[:attempt[:param]]`` (repeated: each
    fault happens)."""
    from colonnade.cli import build_parser
    from colonnade.config.load import load_config
    from colonnade.config.validate import resolve, validate
    from colonnade.launch import launch

    faults, rest = [], list(argv)
    while "--fault" in rest:
        i = rest.index("--fault")
        faults.append(Fault.parse(rest[i + 1]))
        rest = rest[:i] + rest[i + 2:]
    args, extra = build_parser().parse_known_args(["train", *rest])
    world = args.nproc * args.nnodes
    config = validate(resolve(load_config(args.config, extra), world), world)
    return launch(config, args, extra, entrypoint=faulty_rank,
                  entry_args=(config, *faults))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
