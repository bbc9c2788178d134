"""Fault injection for the reliability tests: ranks that misbehave on purpose.

A :class:`Fault` hits one rank at one training step (1-based, the step being taken) of one
attempt:
  'hang'   the rank sleeps in Python (blocked outside any collective) for an hour;
  'kill'   the rank SIGKILLs itself in the middle of the step's backward pass;
  'nan'    the gradient of parameter ``param`` becomes NaN on that step;
  'raise'  the rank raises RuntimeError at the start of the step;
  'stop'   the rank freezes itself with SIGSTOP at the start of the step (every thread stops,
           its monitor too: a hang that no in-rank watchdog can report).

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


def install(fault: Fault | list[Fault]) -> None:
    """Patch ``Trainer.train_step`` so that ``fault`` (or each of a list) happens (idempotent
    per process: a new install replaces the faults of the previous one)."""
    from colonnade.training.loop import Trainer

    original = getattr(Trainer, "_unfaulted_train_step", Trainer.train_step)
    Trainer._unfaulted_train_step = original  # type: ignore[attr-defined]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + _generation()
    faults = fault if isinstance(fault, list) else [fault]

    def train_step(self: Any, batches: list[Any], signum: int = 0) -> dict[str, float]:
        hit = next((f for f in faults if self.groups.rank == f.rank
                    and self.step + 1 == f.step and attempt == f.attempt), None)
        handles = []
        if hit is not None and hit.kind == "hang":
            time.sleep(3600)
        if hit is not None and hit.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if hit is not None and hit.kind == "raise":
            raise RuntimeError(f"injected failure on rank {hit.rank} at step {hit.step}")
        if hit is not None and hit.kind in ("nan", "kill"):
            p = _find(self, hit.param)
            if p is None:  # this pp stage does not hold it: use its first parameter
                p = next(iter(self.chunks[0].parameters()))
            if hit.kind == "nan":
                handles.append(p.register_hook(lambda g: torch.full_like(g, float("nan"))))
            else:
                handles.append(p.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL)))
        try:
            return original(self, batches, signum)
        finally:
            for h in handles:
                h.remove()

    Trainer.train_step = train_step  # type: ignore[method-assign]


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


def faulty_rank(config: Config, faults: Fault | list[Fault]) -> dict[str, Any]:
    """A rank entry point: install the faults, then run the ordinary rank body."""
    from colonnade.launch import run_rank

    install(faults)
    return run_rank(config)


def main(argv: list[str]) -> int:
    """``colonnade train`` with ``--fault kind:rank:step[:attempt[:param]]`` (repeatable)."""
    from colonnade.cli import build_parser
    from colonnade.config.load import load_config
    from colonnade.config.validate import resolve, validate
    from colonnade.launch import launch

    faults, rest = [], list(argv)
    while "--fault" in rest:  # repeated: several faults
        i = rest.index("--fault")
        faults.append(Fault.parse(rest[i + 1]))
        del rest[i:i + 2]
    args, extra = build_parser().parse_known_args(["train", *rest])
    world = args.nproc * args.nnodes
    config = validate(resolve(load_config(args.config, extra), world), world)
    return launch(config, args, extra, entrypoint=faulty_rank, entry_args=(config, faults))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
