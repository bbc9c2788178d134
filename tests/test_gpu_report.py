"""The GPU benchmark's tables and parsers from canned results (no training, no GPU)."""

from __future__ import annotations

import pytest

from benchmarks.gpu_check import STAGES
from benchmarks.gpu_peers import parse_torchtitan
from benchmarks.gpu_report import BEGIN, END, ROWS, readme_table, update_readme

RESULTS = {"mode": "gpu", "stages": [
    {"stage": "environment", "status": "ok", "gpu": "NVIDIA H100 80GB HBM3"},
    {"stage": "train_1p3b", "status": "ok",
     "measured": {"mfu": 0.43, "tokens_per_s": 46864.8},
     "predicted": {"mfu": 0.41136, "tokens_per_s": 44838.8}},
    {"stage": "torchtitan", "status": "not available", "note": "no torchtitan"},
    {"stage": "fp8", "status": "failed", "error": "RuntimeError: boom"},
    {"stage": "async_checkpoint", "status": "ok", "measured": {"stall_s": 0.0421}},
]}


def test_readme_table_cells() -> None:
    table = readme_table(RESULTS)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:]
            for line in table.splitlines() if line.startswith("| ")}
    assert table.startswith("Device: NVIDIA H100 80GB HBM3; mode: gpu.")
    assert rows["GPT-3 1.3B bf16: MFU"] == ["43.0%", "-", "-", "41.1% |"]
    assert rows["GPT-3 1.3B bf16: tokens/s"][0] == "46,865"
    llama = rows["Llama-3-8B cut bf16: tokens/s"]
    assert llama[:3] == ["unmeasured", "unmeasured", "unmeasured (not available)"]
    assert rows["1.3B fp8 tensorwise / bf16 tokens/s"][0] == "unmeasured (failed)"
    assert rows["async save: training stall s (buffers reserved)"][0] == "0.042"
    assert len(rows) == len(ROWS) + 1  # and the header
    empty = readme_table(None)
    assert "no GPU has run it yet" in empty and "43.0%" not in empty
    assert empty.count("unmeasured") == sum(c is not None for r in ROWS for c in r[1:])
    names = {name for name, _ in STAGES}  # every cell names a stage the benchmark runs
    assert {c[0] for r in ROWS for c in r[1:] if c is not None} <= names


def test_update_readme_replaces_only_the_table() -> None:
    text = f"intro\n{BEGIN}\nold\n{END}\nafter\n"
    assert update_readme(text, "NEW") == f"intro\n{BEGIN}\nNEW\n{END}\nafter\n"
    with pytest.raises(ValueError, match="markers"):
        update_readme("no markers", "NEW")


def test_parse_torchtitan_log() -> None:
    log = "\n".join(f"[titan] step: {i}  loss:  {9 - i}.5000  memory: 60.1GiB(77%)  "
                    f"tps: {t:,}  tflops: 400.0  mfu: {m}%" for i, (t, m) in
                    enumerate([(1000, 10.0), (20000, 40.5), (22000, 41.5), (21000, 41.0)]))
    got = parse_torchtitan(log, warm=1)
    assert got["tokens_per_s"] == 21000 and got["torchtitan_mfu"] == pytest.approx(0.41)
    assert (got["first_loss"], got["last_loss"], got["steps"]) == (9.5, 6.5, 4)
    with pytest.raises(RuntimeError, match="no 'tps:'"):
        parse_torchtitan("crashed", warm=1)
