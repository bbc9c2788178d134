"""``colonnade train --config configs/tiny-moe.toml --nproc 2`` (the example: 8 experts, top-2,
ep2) as a user runs it, shrunk to a few float64 steps on the test corpus: the same losses as
one process (ep1) on the same global batch to 1e-12, the layout line names ep2, the console
line shows the per-expert load, and metrics.jsonl's loads count every token slot of the
global batch exactly once per layer (one world all-reduce over the ranks that saw different
tokens). The aux loss is 'seq' here: a 'global' one counts a micro-step's dp micro-batches
together, which one process with 4 micro-batches cannot reproduce (the parity harness does,
by concatenating them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.jobs import losses, tiny_args
from tests.workflow.cli import run_cli
from tests.workflow.conftest import corpus

__all__ = ["corpus"]

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "tiny-moe.toml"
STEPS, TOL = 4, 1e-12
SLOTS = 2 * 2 * 2 * 16 * 2  # micro-batch 2 x microbatches 2 x dp 2 x seq 16 x top-2


def _args(corpus: tuple[Path, Path], run: Path, **extra: object) -> list[str]:
    return ["--config", str(EXAMPLE), *tiny_args(
        *corpus, run, training__precision="fp64", training__steps=STEPS,
        model__moe_aux_loss_type="seq", model__moe_z_loss_coeff=1e-3, **extra)]


def test_tiny_moe_ep2_equals_one_process(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    one, two = tmp_path / "ep1", tmp_path / "ep2"
    status, out1 = run_cli(["train", *_args(corpus, one, parallel__ep=1, parallel__dp=1,
                                            training__microbatches=4)])
    assert status == 0, out1
    status, out2 = run_cli(["train", "--nproc", "2", *_args(corpus, two)])
    assert status == 0, out2
    assert "colonnade: dp2-ep2 on cpu" in out2, out2
    want, got = losses(one), losses(two)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (got, want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=TOL, abs=0.0), (step, got, want)
    assert "moe max/mean" in out2 and " load L" in out2, out2
    recs = {run: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            for run in (one, two)}
    for a, b in zip(recs[one], recs[two], strict=True):
        assert a["moe_load"] == b["moe_load"]  # identical routing in both layouts
        assert sorted(b["moe_load"]) == ["0", "1"]  # every layer is MoE (2 layers)
        for layer, load in b["moe_load"].items():
            assert len(load) == 8 and sum(load) == SLOTS, (layer, load)
            assert b[f"moe/{layer}/load_max_mean"] == pytest.approx(max(load) / (SLOTS / 8))
            assert b[f"moe/{layer}/load_balance"] == pytest.approx(
                a[f"moe/{layer}/load_balance"], rel=TOL)
            assert 0.0099 < b[f"moe/{layer}/load_balance"] < 0.03  # coeff 0.01 x E sum f P
        assert b["moe_dropped_frac"] == 0.0  # dropless


def test_moe_log_fields_by_hand() -> None:
    """moe_metrics / format_moe on hand rows: 2 layers (ids 1, 3), E = 4; columns loads [4],
    dropped, routed, micro-batches / stage, load_balance and z_loss sums / stage."""
    import torch

    from colonnade.training.metrics import format_line
    from colonnade.training.moe import moe_metrics

    rows = torch.tensor([[10.0, 10, 10, 10, 0, 40, 2, 0.02, 0.002],
                         [25.0, 5, 5, 5, 4, 40, 2, 0.04, 0.0]], dtype=torch.float64)
    got = moe_metrics(rows, [1, 3], 4)
    assert got["moe_load"] == {"1": [10, 10, 10, 10], "3": [25, 5, 5, 5]}
    assert got["moe/1/load_max_mean"] == 1.0 and got["moe/3/load_max_mean"] == 2.5
    assert got["moe/3/dropped_frac"] == 0.1 and got["moe_dropped_frac"] == 4 / 80
    assert got["moe/1/load_balance"] == pytest.approx(0.01)  # sum 0.02 over 2 micro-batches
    assert got["moe_aux_loss"] == pytest.approx(0.03) and got["moe_z_loss"] == pytest.approx(1e-3)
    assert got["moe_load_max_mean"] == 2.5
    line = format_line({"step": 1, "loss": 2.0, **got})
    assert "moe max/mean 2.50 | drop 5.0% | aux 0.0300 | z 1.00e-03 | load L3 62/12/12/12%" \
        in line, line
