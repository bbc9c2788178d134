"""Muon's momentum reshards like AdamW's moments (issue 38, part D), float64.

A Muon run saves after 2 steps under dp2 ZeRO-1 (each dp rank writes its flat ranges of every
matrix's momentum) and continues 2 more; resumed single-process and under tp2 it must continue
with the same losses (rel. 1e-12) and end with the same parameters: the step after the resume
reads the momentum, so a momentum restored wrongly (or not at all) shows. The checkpoint holds
``momentum`` and no Adam moments for a Muon matrix, Adam moments for the rest, each element
once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.checkpoint.harness import Layout
from tests.checkpoint.test_zero_reshard import Zero, _same, _stored_once, load_run, save_run

SAVED = Zero(Layout(dp=2), 1, optim="muon")
TARGETS = [Zero(Layout(), 0, optim="muon"), Zero(Layout(tp=2), 0, optim="muon")]


def test_muon_momentum_reshards(run_ranks: Callable[..., list[Any]], tmp_path: Path) -> None:
    root = tmp_path / "muon"
    stayed = run_ranks(SAVED.world, save_run, SAVED, str(root), 2, 2)
    step = sorted(root.glob("step_*"))[-1]
    names = set(json.loads((step / "index.json").read_text())["tensors"])
    matrix, vector = "layers.0.mlp.down.weight", "final_norm.weight"
    assert f"optim/{matrix}/momentum" in names and f"optim/{matrix}/exp_avg" not in names
    assert {f"optim/{vector}/exp_avg", f"optim/{vector}/exp_avg_sq"} <= names
    assert f"optim/{vector}/momentum" not in names
    meta = json.loads((step / "metadata.json").read_text())["optimizer"]
    assert meta["name"] == "muon" and meta["states"][matrix] == ["momentum"]
    _stored_once(root)
    for z in TARGETS:
        moved = run_ranks(z.world, load_run, z, str(root), 2)
        assert moved[0]["step"] == 4
        _same(stayed, moved)
