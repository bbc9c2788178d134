"""Straggler detection (colonnade/reliability/straggler.py).

The rule is tested pure over synthetic windows of a synchronous job (every rank's step lasts as
long as the slowest rank's own work; the others wait the difference in collectives): 200 noisy
normal windows name nobody, a rank slowed in one part is named with that part within
``windows`` windows. Then two short real jobs on the rank pool (tp2 x dp2): rank 3 slowed by a
sleep in its step is named in metrics.jsonl and the log, and the same job without the sleep
names nobody.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from colonnade.config.load import load_config
from colonnade.config.validate import problems
from colonnade.reliability.straggler import PARTS, Streaks
from tests.reliability import faults
from tests.reliability.jobs import tiny_args
from tests.workflow import cli as cli_helpers

STAGES = [[0, 1, 2, 3], [4, 5, 6, 7]]
"""Two pipeline stages of four ranks; stage 1 does 1.5x the work of stage 0 by design."""


def synthetic_window(gen: torch.Generator, slow: dict[int, tuple[str, float]]) -> torch.Tensor:
    """``[8, len(PARTS)]`` seconds per step of one window of a synchronous pp2 job: own parts
    with 10% log-normal noise (stage 1 1.5x heavier), ``slow`` {rank: (part, factor)}; comm =
    the slowest own work of the job minus this rank's (it waits for the slowest)."""
    base = torch.tensor([0.002, 0.100, 0.0, 0.010], dtype=torch.float64)  # data compute - optim
    t = base.expand(8, -1).clone()
    t[4:] *= 1.5
    t *= torch.exp(0.1 * torch.randn(8, len(PARTS), generator=gen, dtype=torch.float64))
    for rank, (part, factor) in slow.items():
        t[rank, PARTS.index(part)] *= factor
    own = t.sum(dim=1) - t[:, PARTS.index("comm")]
    t[:, PARTS.index("comm")] = own.max() - own + 0.001
    return t


@pytest.mark.parametrize("slow", [None, (5, "data", 20.0), (2, "compute", 1.5)])
def test_rule_over_synthetic_windows(slow: tuple[int, str, float] | None) -> None:
    """200 windows: with no slow rank, nobody is ever named (stages of unequal work, noise and
    a one-window hiccup of a random rank every 10 windows included); a rank slowed from window
    50 on is named at window 52 (3 windows) with its part and about its factor, and only it."""
    gen = torch.Generator().manual_seed(0)
    streaks = Streaks(STAGES, threshold=1.2, windows=3, nodes=[f"n{r // 2}" for r in range(8)])
    named = []
    for w in range(200):
        hit = {} if slow is None or w < 50 else {slow[0]: (slow[1], slow[2])}
        if w % 10 == 5:  # a single slow window (a page fault storm): never persistent
            hit = {**hit, int(torch.randint(8, (1,), generator=gen)): ("compute", 2.0)}
        named += [(w, s) for s in streaks.update(synthetic_window(gen, hit))]
    if slow is None:
        assert named == []
        return
    rank, part, factor = slow
    assert named, "the slowed rank was never named"
    first_window, first = named[0]
    assert first_window == 52 and first.windows == 3
    assert (first.rank, first.node, first.part) == (rank, f"n{rank // 2}", part)
    assert 0.7 * factor < first.ratio < 1.4 * factor
    assert {s.rank for _, s in named} == {rank}
    assert "is a straggler: " + part in first.describe()


def test_config_checks() -> None:
    """The window must end on a log step; threshold > 1; windows >= 1 (named, with a fix)."""
    found = problems(load_config(None, ["--logging.log_interval=4",
                                        "--logging.straggler_interval=6",
                                        "--logging.straggler_threshold=1.0",
                                        "--logging.straggler_windows=0"]))
    text = "\n".join(found)
    assert "logging.straggler_interval=6 must be a multiple of logging.log_interval=4" in text
    assert "--logging.straggler_interval=4" in text
    assert "logging.straggler_threshold=1.0 must be > 1" in text
    assert "logging.straggler_windows=0 must be >= 1" in text


def slowed_pool_rank(config: Any) -> str:
    """A pool rank of ``colonnade train`` whose rank 3 sleeps ``faults.SLOW_S`` in every step."""
    faults.install(faults.Fault("slow", rank=3, step=1))
    try:
        return cli_helpers.pool_rank(config)
    finally:
        faults.uninstall()


@pytest.mark.parametrize("slow", [False, True])
def test_real_job(slow: bool, cli: Any, corpus: tuple[Path, Path], tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> None:
    """tp2 x dp2, 8 steps, windows of 4 steps, named after 2: rank 3 sleeping 0.1 s per step
    is named at step 8 with 'compute' (its peers' wait shows as comm, not as work); without
    the sleep nobody is named."""
    if slow:
        monkeypatch.setattr(cli_helpers, "pool_rank", slowed_pool_rank)
    run = tmp_path / "run"
    status, out = cli(["train", "--nproc", "4", "--parallel.tp=2", *tiny_args(
        *corpus, run, training__steps=8, logging__log_interval=4,
        logging__straggler_interval=4, logging__straggler_windows=2,
        logging__straggler_threshold=2.0)])
    assert status == 0, out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    named = [(r["step"], s) for r in records for s in r.get("stragglers", [])]
    if not slow:
        assert named == [] and "straggler" not in out
        return
    assert [(step, s["rank"], s["part"], s["windows"]) for step, s in named] == [
        (8, 3, "compute", 2)]
    assert named[0][1]["ratio"] > 2.0
    assert "colonnade: rank 3 (node " in out and "is a straggler: compute" in out
