"""Issue 15's benchmark plumbing (benchmarks/data_parallel.py, benchmarks/peer_table.py), no
training run: the ZeRO-2/3 variants' CLI overrides resolve to the stage and reshard policy they
name, the comm counters split into gather / reduction exposed time per step, storage accounting
counts each distinct storage once (parameters, gradients, AdamW moments: 4 + 4 + 8 bytes per
fp32 parameter), and the peer table places the new rows after dp2 + ZeRO-1 with no issue-19
ratio and never lists them as "not run"."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench(name: str) -> ModuleType:
    """Import benchmarks/<name>.py without keeping its environment defaults."""
    with mock.patch.dict(os.environ), mock.patch.object(sys, "path", [str(BENCH), *sys.path]):
        return importlib.import_module(name)


@pytest.mark.parametrize(("variant", "stage", "reshard"), [
    ("colonnade_ddp", 0, True), ("colonnade_zero1", 1, True), ("colonnade_zero2", 2, True),
    ("colonnade_zero3", 3, True), ("colonnade_zero3_no_reshard", 3, False)])
def test_variant_overrides_resolve(variant: str, stage: int, reshard: bool) -> None:
    dp = _bench("data_parallel")
    w = dp.WORKLOADS["llama-tiny"]
    cfg = dp.colonnade_config(w, 8, 2, dp.colonnade_overrides(variant, 4096))
    assert cfg.parallel.zero == stage and cfg.parallel.dp == 2
    assert cfg.parallel.bucket_size == 4096
    if stage == 3:
        assert cfg.parallel.reshard is reshard


def test_comm_summary_splits_gathers_and_reductions() -> None:
    dp = _bench("data_parallel")
    op = {"calls": 1, "payload_bytes": 0, "in_flight_s": 0.0}
    snap = {"dp_cp/all_gather/params": {**op, "wire_bytes": 100.0, "waited_s": 0.3},
            "dp_cp/reduce_scatter/grads": {**op, "wire_bytes": 300.0, "waited_s": 0.5},
            "dp_cp/all_reduce": {**op, "wire_bytes": 8.0, "waited_s": 0.1},
            "tp/all_reduce": {**op, "wire_bytes": 1e6, "waited_s": 9.0},
            "world/all_reduce/log_loss": {**op, "wire_bytes": 8.0, "waited_s": 7.0}}
    got = dp.comm_summary(snap, steps=2)
    assert got["wire_bytes"] == pytest.approx(204.0)
    assert got["exposed_s"] == pytest.approx(0.45)
    assert got["gather_exposed_s"] == pytest.approx(0.15)
    assert got["reduce_exposed_s"] == pytest.approx(0.30)


def test_state_bytes_counts_each_storage_once() -> None:
    dp = _bench("data_parallel")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3, bias=False))
    n = 8 * 4 + 4 + 4 * 3
    assert dp.state_bytes(model) == 4 * n
    model(torch.randn(2, 8)).sum().backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    # params + grads + exp_avg + exp_avg_sq (fp32), plus one fp32 step counter per parameter
    assert dp.state_bytes(model, opt, [model, opt]) == 16 * n + 4 * 3
    flat = torch.zeros(10)
    assert dp.state_bytes({"a": flat[:5], "b": flat[5:]}, (flat,)) == 40


@pytest.mark.parametrize("have_ds", [True, False])
def test_select_variants_and_rows(have_ds: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's variants are selected exactly when it is importable (CI has no DeepSpeed:
    both cases are decided here, not by what is installed)."""
    dp = _bench("data_parallel")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if have_ds else None) if name == "deepspeed"
                        else real(name, *a))
    plain = dp.select_variants(None)
    full = dp.select_variants(None, zero23=True)
    assert not set(plain) & set(dp.ZERO23) and full[:len(plain)] == plain
    assert set(dp.ZERO23) <= set(full) and ("deepspeed_zero3" in full) == have_ds
    for layout, (ours, peers) in dp.ROWS.items():
        assert ours in full, layout
        assert all(p in dp.NAMES for p in peers)
        assert set(peers) <= set(full) or not have_ds, layout


def test_peer_table_places_zero_rows() -> None:
    pt = _bench("peer_table")
    names = [name for name, _ in pt.LAYOUTS]
    z1 = names.index("dp2 + ZeRO-1")
    assert names[z1 + 1:z1 + 4] == ["dp2 + ZeRO-2", "dp2 + ZeRO-3", "dp2 + ZeRO-3 no reshard"]
    assert pt.issue_key("dp2 + ZeRO-3 no reshard") == z1 + 3
    assert pt.issue_key("dp2 + ZeRO-3") == z1 + 2 and pt.issue_key("dp2") == names.index("dp2")
    rows = [{"layout": "dp2 + ZeRO-3", "colonnade": 10.0, "peer": "FSDP2",
             "peer_tokens_per_s": 8.0, "ratio": 1.25, "ratio_cpu": 1.1, "issue_ratio": None}]
    table = pt.markdown(rows, "gpt2-tiny")
    lines = table.splitlines()
    assert "| dp2 + ZeRO-3 | 10 | FSDP2 8 | 1.25 | 1.10 | - |" in lines
    assert not any("ZeRO-2" in line or "no reshard" in line for line in lines)
    assert lines.index("| dp2 + ZeRO-1 | not run | - | - | - | 0.96 |") < lines.index(
        "| dp2 + ZeRO-3 | 10 | FSDP2 8 | 1.25 | 1.10 | - |")
    cmd = pt.command("data_parallel", "gpt2-tiny", Path("x.json"), False, zero23=True)
    assert cmd[-1] == "--zero23"
    assert "--zero23" not in pt.command("tensor_parallel", "gpt2-tiny", Path("x"), False, True)


def test_peer_table_zero_notes() -> None:
    pt = _bench("peer_table")
    rows = [{"layout": "dp2 + ZeRO-3", "peer": "FSDP2", "colonnade_gather_exposed_s": 0.0125,
             "colonnade_state_bytes": 3 * 2**20, "peer_state_bytes": 2.5 * 2**20,
             "colonnade_step_rss_peak_bytes": 40 * 2**20},
            {"layout": "dp2 + ZeRO-1", "peer": "FSDP2", "colonnade_state_bytes": 2**20}]
    assert pt.zero_notes(rows) == [
        "- dp2 + ZeRO-3: Colonnade parameter all-gather exposed 12.5 ms/step; per rank, "
        "Colonnade / FSDP2: training state 3.0 / 2.5 MB, RSS growth in the timed steps 40.0 / - MB"]
    assert pt.zero_notes(rows[1:]) == []
